"""Step-5 perception encoder (vision tower, two stride-2 downsamplers, projector), BF16, replicated per rank.

Math: patch conv (no bias) -> + absolute positions (bilinearly resized for crops) -> ln_pre -> pre-LN blocks with
2D RoPE and LayerScale -> last block's output (no ln_post) -> two 3x3 stride-2 convs -> projector (no bias).
Legend: N = views in a batch, S = view side in pixels, P = patch (14),
G = S / P patch grid per side (52 overview, 36 crop), T = G*G tokens, W = width (1536), H = heads,
D = head dim (96), G2 = grid after both downsamplers (13 / 9), Htxt = text hidden size.

Loading (done by model.py): build `VisionModel(cfg, text_hidden)` under `torch.device("meta")`, compare the
checkpoint header's shapes/dtypes with `state_dict()` (its keys are exactly the checkpoint's `vision_model.*`
and `vit_large_projector.weight` names), then `load_state_dict(tensors, strict=True, assign=True)`.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from config import VisionConfig, tokens_per_view

DTYPE = torch.bfloat16  # every vision weight is BF16 on disk and in memory


# --------------------------------------------------------------------------------------------------
# 2D RoPE, "lang" frequencies: w_k = theta^(-2k / (D/2)) per axis, the same angles for every head
def rope_cos_sin(grid: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos/sin, each [G*G, D]. Dims [0, D/2) rotate by column (x), dims [D/2, D) by row (y); the two dims
    of each interleaved pair share one angle. FP32 because angles reach ~51 rad, far beyond BF16 resolution."""
    half = head_dim // 2                                                                     # 48 dims per axis
    freqs = 1.0 / theta ** (torch.arange(0, half, 2, device=device, dtype=torch.float32) / half)  # [half/2]
    r, c = torch.meshgrid(torch.arange(grid, device=device, dtype=torch.float32),
                          torch.arange(grid, device=device, dtype=torch.float32), indexing="ij")
    ang_x = (c.reshape(-1, 1) * freqs).repeat_interleave(2, dim=-1)                        # [T, half] token t = r*G + c
    ang_y = (r.reshape(-1, 1) * freqs).repeat_interleave(2, dim=-1)                        # [T, half]
    ang = torch.cat([ang_x, ang_y], dim=-1)                                                # [T, D] x half first
    return ang.cos(), ang.sin()


def apply_rope2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] BF16 -> same. Pair (a, b) -> (a cos - b sin, b cos + a sin), computed in FP32 and rounded
    back to x's dtype once, as the reference does."""
    x32 = x.float()
    swapped = torch.stack((-x32[..., 1::2], x32[..., 0::2]), dim=-1).flatten(-2)           # (a, b) -> (-b, a)
    return (x32 * cos + swapped * sin).to(x.dtype)


# --------------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Fused-QKV self-attention with 2D RoPE; parameter names follow torch.nn.MultiheadAttention (on-disk names)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width, dtype=DTYPE))  # rows: Q | K | V, head-major
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width, dtype=DTYPE))
        self.out_proj = nn.Linear(width, width, dtype=DTYPE)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        N, T, W = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)                          # [N, T, 3W]
        q, k, v = qkv.view(N, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)      # each [N, H, T, D]
        q, k = apply_rope2d(q, cos, sin), apply_rope2d(k, cos, sin)                        # v is not rotated
        # non-causal, no mask: every token of a view sees the whole view (and nothing of other views)
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)           # [N, H, T, D]
        return self.out_proj(o.transpose(1, 2).reshape(N, T, W))                           # heads merged h*D + d


class LayerScale(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.empty(width, dtype=DTYPE))  # loaded per channel; 0.1 is only the init value

    def forward(self, x):
        return x * self.gamma


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.c_fc = nn.Linear(width, hidden, dtype=DTYPE)
        self.c_proj = nn.Linear(hidden, width, dtype=DTYPE)

    def forward(self, x):
        h = self.c_fc(x)                                 # [N, T, I]
        return self.c_proj(h * torch.sigmoid(1.702 * h))  # QuickGELU, not erf/tanh GELU


class Block(nn.Module):
    """Pre-LN block with LayerScale on both branches; the residual stream stays BF16."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        W, eps = cfg.width, cfg.layer_norm_eps
        self.ln_1 = nn.LayerNorm(W, eps=eps, dtype=DTYPE)
        self.attn = Attention(W, cfg.heads)
        self.ls_1 = LayerScale(W)
        self.ln_2 = nn.LayerNorm(W, eps=eps, dtype=DTYPE)
        self.mlp = MLP(W, cfg.mlp_hidden)
        self.ls_2 = LayerScale(W)

    def forward(self, x, cos, sin):
        x = x + self.ls_1(self.attn(self.ln_1(x), cos, sin))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.resblocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))


class PerceptionEncoder(nn.Module):
    """The checkpoint's `vision_model`: patch embed, abs positions, ln_pre, blocks, two downsampling convs."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        W, P, G0 = cfg.width, cfg.patch_size, cfg.grid
        self.conv1 = nn.Conv2d(cfg.num_channels, W, P, stride=P, bias=False, dtype=DTYPE)
        self.positional_embedding = nn.Parameter(torch.empty(G0 * G0, W, dtype=DTYPE))   # row r*G0 + c
        self.ln_pre = nn.LayerNorm(W, eps=cfg.layer_norm_eps, dtype=DTYPE)
        self.transformer = Transformer(cfg)
        self.vit_downsampler1 = nn.Conv2d(W, 2 * W, 3, stride=2, padding=1, dtype=DTYPE)
        self.vit_downsampler2 = nn.Conv2d(2 * W, 4 * W, 3, stride=2, padding=1, dtype=DTYPE)
        # derived tables, keyed so that assigning new weights or moving devices rebuilds them (not in state_dict)
        self._pos_cache, self._rope_cache = {}, {}

    def check_views(self, x: torch.Tensor, name: str = "pixels") -> int:
        """Validate a batch of views [N, C, S, S]; returns the patch grid G."""
        c = self.cfg
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            raise ValueError(f"{name}: expected a tensor [N, {c.num_channels}, S, S], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name}: expected floating-point (normalized) pixels, got dtype {x.dtype}")
        _, ch, h, w = x.shape
        if ch != c.num_channels:
            raise ValueError(f"{name}: {ch} channels in shape {tuple(x.shape)}, the encoder takes {c.num_channels}")
        if h != w:
            raise ValueError(f"{name}: views must be square, got {h}x{w}")
        if h == 0 or h % c.patch_size:
            raise ValueError(f"{name}: side {h} is not a positive multiple of the patch size {c.patch_size}")
        if h // c.patch_size > c.grid:
            raise ValueError(f"{name}: side {h} exceeds the native view size {c.image_size} "
                             f"(grid {h // c.patch_size} > {c.grid})")
        return h // c.patch_size

    def pos_table(self, grid: int) -> torch.Tensor:
        """Absolute positions for a G x G grid, [G*G, W] BF16: the stored table at the native grid, else a
        bilinear (align_corners=False, no antialias) resize of it viewed as a [W, G0, G0] image."""
        pe, G0 = self.positional_embedding, self.cfg.grid
        if grid == G0:
            return pe
        key = (id(pe), pe.device, pe.data_ptr())
        hit = self._pos_cache.get(grid)
        if hit is None or hit[0] != key:
            img = pe.float().t().reshape(1, -1, G0, G0)                                    # [1, W, G0, G0]
            # FP32 interpolation rounded once to BF16 equals the reference's BF16 kernel (float inside) up to rare ulps
            img = F.interpolate(img, size=(grid, grid), mode="bilinear", align_corners=False, antialias=False)
            hit = (key, img.reshape(-1, grid * grid).t().to(pe.dtype).contiguous())        # [G*G, W]
            self._pos_cache[grid] = hit
        return hit[1]

    def rope(self, grid: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (grid, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_cos_sin(grid, self.cfg.head_dim, self.cfg.rope_theta, device)
        return self._rope_cache[key]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C, S, S] pixels -> tower output (last block, no ln_post) [N, G*G, W] BF16."""
        G = self.check_views(x)
        x = x.to(device=self.conv1.weight.device, dtype=DTYPE)    # preprocessing gives FP32; the model runs BF16
        h = self.conv1(x).flatten(2).transpose(1, 2)              # [N, T, W], token t = r*G + c (row-major)
        h = self.ln_pre(h + self.pos_table(G))                    # positions are added BEFORE ln_pre
        cos, sin = self.rope(G, h.device)                         # [T, D] FP32 each
        for blk in self.transformer.resblocks:
            h = blk(h, cos, sin)
        return h

    def downsample(self, h: torch.Tensor) -> torch.Tensor:
        """[N, G*G, W] -> [N, G2*G2, 4W]: two 3x3 stride-2 pad-1 convs back to back, no activation or norm."""
        N, T, W = h.shape
        G = int(round(T ** 0.5))
        g = h.transpose(1, 2).reshape(N, W, G, G)                  # token r*G + c -> spatial (r, c)
        g = self.vit_downsampler2(self.vit_downsampler1(g))       # [N, 4W, G2, G2]
        return g.flatten(2).transpose(1, 2)                       # [N, G2*G2, 4W], row-major

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.encode(x))


class VisionModel(nn.Module):
    """Tower + projector; state_dict keys are exactly the checkpoint's vision names."""

    def __init__(self, cfg: VisionConfig, text_hidden: int, views_per_batch: int = 16):
        super().__init__()
        self.cfg = cfg
        self.vision_model = PerceptionEncoder(cfg)
        self.vit_large_projector = nn.Linear(4 * cfg.width, text_hidden, bias=False, dtype=DTYPE)
        # bounds activation memory; views never interact, so chunking changes no math (only GEMM shapes)
        self.views_per_batch = views_per_batch

    def tokens_per_view(self, side: int) -> int:
        return tokens_per_view(side, self.cfg.patch_size)

    def forward(self, x: torch.Tensor, name: str = "pixels") -> torch.Tensor:
        """Same-size square views [N, C, S, S] -> projected features [N, G2*G2, Htxt] BF16."""
        self.vision_model.check_views(x, name)
        return torch.cat([self.vit_large_projector(self.vision_model(x[i:i + self.views_per_batch]))
                          for i in range(0, x.shape[0], self.views_per_batch)])

    def image_features(self, pixel_values: torch.Tensor, patch_pixel_values: torch.Tensor | None = None,
                       num_patches=None) -> torch.Tensor:
        """Feature rows of all images in order, [sum_i(crop_rows * num_patches[i] + overview_rows), Htxt] BF16.

        pixel_values [..., C, S, S]: one overview per image (leading dims flattened). patch_pixel_values
        [..., C, s, s]: all crops, image-major. num_patches [n_img]: crops per image (default: none).
        Per image: its crops in the given order, then its overview. Overviews and crops run as separate batches.
        """
        C = self.cfg.num_channels
        ov = _flatten_views(pixel_values, "pixel_values", C)                              # [n_img, C, S, S]
        no_crops = patch_pixel_values is None or (isinstance(patch_pixel_values, torch.Tensor)
                                                  and patch_pixel_values.numel() == 0)
        cr = None if no_crops else _flatten_views(patch_pixel_values, "patch_pixel_values", C)  # [n_crop, C, s, s]
        n_img, n_crop = ov.shape[0], 0 if cr is None else cr.shape[0]
        if n_img == 0:
            raise ValueError("pixel_values holds no image")
        counts = [0] * n_img if num_patches is None else _int_list(num_patches, "num_patches")
        if len(counts) != n_img:
            raise ValueError(f"num_patches has {len(counts)} entries but pixel_values holds {n_img} images")
        if any(n < 0 for n in counts):
            raise ValueError(f"num_patches must be non-negative, got {counts}")
        if sum(counts) != n_crop:
            raise ValueError(f"sum(num_patches)={sum(counts)} but patch_pixel_values holds {n_crop} crops")
        self.vision_model.check_views(ov, "pixel_values")         # geometry errors before any compute
        if n_crop:
            self.vision_model.check_views(cr, "patch_pixel_values")
        ov_f = self(ov, "pixel_values")                                                    # [n_img, 169, Htxt]
        cr_f = self(cr, "patch_pixel_values") if n_crop else None                          # [n_crop, 81, Htxt]
        rows, off = [], 0
        for i, n in enumerate(counts):
            if n:
                rows.append(cr_f[off:off + n].flatten(0, 1))                               # crops first, row-major
            rows.append(ov_f[i])                                                           # then the overview
            off += n
        return torch.cat(rows)


def _flatten_views(x, name: str, channels: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.ndim < 3:
        raise ValueError(f"{name}: expected a tensor [..., {channels}, H, W], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.shape[-3] != channels:
        raise ValueError(f"{name}: {x.shape[-3]} channels in shape {tuple(x.shape)}, the encoder takes {channels}")
    return x.reshape(-1, *x.shape[-3:])


def _int_list(v, name: str) -> list[int]:
    vals = v.reshape(-1).tolist() if isinstance(v, torch.Tensor) else list(v)
    if not all(isinstance(n, (int, float)) and not isinstance(n, bool) and float(n).is_integer() for n in vals):
        raise ValueError(f"{name} must hold integers, got {vals}")
    return [int(n) for n in vals]
