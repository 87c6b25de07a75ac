"""Write a tiny random Step-5 checkpoint in the exact original layout.

Same tensor names, dtypes, FP8 block scales, config.json forms, safetensors index and tokenizer files as the
real 604B release, at a geometry small enough for CPU tests yet faithful in structure:
full attention every 4th layer (DSA), dense first layers and last layer, MoE in between, 4 KV groups,
every width divisible by TP = 1, 2, 4, 8 and 16, a DSA top-k of 4 regions (prompts > 40 tokens prune regions),
MTP layers after the main stack, a perception-encoder vision tower and projector.

    python tiny_checkpoint.py OUT [--bf16] [--text-only] [--seed N] [--set key=value ...]

Deterministic from the seed. It is also the README demo's embedded default.
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file

FP8_MAX = 448.0
MARKER = "TINY_STEP5_FIXTURE"  # marks a directory this script wrote (the CLI only ever replaces those)
# Random deep nets are chaotic: a last-bit difference (e.g. another TP size's partial sums) grows layer by layer
# into a different greedy token. Small output projections keep each layer a small update of the residual stream,
# as in trained models, so implementations that agree to rounding also agree on tokens.
OUT_GAIN = 0.2
BLOCK = 128  # FP8 weight_block_size of the release: 128 (out) x 128 (in)


def tiny_text_config(**overrides) -> dict:
    """Text config with the real field names; per-layer lists include the MTP tail like the real file."""
    c = dict(
        model_type="step5", architectures=["Step5ForCausalLM"],
        hidden_size=256, intermediate_size=512, num_hidden_layers=8, vocab_size=1024,
        num_attention_heads=16, num_attention_groups=4, head_dim=48,
        rms_norm_eps=1e-5, norm_dtype="float32", fp32_residual_connection=True,
        use_head_wise_attn_gate=True, sliding_window=16, max_position_embeddings=2048,
        # llama3 scaling that really rescales (the real values are an identity) so the path is exercised
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": 256,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        yarn_only_types=["full_attention"],
        use_moe=True, moe_num_experts=16, moe_top_k=4,
        moe_intermediate_size=192,  # not a multiple of 128: ragged FP8 scale blocks
        share_expert_dim=128, use_moe_router_bias=True, need_fp32_gate=True, norm_expert_weight=True,
        moe_router_scaling_factor=3.0, num_nextn_predict_layers=2, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=[1, 2],
        att_impl_type="GQA", torch_dtype="bfloat16",
        sparse_config={
            "enabled": True, "proxy_dim": 64, "sparse_indexer_rope_dim": 16, "sparse_indexer_use_rope": True,
            "sparse_indexer_num_heads": 16, "sparse_indexer_num_k_heads": 1,
            "sparse_indexer_q_norm_type": "rmsnorm", "sparse_indexer_k_norm_type": "layernorm",
            "sparse_indexer_csa_z_norm_type": "none", "sparse_indexer_softmax_variant": "ssmax",
            "sparse_indexer_ssmax_s_granularity": "q_head", "num_provider_groups": 4, "topk": 4,
            "region_block_size": 8, "compression_method": "csa_block_compress",
            "attention_impl": "sparse_gqa", "apply_to_layer_types": ["full_attention"]},
    )
    c.update(overrides)
    c.setdefault("num_experts_per_tok", c["moe_top_k"])  # the real file carries both spellings
    L, n_total = c["num_hidden_layers"], c["num_hidden_layers"] + c["num_nextn_predict_layers"]
    full = [i < L and i % 4 == 3 for i in range(n_total)]
    c.setdefault("layer_types", ["full_attention" if f else "sliding_attention" for f in full])
    c.setdefault("partial_rotary_factors", [1 / 3 if f else 1.0 for f in full])
    c.setdefault("rope_theta", [1e7 if f else 1e4 for f in full])
    c.setdefault("swiglu_limits", [7.0] * n_total)
    c.setdefault("swiglu_limits_shared", [7.0] * n_total)
    # dense first layers and last layer, MoE in between (real: dense 0,1,2,91; MoE 3..90)
    moe = c.pop("moe_layers", list(range(2, L - 1)))
    c.setdefault("moe_layer_list", moe)
    c.setdefault("moe_layers_enum", ",".join(str(i) for i in moe))
    for k in ("head_dim_full_attention", "head_dim_sliding_attention"):
        c.setdefault(k, c["head_dim"])
    for k in ("num_attention_groups_full_attention", "num_attention_groups_sliding_attention"):
        c.setdefault(k, c["num_attention_groups"])
    c.setdefault("num_sliding_attention_heads", c["num_attention_heads"])
    c.setdefault("max_seq_len", c["max_position_embeddings"])
    return c


def real_text_config(**overrides) -> dict:
    """The released Step-5 text geometry (92 layers, 352 experts, DSA top-512 of 8-token regions) with the real field
    names: for config tests at the real sizes and for the real-shape benchmarks (random weights, never written)."""
    sparse = dict(tiny_text_config()["sparse_config"], proxy_dim=256, sparse_indexer_rope_dim=32, topk=512)
    return tiny_text_config(**{**dict(
        hidden_size=4096, intermediate_size=13824, num_hidden_layers=92, vocab_size=128896, num_attention_heads=64,
        num_attention_groups=4, head_dim=192, sliding_window=512, moe_num_experts=352, moe_top_k=8,
        moe_intermediate_size=1536, share_expert_dim=1536, num_nextn_predict_layers=3, max_position_embeddings=1048576,
        moe_layers=list(range(3, 91)), rope_scaling={"rope_type": "llama3", "factor": 1.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 32.0, "original_max_position_embeddings": 1048576},
        sparse_config=sparse), **overrides})


def tiny_vision_config(**overrides) -> dict:
    c = dict(model_type="perception_encoder", width=32, layers=2, heads=2, mlp_ratio=2.0, patch_size=14,
             image_size=728, num_channels=3, hidden_act="quick_gelu", layer_norm_eps=1e-5, ls_init_value=0.1,
             use_cls_token=False, use_ln_pre=True, use_ln_post=False, use_abs_posemb=True, use_rope2d=True,
             output_dim=None, pool_type="none", vision_select_layer=-1)
    c.update(overrides)
    return c


# --------------------------------------------------------------------------------------------------
# special tokens: ids are fixed by their position in this list (the trainer assigns them first)
SPECIAL_TOKENS = ["<s>", "</s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<im_patch>", "<im_start>",
                  "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>"]
IMAGE_TOKEN = "<im_patch>"
# The Step-3.5 vocabulary's reasoning and tool markers (STEP5_CHAT.md §6), single special tokens; added after the BPE
# is trained, so they take the ids right after it and every other id stays where it was.
CHAT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# A chat template of the Step-3.5 form, written from STEP5_CHAT.md: BOS, then <|im_start|>ROLE\n ... <|im_end|>\n
# turns; tools in a first system turn; tool calls as <tool_call><function=NAME><parameter=KEY> blocks; consecutive
# tool results in one tool_response turn; reasoning written back only after the last user message; the generation
# prompt opens a reasoning block.
CHAT_TEMPLATE = (
    "{% macro text(c) %}{% if c is string %}{{ c }}{% elif c %}{% for p in c %}"
    "{% if p.type == 'image' %}<im_patch>{% elif p.text is defined %}{{ p.text }}"
    "{% elif p.value is defined %}{{ p.value }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{{ bos_token }}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ text(messages[0].content) }}\n\n{% endif %}"
    "# Tools\nYou may call one or more functions to assist with the user query. The functions follow in JSONSchema "
    "format:\n<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    "To call a function, answer ONLY in this format, with no suffix:\n<tool_call>\n<function=example_function>\n"
    "<parameter=example_parameter>\nvalue\n</parameter>\n</function>\n</tool_call>\n<IMPORTANT>\nThe "
    "<function=...> block nests inside <tool_call>; every required parameter must be given.\n</IMPORTANT>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and not (loop.first and tools) %}"
    "<|im_start|>{{ 'observation' if m.name == 'observation' and not loop.first else 'system' }}\n"
    "{{ text(m.content) }}<|im_end|>\n"
    "{% elif m.role == 'user' %}<|im_start|>user\n{{ text(m.content) }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}"
    "{% set content = text(m.content) %}{% set reasoning = '' %}"
    "{% if m.reasoning_content is string %}{% set reasoning = m.reasoning_content %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].strip('\n') %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user and reasoning %}<think>\n{{ reasoning }}\n</think>\n{% endif %}"
    "{{ content }}"
    "{% for tc in m.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}"
    "{% if content or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n<function={{ f.name }}>"
    "{% for k, v in (f.arguments or {}).items() %}{{ '\\n' }}<parameter={{ k }}>\n"
    "{% if v is mapping or (v is iterable and v is not string) %}{{ v | tojson }}{% else %}{{ v | string }}"
    "{% endif %}{{ '\\n' }}</parameter>{% endfor %}{{ '\\n' }}</function>\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>tool_response\n{% endif %}"
    "<tool_response>{{ text(m.content) }}</tool_response>"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
_CORPUS = [
    "Tensor parallelism splits each weight matrix across devices so every rank holds one slice.",
    "Expert parallelism places whole experts on different ranks and routes tokens to them.",
    "The quick brown fox jumps over the lazy dog while the model decodes one token at a time.",
    "Sparse attention selects the most relevant regions of the context for every query.",
    "请介绍一下张量并行。", "混合专家模型在每个词元上只激活少数专家。", "稀疏注意力为每个查询选择最相关的区域。",
    "今天天气很好，我们一起去公园散步吧。", "模型把图像切成小块，再把特征放进文本序列。",
    "Greedy decoding always picks the token with the highest logit; ties go to the lowest id.",
    "Numbers like 3.14159, 2048 and 128896 appear in configuration files and logs.",
]


def write_tokenizer(out_dir: str, vocab_size: int):
    """Byte-level BPE tokenizer.json + tokenizer_config.json; specials at ids 0..len(SPECIAL_TOKENS)-1, the chat
    markers (CHAT_TOKENS) right after the trained vocabulary, which leaves them room below vocab_size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size - len(CHAT_TOKENS), 1000), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(_CORPUS)] * 4 + _CORPUS * 8, trainer=trainer)
    first = tok.get_vocab_size()
    tok.add_special_tokens(CHAT_TOKENS)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    for i, s in enumerate(CHAT_TOKENS):
        assert tok.token_to_id(s) == first + i < vocab_size, (s, tok.token_to_id(s))
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizerFast",  # the legacy class name the real file carries
                   "bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "model_max_length": 1048576, "chat_template": CHAT_TEMPLATE}, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f, indent=2)


# --------------------------------------------------------------------------------------------------
def quantize_fp8_blocks(w: torch.Tensor):
    """[E, N, K] fp32 -> (e4m3 [E, N, K], fp32 scale_inv [E, ceil(N/128), ceil(K/128)]), real = q * scale_inv."""
    E, N, K = w.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    padded = torch.zeros(E, nb * BLOCK, kb * BLOCK)
    padded[:, :N, :K] = w
    blocks = padded.view(E, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-8)  # [E, nb, kb]
    scale = amax / FP8_MAX
    q = (blocks / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(E, nb * BLOCK, kb * BLOCK)
    return q[:, :N, :K].to(torch.float8_e4m3fn).contiguous(), scale.float().contiguous()


class _Gen:
    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, *shape, std=1.0):
        return torch.randn(*shape, generator=self.g) * std

    def linear(self, out, inp, gain=1.0):  # BF16 [out, in], std gain/sqrt(in)
        return self.normal(out, inp, std=gain / inp ** 0.5).to(torch.bfloat16)

    def centred_norm(self, n):  # zero-centred norm weight, F32
        return self.normal(n, std=0.1).float()


def text_tensors(cfg: dict, fp8: bool, g: _Gen) -> dict:
    """Every text tensor of the original checkpoint, MTP layers included, by exact name."""
    D, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    H, G, hd = cfg["num_attention_heads"], cfg["num_attention_groups"], cfg["head_dim"]
    E, F, S, I = cfg["moe_num_experts"], cfg["moe_intermediate_size"], cfg["share_expert_dim"], cfg["intermediate_size"]
    sp = cfg["sparse_config"]
    P, IH = sp["proxy_dim"], sp["sparse_indexer_num_heads"]
    bf16_moe = set(bf16_expert_layers(cfg)) if fp8 else set()
    t = {"model.embed_tokens.weight": g.normal(cfg["vocab_size"], D).to(torch.bfloat16),
         "model.norm.weight": g.centred_norm(D),
         # a large head scale gives clear top-1 margins, so greedy tokens are stable across TP sizes
         "lm_head.weight": g.linear(cfg["vocab_size"], D, gain=8.0)}

    def attn(p, full):
        t[p + "input_layernorm.weight"] = g.centred_norm(D)
        t[p + "post_attention_layernorm.weight"] = g.centred_norm(D)
        a = p + "self_attn."
        t[a + "q_proj.weight"] = g.linear(H * hd, D)
        t[a + "k_proj.weight"] = g.linear(G * hd, D)
        t[a + "v_proj.weight"] = g.linear(G * hd, D)
        t[a + "o_proj.weight"] = g.linear(D, H * hd, gain=OUT_GAIN)
        t[a + "g_proj.weight"] = g.linear(H, D)
        t[a + "q_norm.weight"] = g.centred_norm(hd)
        t[a + "k_norm.weight"] = g.centred_norm(hd)
        if full:
            t[a + "sparse_indexer_q.weight"] = g.linear(IH * P, D)
            t[a + "sparse_indexer_q_norm.weight"] = g.centred_norm(P)
            t[a + "sparse_indexer_k.weight"] = g.linear(P, D)
            t[a + "sparse_indexer_k_norm.weight"] = (1.0 + g.normal(P, std=0.1)).float()
            t[a + "sparse_indexer_k_norm.bias"] = g.normal(P, std=0.1).float()
            t[a + "sparse_indexer_z.weight"] = g.linear(P, D)
            t[a + "sparse_indexer_w.weight"] = g.normal(IH, D, std=D ** -0.5).float()
            t[a + "ssmax_s"] = torch.full((H,), 0.08495759963989258)

    def dense(p, inter):
        t[p + "mlp.gate_proj.weight"] = g.linear(inter, D)
        t[p + "mlp.up_proj.weight"] = g.linear(inter, D)
        t[p + "mlp.down_proj.weight"] = g.linear(D, inter, gain=OUT_GAIN)

    moe_layers = set(cfg["moe_layer_list"])
    for i in range(L):
        p = f"model.layers.{i}."
        attn(p, cfg["layer_types"][i] == "full_attention")
        if i not in moe_layers:
            dense(p, I)
            continue
        t[p + "moe.gate.weight"] = g.linear(E, D)
        t[p + "moe.router_bias"] = g.normal(E, std=0.1).float()
        for name, (n, k) in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
            w = g.normal(E, n, k, std=(OUT_GAIN if name == "down_proj" else 1.0) * k ** -0.5)
            if fp8 and i not in bf16_moe:
                t[p + f"moe.{name}.weight"], t[p + f"moe.{name}.weight_scale_inv"] = quantize_fp8_blocks(w)
            else:
                t[p + f"moe.{name}.weight"] = w.to(torch.bfloat16)
        t[p + "share_expert.gate_proj.weight"] = g.linear(S, D)
        t[p + "share_expert.up_proj.weight"] = g.linear(S, D)
        t[p + "share_expert.down_proj.weight"] = g.linear(D, S, gain=OUT_GAIN)
    for i in range(L, L + cfg["num_nextn_predict_layers"]):  # MTP tail: present on disk, never executed
        p = f"model.layers.{i}."
        attn(p, False)
        dense(p, I)
        t[p + "eh_proj.weight"] = g.linear(D, 2 * D)
        t[p + "enorm.weight"] = g.centred_norm(D)
        t[p + "hnorm.weight"] = g.centred_norm(D)
        t[p + "transformer.shared_head.norm.weight"] = g.centred_norm(D)
        t[p + "transformer.shared_head.output.weight"] = g.linear(cfg["vocab_size"], D)
    return t


def vision_tensors(vc: dict, text_hidden: int, g: _Gen) -> dict:
    """The perception encoder's tensors (all BF16) under their on-disk names."""
    W, P, C = vc["width"], vc["patch_size"], vc["num_channels"]
    grid = vc["image_size"] // P
    hid = int(W * vc["mlp_ratio"])
    bf = lambda x: x.to(torch.bfloat16)
    t = {"vision_model.conv1.weight": bf(g.normal(W, C, P, P, std=(C * P * P) ** -0.5)),
         "vision_model.positional_embedding": bf(g.normal(grid * grid, W, std=0.5)),
         "vision_model.ln_pre.weight": bf(1.0 + g.normal(W, std=0.1)),
         "vision_model.ln_pre.bias": bf(g.normal(W, std=0.1))}
    for b in range(vc["layers"]):
        p = f"vision_model.transformer.resblocks.{b}."
        t[p + "ln_1.weight"] = bf(1.0 + g.normal(W, std=0.1))
        t[p + "ln_1.bias"] = bf(g.normal(W, std=0.1))
        t[p + "attn.in_proj_weight"] = g.linear(3 * W, W)
        t[p + "attn.in_proj_bias"] = bf(g.normal(3 * W, std=0.1))
        t[p + "attn.out_proj.weight"] = g.linear(W, W)
        t[p + "attn.out_proj.bias"] = bf(g.normal(W, std=0.1))
        t[p + "ls_1.gamma"] = bf(g.normal(W, std=0.3))
        t[p + "ln_2.weight"] = bf(1.0 + g.normal(W, std=0.1))
        t[p + "ln_2.bias"] = bf(g.normal(W, std=0.1))
        t[p + "mlp.c_fc.weight"] = g.linear(hid, W)
        t[p + "mlp.c_fc.bias"] = bf(g.normal(hid, std=0.1))
        t[p + "mlp.c_proj.weight"] = g.linear(W, hid)
        t[p + "mlp.c_proj.bias"] = bf(g.normal(W, std=0.1))
        t[p + "ls_2.gamma"] = bf(g.normal(W, std=0.3))
    t["vision_model.vit_downsampler1.weight"] = bf(g.normal(2 * W, W, 3, 3, std=(9 * W) ** -0.5))
    t["vision_model.vit_downsampler1.bias"] = bf(g.normal(2 * W, std=0.1))
    t["vision_model.vit_downsampler2.weight"] = bf(g.normal(4 * W, 2 * W, 3, 3, std=(18 * W) ** -0.5))
    t["vision_model.vit_downsampler2.bias"] = bf(g.normal(4 * W, std=0.1))
    t["vit_large_projector.weight"] = g.linear(text_hidden, 4 * W, gain=4.0)
    return t


def bf16_expert_layers(cfg: dict) -> list:
    """MoE layers kept BF16 in the FP8 checkpoint (real: the last three MoE layers, 88-90)."""
    return cfg["moe_layer_list"][-1:]


def make_checkpoint(out_dir: str, *, fp8: bool = True, vl: bool = True, seed: int = 0, n_files: int = 4,
                    text_overrides: dict | None = None, vision_overrides: dict | None = None) -> str:
    """Write the checkpoint into out_dir (created; must not hold a checkpoint already). Returns out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    tc = tiny_text_config(**(text_overrides or {}))
    g = _Gen(seed)
    tensors = text_tensors(tc, fp8, g)
    quant = None
    if fp8:
        bf = bf16_expert_layers(tc)
        # spelled in the serving framework's vocabulary, as the real file does (only the layer index matters)
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                 "weight_block_size": [BLOCK, BLOCK],
                 "modules_to_not_convert": ["lm_head", "vision_model", "vit_large_projector"]
                 + [f"model.layers.{i}.moe.experts.{w}" for i in bf for w in ("w13_weight", "w2_weight")]}
    if vl:
        vc = tiny_vision_config(**(vision_overrides or {}))
        tensors.update(vision_tensors(vc, tc["hidden_size"], g))
        cfg = {"model_type": "step5_vl", "architectures": ["Step5ForConditionalGeneration"],
               "text_config": tc, "vision_config": vc, "image_token_id": SPECIAL_TOKENS.index(IMAGE_TOKEN),
               "projector_bias": False, "understand_projector_stride": 2, "image_token_len": 169,
               "patch_token_len": 81, "torch_dtype": "bfloat16"}
        if quant:
            cfg["quantization_config"] = quant
    else:
        cfg = dict(tc)
        if quant:
            cfg["quantization_config"] = quant

    # Spread over n_files shard files, by sorted name like the real release; the index is the only truth.
    names = sorted(tensors)
    per = -(-len(names) // n_files)
    weight_map, total = {}, 0
    for f in range(n_files):
        fname = f"model-{f + 1:05d}-of-{n_files:05d}.safetensors"
        chunk = {n: tensors[n].contiguous() for n in names[f * per:(f + 1) * per]}
        if f == n_files - 1:
            # a duplicate physical copy the index does not name (the real model-00024 carries MTP copies)
            dup = names[0]
            chunk.setdefault(dup, tensors[dup].contiguous())
        for n in names[f * per:(f + 1) * per]:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
        save_file(chunk, os.path.join(out_dir, fname), metadata={"format": "pt"})
    # an extra file not referenced by the index (the real checkpoint ships model-mtp3-00001 / vit.safetensors)
    save_file({"model.norm.weight": torch.zeros(tc["hidden_size"])}, os.path.join(out_dir, "extra-unindexed.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    write_tokenizer(out_dir, tc["vocab_size"])
    open(os.path.join(out_dir, MARKER), "w").close()
    return out_dir


def _parse_value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--bf16", action="store_true", help="BF16 experts, no quantization_config")
    ap.add_argument("--text-only", action="store_true", help="text-only config form, no vision tensors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--files", type=int, default=4, help="number of shard files")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a text-config field, e.g. --set moe_num_experts=64")
    args = ap.parse_args()
    if os.path.isdir(args.out_dir) and os.listdir(args.out_dir):
        if not os.path.exists(os.path.join(args.out_dir, MARKER)):
            raise SystemExit(f"error: {args.out_dir} is not empty and was not written by tiny_checkpoint.py; "
                             "refusing to overwrite it")
        shutil.rmtree(args.out_dir)  # our own earlier fixture: regenerate it whole
    overrides = dict(kv.split("=", 1) for kv in args.set)
    make_checkpoint(args.out_dir, fp8=not args.bf16, vl=not args.text_only, seed=args.seed, n_files=args.files,
                    text_overrides={k: _parse_value(v) for k, v in overrides.items()})
    print(f"wrote tiny Step-5 checkpoint to {args.out_dir}")
