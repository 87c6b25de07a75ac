"""Step-5 configuration: the text decoder's and the vision tower's config dataclasses, read from the checkpoint's own
config.json field names, and the TP layout rules that derive from them. No torch kernels, no Triton: convert.py and
the tests import this alone."""
import json
import math
from dataclasses import dataclass, field

# The shards' layout version, stored under the metadata key "step4_tp_layout" (convert.py writes it, model.py checks
# it): the key keeps the structure's release name, which every existing shard carries.
LAYOUT_VERSION = "gqa-provider-shared-tp-v2"
TEXT_MODEL_TYPES = ("step5", "step4")  # step4: the release's/preview mirrors' spelling of the same structure
VL_MODEL_TYPES = ("step5_vl", "step3p5v")


class ConfigError(ValueError):
    """A config field is missing, inconsistent or unsupported; the message names the field."""


class DuplicateKey(ValueError):
    """A JSON object names one key twice; the message names the key."""


def unique_keys(pairs: list) -> dict:
    """json object_pairs_hook: refuse an object that names a key twice (json would silently keep the last value)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DuplicateKey(f"key {json.dumps(key)} appears twice in one JSON object")
    return d


# --------------------------------------------------------------------------------------------------
# configuration


def group_window(n_groups: int, tp: int, rank: int) -> tuple[int, int]:
    """Contiguous range (first, count) of KV / indexer-provider groups rank `rank` holds (layout v2).

    Query heads are split contiguously, so with tp > n_groups a group is duplicated on tp // n_groups adjacent
    ranks; with tp <= n_groups the groups are partitioned.
    """
    if n_groups % tp == 0:
        count = n_groups // tp
        return rank * count, count
    if tp % n_groups == 0:
        return rank // (tp // n_groups), 1
    raise ConfigError(f"tp_size={tp} neither divides nor is a multiple of the group count {n_groups}")


_JSON_TYPE = {str: "string", bool: "boolean", type(None): "null", list: "array", dict: "object", float: "float",
              int: "integer"}


def _check_types(d: dict, ints: tuple, floats: tuple = (), prefix: str = ""):
    """Refuse a present field of the wrong JSON type, by name, before int()/float() would accept "32" or truncate 32.5
    (and before two spellings of a field are compared, which would report "32 differs from 32")."""
    for keys, want, ok in ((ints, "an integer", (int,)), (floats, "a number", (int, float))):
        for k in keys:
            v = d.get(k, 0)
            if isinstance(v, bool) or not isinstance(v, ok):
                raise ConfigError(f"{prefix}{k}={json.dumps(v)} must be {want} "
                                  f"(got a JSON {_JSON_TYPE.get(type(v), type(v).__name__)})")


def _check_finite(v, name: str = ""):
    """Refuse NaN / Infinity / -Infinity anywhere in a config (Python's json reads them as floats, and one would
    reach every norm, RoPE table or clamp that uses the field), naming the field by its path."""
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{name}={json.dumps(v)} is not a finite number")
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        _check_finite(x, f"{name}[{k}]" if isinstance(v, list) else f"{name}.{k}" if name else str(k))


@dataclass
class SparseConfig:
    """DSA parameters (`sparse_config`)."""
    proxy_dim: int
    rope_dim: int
    n_heads: int
    n_provider_groups: int
    topk: int
    block: int  # region_block_size: tokens per region
    apply_to_layer_types: list

    @classmethod
    def from_dict(cls, d: dict, n_kv_groups: int) -> "SparseConfig | None":
        if not d or not d.get("enabled", False):
            return None
        expect = {"sparse_indexer_num_k_heads": 1, "sparse_indexer_q_norm_type": "rmsnorm",
                  "sparse_indexer_k_norm_type": "layernorm", "sparse_indexer_csa_z_norm_type": "none",
                  "compression_method": "csa_block_compress", "attention_impl": "sparse_gqa",
                  "sparse_indexer_use_rope": True}
        for k, v in expect.items():
            if k in d and d[k] != v:
                raise ConfigError(f"sparse_config.{k}={d[k]!r} is not supported (only {v!r})")
        _check_types(d, ("proxy_dim", "sparse_indexer_rope_dim", "sparse_indexer_num_heads", "num_provider_groups",
                          "topk", "region_block_size"), prefix="sparse_config.")
        s = cls(proxy_dim=int(d["proxy_dim"]), rope_dim=int(d["sparse_indexer_rope_dim"]),
                n_heads=int(d["sparse_indexer_num_heads"]), n_provider_groups=int(d["num_provider_groups"]),
                topk=int(d["topk"]), block=int(d["region_block_size"]),
                apply_to_layer_types=list(d.get("apply_to_layer_types", ["full_attention"])))
        if s.n_provider_groups != n_kv_groups:
            raise ConfigError(f"sparse_config.num_provider_groups={s.n_provider_groups} must equal "
                              f"num_attention_groups={n_kv_groups}")
        if s.n_heads % s.n_provider_groups:
            raise ConfigError(f"sparse_config.sparse_indexer_num_heads={s.n_heads} is not divisible by "
                              f"num_provider_groups={s.n_provider_groups}")
        if s.rope_dim % 2 or s.rope_dim > s.proxy_dim:
            raise ConfigError(f"sparse_config.sparse_indexer_rope_dim={s.rope_dim} must be even and <= proxy_dim")
        return s


def _moe_layers(d: dict) -> list[int]:
    """`moe_layer_list` (ints) and/or `moe_layers_enum` ("3,4,...,90"): either, and they must agree."""
    a = d.get("moe_layer_list")
    b = d.get("moe_layers_enum")
    if isinstance(b, str):
        b = [int(x) for x in b.split(",") if x.strip()]
    if a is not None and b is not None and sorted(a) != sorted(b):
        raise ConfigError(f"moe_layer_list={a} and moe_layers_enum={d['moe_layers_enum']!r} disagree")
    layers = a if a is not None else b
    if layers is None:
        if d.get("use_moe", True) is False:
            return []
        raise ConfigError("config has neither moe_layer_list nor moe_layers_enum (refusing to guess the MoE layers)")
    return sorted(int(i) for i in layers)


def _per_layer(d: dict, key: str, n: int, default, total: int | None = None):
    """A per-layer list of at least n entries; a scalar is broadcast to `total` (main + MTP layers) entries."""
    v = d.get(key, default)
    if not isinstance(v, list):
        v = [v] * (total or n)
    if len(v) < n:
        raise ConfigError(f"{key} has {len(v)} entries, fewer than num_hidden_layers={n}")
    return list(v)


@dataclass
class Step5Config:
    """The text decoder's config, read from the checkpoint's own field names (text config or `text_config`)."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_attention_groups: int
    head_dim: int
    rms_norm_eps: float
    sliding_window: int
    max_position_embeddings: int
    layer_types: list
    rope_theta: list
    partial_rotary_factors: list
    rope_scaling: dict | None
    yarn_only_types: list
    moe_layers: list
    moe_num_experts: int
    moe_top_k: int
    moe_intermediate_size: int
    share_expert_dim: int
    moe_router_scaling_factor: float
    norm_expert_weight: bool
    swiglu_limits: list
    swiglu_limits_shared: list
    num_nextn_predict_layers: int
    sparse: SparseConfig | None
    eos_token_id: list
    quantization_config: dict | None = None
    tp_size: int = 1
    expert_parallel_size: int = 1
    tp_layout_version: str | None = None
    mtp_layers_kept: int = 0  # MTP layers convert.py --keep-mtp wrote into the shards (0: none, the default)
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict, quantization_config: dict | None = None) -> "Step5Config":
        mt = d.get("model_type")
        if mt is not None and mt not in TEXT_MODEL_TYPES:
            raise ConfigError(f"text model_type={mt!r} is not a Step-5 text decoder ({', '.join(TEXT_MODEL_TYPES)})")
        req = ["hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
               "num_attention_groups", "head_dim"]
        missing = [k for k in req if k not in d]
        if missing:
            raise ConfigError(f"config is missing {', '.join(missing)}")
        _check_types(d, ints=(*req, "sliding_window", "max_position_embeddings", "moe_num_experts", "moe_top_k",
                              "moe_intermediate_size", "share_expert_dim", "num_nextn_predict_layers",
                              "mtp_layers_kept",
                              # second spellings, compared with the first below
                              "num_experts_per_tok", "num_key_value_heads", "n_routed_experts",
                              "head_dim_full_attention", "head_dim_sliding_attention",
                              "num_attention_groups_full_attention", "num_attention_groups_sliding_attention",
                              "num_sliding_attention_heads"),
                     floats=("rms_norm_eps", "moe_router_scaling_factor"))
        # sizes, counts and the norm's epsilon: 0 or less passes every shape check and then fails late (a window of
        # 0, eps <= 0 dividing by 0) or silently (top-k 0 routes to no expert)
        for k in (*req, "sliding_window", "max_position_embeddings", "moe_num_experts", "moe_top_k",
                  "num_experts_per_tok", "moe_intermediate_size", "rms_norm_eps"):
            if k in d and not d[k] > 0:
                raise ConfigError(f"{k}={json.dumps(d[k])} must be > 0")
        L = int(d["num_hidden_layers"])
        nextn = int(d.get("num_nextn_predict_layers", 1))
        layer_types = d.get("layer_types") or ["full_attention"] * (L + nextn)
        if len(layer_types) != L + nextn:
            raise ConfigError(f"layer_types has {len(layer_types)} entries; expected num_hidden_layers + "
                              f"num_nextn_predict_layers = {L + nextn}")
        for i, t in enumerate(layer_types[:L]):
            if t not in ("full_attention", "sliding_attention"):
                raise ConfigError(f"layer_types[{i}]={t!r} is not full_attention or sliding_attention")
        # the same fact under two field names (checkpoints in circulation carry either or both): either is
        # accepted, disagreement is refused
        for a, b in (("moe_top_k", "num_experts_per_tok"), ("num_attention_groups", "num_key_value_heads"),
                     ("moe_num_experts", "n_routed_experts")):
            if a in d and b in d and d[a] != d[b]:
                raise ConfigError(f"{a}={d[a]} and {b}={d[b]} disagree")
        eos = d.get("eos_token_id", [1, 2])
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        # fields some Step-family files carry: only the values every port agrees on are supported
        for k, v in (("att_impl_type", "GQA"), ("moe_router_activation", "sigmoid")):
            if k in d and d[k] != v:
                raise ConfigError(f"{k}={d[k]!r} is not supported (only {v!r})")
        for k, v in (("head_dim_full_attention", "head_dim"), ("head_dim_sliding_attention", "head_dim"),
                     ("num_attention_groups_full_attention", "num_attention_groups"),
                     ("num_attention_groups_sliding_attention", "num_attention_groups"),
                     ("num_sliding_attention_heads", "num_attention_heads")):
            if k in d and d[k] != d[v]:
                raise ConfigError(f"{k}={d[k]} differs from {v}={d[v]}; per-type overrides are not supported")
        theta = d.get("rope_theta", 1.0)
        for i, t in enumerate(theta if isinstance(theta, list) else [theta]):
            if isinstance(t, (int, float)) and not t > 0:
                raise ConfigError(f"rope_theta{f'[{i}]' if isinstance(theta, list) else ''}={json.dumps(t)} must be > 0")
        if "use_rope_layers" in d and not all(d["use_rope_layers"]):
            raise ConfigError("use_rope_layers with a false entry is not supported")
        q = d.get("quantization_config", quantization_config) or None
        if q and q.get("quant_method") != "fp8":
            raise ConfigError(f"quantization_config.quant_method={q.get('quant_method')!r}: only 'fp8' "
                              "(block-scaled e4m3) is supported")
        if q and list(q.get("weight_block_size", [128, 128])) != [128, 128]:
            raise ConfigError(f"quantization_config.weight_block_size={q['weight_block_size']} is not [128, 128]")
        rs = d.get("rope_scaling")
        if rs and rs.get("rope_type", rs.get("type")) != "llama3":
            raise ConfigError(f"rope_scaling.rope_type={rs.get('rope_type', rs.get('type'))!r}: only 'llama3' "
                              "is supported")
        tp = d.get("tp_size", 1)
        ep = d.get("expert_parallel_size", tp)
        for name, v in (("tp_size", tp), ("expert_parallel_size", ep)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        c = cls(
            hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=L, vocab_size=int(d["vocab_size"]),
            num_attention_heads=int(d["num_attention_heads"]), num_attention_groups=int(d["num_attention_groups"]),
            head_dim=int(d["head_dim"]), rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            sliding_window=int(d.get("sliding_window", 512)),
            max_position_embeddings=int(d.get("max_position_embeddings", 524288)),
            layer_types=list(layer_types), rope_theta=_per_layer(d, "rope_theta", L, 10000.0, L + nextn),
            partial_rotary_factors=_per_layer(d, "partial_rotary_factors", L, 1.0, L + nextn),
            rope_scaling=rs or None, yarn_only_types=list(d.get("yarn_only_types", [])),
            moe_layers=_moe_layers(d), moe_num_experts=int(d.get("moe_num_experts", 352)),
            moe_top_k=int(d.get("moe_top_k", 8)), moe_intermediate_size=int(d.get("moe_intermediate_size", 1536)),
            share_expert_dim=int(d.get("share_expert_dim", 1536)),
            moe_router_scaling_factor=float(d.get("moe_router_scaling_factor", 3.0)),
            norm_expert_weight=bool(d.get("norm_expert_weight", True)),
            swiglu_limits=_per_layer(d, "swiglu_limits", L, 7.0) if d.get("swiglu_limits") else [7.0] * L,
            swiglu_limits_shared=(_per_layer(d, "swiglu_limits_shared", L, 7.0)
                                  if d.get("swiglu_limits_shared") else [7.0] * L),
            num_nextn_predict_layers=nextn,
            sparse=SparseConfig.from_dict(d.get("sparse_config"), int(d["num_attention_groups"])),
            eos_token_id=eos, quantization_config=q, tp_size=tp, expert_parallel_size=ep,
            tp_layout_version=d.get("tp_layout_version"), mtp_layers_kept=int(d.get("mtp_layers_kept", 0)), raw=d)
        c.validate()
        return c

    def validate(self):
        tp, L = self.tp_size, self.num_hidden_layers
        if self.expert_parallel_size != tp:
            raise ConfigError(f"expert_parallel_size={self.expert_parallel_size} must equal tp_size={tp} "
                              "(co-located TP/EP)")
        if tp > 1 and self.tp_layout_version != LAYOUT_VERSION:
            raise ConfigError(f"tp_layout_version={self.tp_layout_version!r}: shards of tp_size={tp} must use "
                              f"{LAYOUT_VERSION!r}; older layouts are numerically wrong, reconvert")
        for name, n in (("num_attention_heads", self.num_attention_heads), ("intermediate_size", self.intermediate_size),
                        ("share_expert_dim", self.share_expert_dim), ("moe_num_experts", self.moe_num_experts),
                        ("vocab_size", self.vocab_size)):
            if n % tp:
                raise ConfigError(f"{name}={n} is not divisible by tp_size={tp}")
        if self.num_attention_heads % self.num_attention_groups:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                              f"num_attention_groups={self.num_attention_groups}")
        group_window(self.num_attention_groups, tp, 0)
        if self.n_local_heads % self.n_local_groups:
            raise ConfigError(f"tp_size={tp}: {self.n_local_heads} local query heads do not divide over "
                              f"{self.n_local_groups} local KV groups")
        if not 0 <= self.mtp_layers_kept <= self.num_nextn_predict_layers:
            raise ConfigError(f"mtp_layers_kept={self.mtp_layers_kept} must be between 0 and "
                              f"num_nextn_predict_layers={self.num_nextn_predict_layers}")
        for name in ("rope_theta", "partial_rotary_factors"):  # the kept MTP layers need their entries too
            if len(getattr(self, name)) < L + self.mtp_layers_kept:
                raise ConfigError(f"{name} has {len(getattr(self, name))} entries; the {self.mtp_layers_kept} kept MTP "
                                  f"layers need num_hidden_layers + mtp_layers_kept = {L + self.mtp_layers_kept}")
        for i in self.moe_layers:
            if not 0 <= i < L:
                raise ConfigError(f"MoE layer {i} is outside 0..num_hidden_layers-1={L - 1}")
        if self.moe_layers and self.moe_top_k > self.moe_num_experts:
            raise ConfigError(f"moe_top_k={self.moe_top_k} exceeds moe_num_experts={self.moe_num_experts}")
        for i in range(L):
            if self.rope_span(i) < 2 or self.rope_span(i) > self.head_dim:
                raise ConfigError(f"partial_rotary_factors[{i}]={self.partial_rotary_factors[i]} gives an invalid "
                                  f"rotary span for head_dim={self.head_dim}")

    # ---- derived, per layer
    def is_dsa(self, i: int) -> bool:
        return self.sparse is not None and self.layer_types[i] in self.sparse.apply_to_layer_types

    def is_moe(self, i: int) -> bool:
        return i in self.moe_layers

    def rope_span(self, i: int) -> int:
        span = int(round(self.head_dim * float(self.partial_rotary_factors[i])))
        return span - span % 2  # forced even (NEOX pairs)

    def rope_scaled(self, i: int) -> bool:
        return self.rope_scaling is not None and (not self.yarn_only_types or self.layer_types[i] in self.yarn_only_types)

    def clamp(self, i: int, shared: bool = False) -> float | None:
        """SwiGLU limit of layer i; a 0/null entry means no clamp (Step-family convention). Whether the lists cover
        the MTP layers is open in the release; an MTP layer without an entry takes the default limit, 7."""
        limits = self.swiglu_limits_shared if shared else self.swiglu_limits
        v = limits[i] if i < len(limits) else 7.0
        return float(v) if v else None

    def config_fp8_layers(self) -> set[int]:
        """MoE layers the quantization_config declares FP8 (release rule: modules_to_not_convert entries name the
        BF16 layers by their first all-digit component). Empty without an fp8 quantization_config."""
        if not self.quantization_config:
            return set()
        bf16 = set()
        for entry in self.quantization_config.get("modules_to_not_convert") or []:
            digits = [p for p in str(entry).split(".") if p.isdigit()]
            if digits:
                bf16.add(int(digits[0]))
        return {i for i in self.moe_layers if i not in bf16}

    # ---- derived, rank-local sizes (rank-independent)
    @property
    def n_local_heads(self) -> int:
        return self.num_attention_heads // self.tp_size

    @property
    def n_local_groups(self) -> int:
        return group_window(self.num_attention_groups, self.tp_size, 0)[1]

    @property
    def n_local_experts(self) -> int:
        return self.moe_num_experts // self.tp_size


@dataclass
class Step5VLConfig:
    """Composite VL config: `text_config` + `vision_config` + image token id."""
    text: Step5Config
    vision: "VisionConfig"
    image_token_id: int
    projector_bias: bool = False


def parse_config(d: dict, source: str = "config.json") -> tuple[Step5Config, "Step5VLConfig | None"]:
    """Either config form -> (text config, VL config or None). The structure decides, not the name: a dict
    `text_config` means the composite VL form; otherwise the text fields are at the top level."""
    try:
        _check_finite(d)
        if isinstance(d.get("text_config"), dict):
            if d.get("model_type") not in VL_MODEL_TYPES + (None,):
                raise ConfigError(f"model_type={d.get('model_type')!r} with a text_config is not a Step-5 VL "
                                  f"composite ({', '.join(VL_MODEL_TYPES)})")
            text = dict(d["text_config"])
            for k in ("tp_size", "expert_parallel_size", "tp_layout_version", "mtp_layers_kept"):
                if k in d and k not in text:
                    text[k] = d[k]
            tc = Step5Config.from_dict(text, d.get("quantization_config"))
            if not isinstance(d.get("vision_config"), dict):
                raise ConfigError("composite config has a text_config but no vision_config")
            vc = VisionConfig.from_dict(d["vision_config"])
            if "image_token_id" not in d:
                raise ConfigError("composite config has no image_token_id")
            if d.get("projector_bias"):
                raise ConfigError("projector_bias=true is not supported (the checkpoint's projector has no bias)")
            return tc, Step5VLConfig(tc, vc, int(d["image_token_id"]))
        return Step5Config.from_dict(d), None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{source}: malformed config ({type(e).__name__}: {e})") from None


def load_config(path: str) -> tuple[Step5Config, "Step5VLConfig | None", dict]:
    try:
        with open(path) as f:
            d = json.load(f, object_pairs_hook=unique_keys)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a JSON file") from None
    except DuplicateKey as e:
        raise ConfigError(f"{path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    tc, vl = parse_config(d, path)
    return tc, vl, d



@dataclass
class VisionConfig:
    width: int
    layers: int
    heads: int
    mlp_hidden: int
    patch_size: int
    image_size: int
    num_channels: int
    layer_norm_eps: float
    rope_theta: float

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        def get(*names, default=None):
            present = [n for n in names if n in d]
            if len({repr(d[n]) for n in present}) > 1:  # two spellings of one field must agree
                raise ConfigError(f"vision_config: {' / '.join(f'{n}={d[n]!r}' for n in present)} disagree")
            for n in present:
                return d[n]
            if default is None:
                raise ConfigError(f"vision_config has no {' / '.join(map(repr, names))}")
            return default

        checks = [("model_type", d.get("model_type", "perception_encoder"), "perception_encoder"),
                  ("vision_select_layer", d.get("vision_select_layer", -1), -1),
                  ("rope_freqs_for", d.get("rope_freqs_for", "lang"), "lang"),
                  ("use_rope2d", d.get("use_rope2d", True), True),
                  ("use_cls_token", get("use_cls_token", "ues_cls_token", default=False), False),
                  ("use_ln_post", d.get("use_ln_post", False), False),
                  ("use_ln_pre", d.get("use_ln_pre", True), True),
                  ("use_abs_posemb", d.get("use_abs_posemb", True), True),
                  ("hidden_act", d.get("hidden_act", "quick_gelu"), "quick_gelu"),
                  ("pool_type", d.get("pool_type", "none") or "none", "none"),
                  ("output_dim", d.get("output_dim"), None)]
        for name, got, want in checks:
            if got != want:
                raise ConfigError(f"vision_config.{name}={got!r} is not supported (only {want!r})")
        width = int(get("width", "hidden_size"))
        layers = int(get("layers", "num_hidden_layers"))
        heads = int(get("heads", "num_attention_heads"))
        if width % heads or (width // heads) % 4:
            raise ConfigError(f"vision_config: width={width} / heads={heads} must give a head dim divisible by 4")
        c = cls(width=width, layers=layers, heads=heads,
                mlp_hidden=int(width * float(d.get("mlp_ratio", 8960 / 1536))),
                patch_size=int(d.get("patch_size", 14)), image_size=int(d.get("image_size", 728)),
                num_channels=int(d.get("num_channels", 3)), layer_norm_eps=float(d.get("layer_norm_eps", 1e-5)),
                rope_theta=float(d.get("rope_theta", 10000.0))
                * float(d.get("rope_theta_rescale_factor", 1.0)) ** ((width // heads) / (width // heads - 2)))
        if c.image_size % c.patch_size:
            raise ConfigError(f"vision_config.image_size={c.image_size} is not a multiple of patch_size={c.patch_size}")
        return c

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def tokens_per_view(side: int, patch_size: int = 14) -> int:
    """Feature rows of one square view: two 3x3 stride-2 pad-1 convs give ceil(G/2) twice (728 -> 169, 504 -> 81)."""
    g = side // patch_size
    g2 = ((g + 1) // 2 + 1) // 2
    return g2 * g2
