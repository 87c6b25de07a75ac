"""Step-5 perception encoder (vision tower, two stride-2 downsamplers, projector), BF16, replicated per rank."""
from dataclasses import dataclass


class VisionConfigError(ValueError):
    pass


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
            for n in names:
                if n in d:
                    return d[n]
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
                raise VisionConfigError(f"vision_config.{name}={got!r} is not supported (only {want!r})")
        width = int(get("width", "hidden_size"))
        layers = int(get("layers", "num_hidden_layers"))
        heads = int(get("heads", "num_attention_heads"))
        if width % heads or (width // heads) % 4:
            raise VisionConfigError(f"vision_config: width={width} / heads={heads} must give a head dim divisible by 4")
        c = cls(width=width, layers=layers, heads=heads,
                mlp_hidden=int(width * float(d.get("mlp_ratio", 8960 / 1536))),
                patch_size=int(d.get("patch_size", 14)), image_size=int(d.get("image_size", 728)),
                num_channels=int(d.get("num_channels", 3)), layer_norm_eps=float(d.get("layer_norm_eps", 1e-5)),
                rope_theta=float(d.get("rope_theta", 10000.0))
                * float(d.get("rope_theta_rescale_factor", 1.0)) ** ((width // heads) / (width // heads - 2)))
        if c.image_size % c.patch_size:
            raise VisionConfigError(f"vision_config.image_size={c.image_size} is not a multiple of patch_size={c.patch_size}")
        return c

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size
