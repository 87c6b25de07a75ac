"""Tests of the Step-5 vision path.

The perception encoder of vision_encoder.py: configuration guards, real-geometry shapes and the 667-tensor
inventory (on the meta device: the 47-layer tower never runs on CPU), an independent plain-PyTorch reference
written here and compared on the tiny checkpoint's encoder (with a negative control), the position-table resize,
2D RoPE, the downsampler layout and image_features ordering / bad inputs.
The multimodal model (the FP8 VL tiny checkpoint through convert.py and model.py): the pixel path equals the
image_embeds path, bad multimodal inputs raise one ValueError, an image request gets the in-process tokens through
generate.py under torchrun and its own tokens in a batch with a text request (decisions pinned), and an unsupported
vision mode fails at load. (conftest.py at the repository root sets TRITON_INTERPRET before kernel.py is imported.)
"""
import json
import math
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import config
import helpers
import model as M
import tiny_checkpoint
from config import ConfigError, VisionConfig
from invariants import NOISE, ROOT, pinned, tokens_agree_up_to_near_tie
from vision_encoder import VisionModel, apply_rope2d, rope_cos_sin, tokens_per_view

BF16 = torch.bfloat16

REAL_VISION_CONFIG = dict(model_type="perception_encoder", width=1536, layers=47, heads=16, mlp_ratio=8960 / 1536,
                          patch_size=14, image_size=728, num_channels=3, hidden_act="quick_gelu",
                          layer_norm_eps=1e-5, ls_init_value=0.1, ues_cls_token=False, use_ln_pre=True,
                          use_ln_post=False, use_abs_posemb=True, use_rope2d=True, output_dim=None,
                          pool_type="none", vision_select_layer=-1)
TEXT_HIDDEN = 4096


def real_model_on_meta() -> VisionModel:
    with torch.device("meta"):
        return VisionModel(VisionConfig.from_dict(REAL_VISION_CONFIG), TEXT_HIDDEN)


# ==================================================================================================
# 1. Configuration
def test_real_config_parses():
    c = VisionConfig.from_dict(REAL_VISION_CONFIG)
    assert (c.width, c.layers, c.heads, c.mlp_hidden, c.head_dim) == (1536, 47, 16, 8960, 96)
    assert (c.patch_size, c.image_size, c.grid, c.num_channels) == (14, 728, 52, 3)
    assert c.layer_norm_eps == 1e-5 and c.rope_theta == 10000.0


def test_config_aliases_parse_to_same_sizes():
    d = dict(REAL_VISION_CONFIG)
    for a, b in (("width", "hidden_size"), ("layers", "num_hidden_layers"), ("heads", "num_attention_heads")):
        d[b] = d.pop(a)
    assert VisionConfig.from_dict(d) == VisionConfig.from_dict(REAL_VISION_CONFIG)


@pytest.mark.parametrize("field, value", [("vision_select_layer", -2), ("rope_freqs_for", "pixel"),
                                          ("rope_freqs_for", "constant"), ("use_cls_token", True),
                                          ("ues_cls_token", True), ("use_ln_post", True), ("hidden_act", "gelu"),
                                          ("use_rope2d", False), ("use_abs_posemb", False)])
def test_unsupported_mode_raises_naming_field(field, value):
    with pytest.raises(ConfigError, match=field.replace("ues_", "use_")):
        VisionConfig.from_dict({**REAL_VISION_CONFIG, field: value})


def test_missing_width_raises():
    d = dict(REAL_VISION_CONFIG)
    del d["width"]
    with pytest.raises(ConfigError, match="width"):
        VisionConfig.from_dict(d)


# ==================================================================================================
# 2. Real geometry on the meta device: tensor inventory (the release's 667 BF16 tensors) and token counts
def expected_real_inventory() -> dict:
    W, I, Htxt = 1536, 8960, 4096
    inv = {"vision_model.conv1.weight": (W, 3, 14, 14), "vision_model.positional_embedding": (2704, W),
           "vision_model.ln_pre.weight": (W,), "vision_model.ln_pre.bias": (W,),
           "vision_model.vit_downsampler1.weight": (2 * W, W, 3, 3), "vision_model.vit_downsampler1.bias": (2 * W,),
           "vision_model.vit_downsampler2.weight": (4 * W, 2 * W, 3, 3), "vision_model.vit_downsampler2.bias": (4 * W,),
           "vit_large_projector.weight": (Htxt, 4 * W)}
    for b in range(47):
        p = f"vision_model.transformer.resblocks.{b}."
        inv.update({p + "ln_1.weight": (W,), p + "ln_1.bias": (W,), p + "attn.in_proj_weight": (3 * W, W),
                    p + "attn.in_proj_bias": (3 * W,), p + "attn.out_proj.weight": (W, W),
                    p + "attn.out_proj.bias": (W,), p + "ls_1.gamma": (W,), p + "ln_2.weight": (W,),
                    p + "ln_2.bias": (W,), p + "mlp.c_fc.weight": (I, W), p + "mlp.c_fc.bias": (I,),
                    p + "mlp.c_proj.weight": (W, I), p + "mlp.c_proj.bias": (W,), p + "ls_2.gamma": (W,)})
    return inv


def test_real_state_dict_matches_inventory():
    sd = real_model_on_meta().state_dict()
    inv = expected_real_inventory()
    assert len(inv) == 667 and len(sd) == 667
    assert {k: tuple(v.shape) for k, v in sd.items()} == inv
    assert all(v.dtype == BF16 for v in sd.values())
    assert sum(v.numel() for v in sd.values()) == 1_981_014_784  # the release's total: 3,962,029,568 bytes in BF16


@pytest.mark.parametrize("batch", [1, 2, 7])
@pytest.mark.parametrize("side, grid, rows", [(728, 52, 169), (504, 36, 81)])
@pytest.mark.slow
def test_real_geometry_shapes(batch, side, grid, rows):
    m = real_model_on_meta()
    x = torch.empty(batch, 3, side, side, device="meta")
    assert m.vision_model.encode(x).shape == (batch, grid * grid, 1536)
    assert m(x).shape == (batch, rows, TEXT_HIDDEN)
    assert m.tokens_per_view(side) == tokens_per_view(side) == rows


def test_real_geometry_image_features_rows():
    m = real_model_on_meta()
    f = m.image_features(torch.empty(2, 3, 728, 728, device="meta"), torch.empty(5, 3, 504, 504, device="meta"),
                         [3, 2])
    assert f.shape == (81 * 5 + 169 * 2, TEXT_HIDDEN) and f.dtype == BF16


# ==================================================================================================
# 3. Independent reference (the math written out, not vision_encoder.py's modules): FP32 math, rounded to BF16 where
# a BF16 module rounds its output (linears, convs, norms, RoPE, attention, QuickGELU, LayerScale, residual adds)
def rnd(t):  # round to BF16, keep FP32 storage
    return t.to(BF16).float()


def ref_resize_matrix(n_in: int, n_out: int) -> torch.Tensor:
    """[n_out, n_in] 1-D bilinear weights, align_corners=False (F.interpolate's per-axis rule written out)."""
    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    s = n_in / n_out
    for i in range(n_out):
        src = max(0.0, (i + 0.5) * s - 0.5)
        i0 = math.floor(src)
        i1 = min(i0 + 1, n_in - 1)
        lam = src - i0
        m[i, i0] += 1 - lam
        m[i, i1] += lam
    return m


def ref_pos_table(table: torch.Tensor, g0: int, g: int) -> torch.Tensor:
    if g == g0:
        return table.float()
    m = ref_resize_matrix(g0, g)
    t = table.double().reshape(g0, g0, -1)                              # [row, col, W]
    return torch.einsum("ia,jb,abw->ijw", m, m, t).reshape(g * g, -1).float()


def ref_rope(x: torch.Tensor, g: int, theta: float) -> torch.Tensor:
    """x [N, H, T, D] FP32. Pairs as complex numbers: pair j of the x half turns by c*w_j, of the y half by r*w_j."""
    D = x.shape[-1]
    n = D // 4                                                          # frequencies per axis
    t = torch.arange(g * g)
    r, c = (t // g).double(), (t % g).double()
    w = torch.tensor([theta ** (-2 * k / (D // 2)) for k in range(n)], dtype=torch.float64)
    phi = torch.cat([c[:, None] * w, r[:, None] * w], dim=1)           # [T, D/2]
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], D // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(phi), phi)).reshape(x.shape).float()


def ref_layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def ref_conv3x3_s2(x, wt, b):
    """x [N, Ci, G, G] -> [N, Co, ceil(G/2)^2] by the cross-correlation sum
    y[o, i, j] = b[o] + sum_{c,u,v} W[o, c, u, v] * x[c, 2i+u-1, 2j+v-1], zero outside the grid."""
    G = x.shape[-1]
    go = (G + 1) // 2
    xp = F.pad(x, (1, 1, 1, 1))                                         # index 2i+u-1 of x is 2i+u of xp
    out = b[None, :, None, None].expand(x.shape[0], -1, go, go).clone()
    for u in range(3):
        for v in range(3):
            out += torch.einsum("oc,ncij->noij", wt[:, :, u, v], xp[:, :, u:u + 2 * go:2, v:v + 2 * go:2])
    return out


def ref_encoder(w: dict, vc: dict, x: torch.Tensor):
    """-> (tower output [N, G*G, W], projected features [N, G2*G2, Htxt]), both FP32 holding BF16 values."""
    f = {k: v.float() for k, v in w.items()}
    W, P, heads = vc["width"], vc["patch_size"], vc["heads"]
    g0, eps, D = vc["image_size"] // P, vc["layer_norm_eps"], W // heads
    N, C, S, _ = x.shape
    G = S // P
    x = rnd(x)
    # patch embedding as one matmul per patch; flattened patch vector ordered (ch, u, v), tokens row-major
    patches = x.reshape(N, C, G, P, G, P).permute(0, 2, 4, 1, 3, 5).reshape(N, G * G, C * P * P)
    h = rnd(patches @ f["vision_model.conv1.weight"].reshape(W, -1).T)
    h = rnd(h + rnd(ref_pos_table(w["vision_model.positional_embedding"], g0, G)))
    h = rnd(ref_layernorm(h, f["vision_model.ln_pre.weight"], f["vision_model.ln_pre.bias"], eps))
    for b in range(vc["layers"]):
        p = f"vision_model.transformer.resblocks.{b}."
        z = rnd(ref_layernorm(h, f[p + "ln_1.weight"], f[p + "ln_1.bias"], eps))
        qkv = rnd(z @ f[p + "attn.in_proj_weight"].T + f[p + "attn.in_proj_bias"])
        q, k, v = (qkv[..., i * W:(i + 1) * W].reshape(N, G * G, heads, D).transpose(1, 2) for i in range(3))
        q, k = rnd(ref_rope(q, G, 10000.0)), rnd(ref_rope(k, G, 10000.0))
        att = torch.softmax((q @ k.transpose(-1, -2)) * D ** -0.5, dim=-1)   # FP32 softmax, no mask
        o = rnd(att @ v).transpose(1, 2).reshape(N, G * G, W)
        a = rnd(o @ f[p + "attn.out_proj.weight"].T + f[p + "attn.out_proj.bias"])
        h = rnd(h + rnd(f[p + "ls_1.gamma"] * a))
        z = rnd(ref_layernorm(h, f[p + "ln_2.weight"], f[p + "ln_2.bias"], eps))
        u = rnd(z @ f[p + "mlp.c_fc.weight"].T + f[p + "mlp.c_fc.bias"])
        u = rnd(u * torch.sigmoid(1.702 * u))
        m = rnd(u @ f[p + "mlp.c_proj.weight"].T + f[p + "mlp.c_proj.bias"])
        h = rnd(h + rnd(f[p + "ls_2.gamma"] * m))
    tower = h
    grid = h.transpose(1, 2).reshape(N, W, G, G)
    y = rnd(ref_conv3x3_s2(grid, f["vision_model.vit_downsampler1.weight"], f["vision_model.vit_downsampler1.bias"]))
    y = rnd(ref_conv3x3_s2(y, f["vision_model.vit_downsampler2.weight"], f["vision_model.vit_downsampler2.bias"]))
    y = y.flatten(2).transpose(1, 2)                                    # [N, G2*G2, 4W]
    return tower, rnd(y @ f["vit_large_projector.weight"].T)


# --- the tiny checkpoint's vision weights, loaded the way model.py's loader will (meta build, check, assign)
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tiny_checkpoint.make_checkpoint(str(tmp_path_factory.mktemp("tiny_vl")), fp8=False, vl=True)
    with open(os.path.join(d, "config.json")) as fh:
        cfg = json.load(fh)
    with open(os.path.join(d, "model.safetensors.index.json")) as fh:
        wmap = json.load(fh)["weight_map"]
    names = [n for n in wmap if n.startswith(("vision_model.", "vit_large_projector."))]
    w = {}
    for fname in sorted({wmap[n] for n in names}):
        with safe_open(os.path.join(d, fname), "pt") as sf:
            w.update({n: sf.get_tensor(n) for n in names if wmap[n] == fname})
    vc = cfg["vision_config"]
    with torch.device("meta"):
        model = VisionModel(VisionConfig.from_dict(vc), cfg["text_config"]["hidden_size"])
    sd = model.state_dict()
    assert set(sd) == set(w)
    assert all(sd[n].shape == w[n].shape and sd[n].dtype == w[n].dtype for n in w)
    model.load_state_dict(w, strict=True, assign=True)
    return model.eval(), w, vc


def pixels(n, side, seed):
    return torch.randn(n, 3, side, side, generator=torch.Generator().manual_seed(seed))  # CLIP-normalized scale


# Tolerance: both sides round to BF16 at the same points, so differences come from accumulation order and
# rare 1-ulp rounding flips. Required: per-token cosine > 0.9999 and max|diff| < 2% of max|ref| at every stage.
@pytest.mark.parametrize("side", [728, 504])
def test_encoder_matches_independent_reference(tiny, side):
    model, w, vc = tiny
    x = pixels(2, side, seed=side)
    with torch.no_grad():
        tower = model.vision_model.encode(x).float()
        feats = model(x).float()
    ref_tower, ref_feats = ref_encoder(w, vc, x)
    for got, ref in ((tower, ref_tower), (feats, ref_feats)):
        assert got.shape == ref.shape
        cos = F.cosine_similarity(got, ref, dim=-1)
        rel = (got - ref).abs().max() / ref.abs().max()
        print(f"side {side} {tuple(got.shape)}: min cosine {cos.min():.6f}, max|diff|/max|ref| {rel:.2e}")
        assert cos.min() > 0.9999 and rel < 2e-2
    assert feats.shape == (2, tokens_per_view(side), 256)


def test_reference_detects_wrong_layer_scale(tiny):
    """Negative control: the comparison is sensitive (a hard-coded LayerScale of 0.1 must fail it)."""
    model, w, vc = tiny
    bad = dict(w)
    for b in range(vc["layers"]):
        for g in ("ls_1", "ls_2"):
            bad[f"vision_model.transformer.resblocks.{b}.{g}.gamma"] = torch.full((vc["width"],), 0.1, dtype=BF16)
    x = pixels(1, 504, seed=1)
    with torch.no_grad():
        feats = model(x).float()
    cos = F.cosine_similarity(feats, ref_encoder(bad, vc, x)[1], dim=-1)
    assert cos.min() < 0.99


# ==================================================================================================
# 4. Position-table resize
def test_pos_table_native_is_identity(tiny):
    model = tiny[0]
    assert torch.equal(model.vision_model.pos_table(52), model.vision_model.positional_embedding)


def test_pos_table_36_is_bilinear_align_corners_false(tiny):
    enc = tiny[0].vision_model
    pe = enc.positional_embedding.detach()
    img = pe.float().T.reshape(1, -1, 52, 52)
    want = F.interpolate(img, size=(36, 36), mode="bilinear", align_corners=False, antialias=False)
    want = want.reshape(-1, 36 * 36).T
    got = enc.pos_table(36)
    assert got.shape == (1296, pe.shape[1]) and got.dtype == BF16
    assert torch.equal(got, want.to(BF16))                                   # exact: one rounding of the FP32 result
    manual = ref_pos_table(pe, 52, 36)                                       # the per-axis rule written out
    assert (manual - want).abs().max() < 1e-5
    assert enc.pos_table(36) is got                                          # cached per grid size
    corners = F.interpolate(img, size=(36, 36), mode="bilinear", align_corners=True).reshape(-1, 1296).T
    assert (corners.to(BF16).float() - got.float()).abs().max() > 0.1        # negative control
    anti = F.interpolate(img, size=(36, 36), mode="bilinear", align_corners=False, antialias=True).reshape(-1, 1296).T
    assert (anti.to(BF16).float() - got.float()).abs().max() > 0.1


def test_resize_matrix_source_coordinates():
    m = ref_resize_matrix(52, 36)                            # (i + 0.5) * 52/36 - 0.5 = 0.2222, 1.6667, 3.1111, ...
    src = (m * torch.arange(52, dtype=torch.float64)).sum(1)
    assert torch.allclose(src[:3], torch.tensor([2 / 9, 5 / 3, 28 / 9], dtype=torch.float64))
    assert abs(src[-1].item() - 50.7778) < 1e-4


# ==================================================================================================
# 5. 2D RoPE
def test_rope_origin_unchanged_and_matches_pair_loop():
    G, D = 6, 16
    cos, sin = rope_cos_sin(G, D, 10000.0)
    assert cos.dtype == torch.float32 and cos.shape == (G * G, D)
    x = torch.randn(2, 3, G * G, D).to(BF16)
    y = apply_rope2d(x, cos, sin)
    assert torch.equal(y[:, :, 0], x[:, :, 0])
    # naive per-pair loop: pair j of the first half turns by c * w_k, of the second half by r * w_k
    xf, want = x.float(), torch.empty(2, 3, G * G, D)
    for t in range(G * G):
        r, c = divmod(t, G)
        for j in range(D // 2):
            k = j % (D // 4)
            phi = (c if j < D // 4 else r) * 10000.0 ** (-2 * k / (D // 2))
            a, b = xf[..., t, 2 * j], xf[..., t, 2 * j + 1]
            want[..., t, 2 * j] = a * math.cos(phi) - b * math.sin(phi)
            want[..., t, 2 * j + 1] = b * math.cos(phi) + a * math.sin(phi)
    assert (y.float() - want).abs().max() <= 2 ** -7 * want.abs().max()      # one BF16 rounding


def test_rope_axis_order():
    G, D = 5, 16
    cos, sin = rope_cos_sin(G, D, 10000.0)
    v = torch.randn(D)
    for half, moves_with in ((0, "col"), (1, "row")):
        x = torch.zeros(G * G, D)
        x[:, half * D // 2:(half + 1) * D // 2] = v[half * D // 2:(half + 1) * D // 2]
        y = apply_rope2d(x, cos, sin).reshape(G, G, D)                       # [row, col, D]
        same_col = torch.allclose(y[0], y[3])                                # rows differ, column equal
        same_row = torch.allclose(y[:, 0], y[:, 3])                          # columns differ, row equal
        assert (same_col, same_row) == ((True, False) if moves_with == "col" else (False, True))


def test_rope_relative_property():
    G, D = 8, 16
    cos, sin = rope_cos_sin(G, D, 10000.0)
    q, k = torch.randn(D, dtype=torch.float64).float(), torch.randn(D).float()
    Q = apply_rope2d(q.expand(G * G, D).contiguous(), cos, sin)
    K = apply_rope2d(k.expand(G * G, D).contiguous(), cos, sin)
    t = lambda r, c: r * G + c
    assert torch.allclose(Q[t(1, 2)] @ K[t(3, 5)], Q[t(4, 1)] @ K[t(6, 4)], atol=1e-4)


# ==================================================================================================
# 6. Downsampler layout (index-coded grid through identity-like convs)
@pytest.mark.parametrize("G", [52, 36])
def test_downsampler_row_major_layout(G):
    cfg = VisionConfig.from_dict(tiny_checkpoint.tiny_vision_config())
    model = VisionModel(cfg, 256)
    W = cfg.width
    with torch.no_grad():
        for conv, cin in ((model.vision_model.vit_downsampler1, W), (model.vision_model.vit_downsampler2, 2 * W)):
            conv.weight.zero_()
            conv.bias.zero_()
            conv.weight[torch.arange(cin), torch.arange(cin), 1, 1] = 1      # centre tap copies channel c -> c
    tok = torch.zeros(1, G * G, W, dtype=BF16)
    t = torch.arange(G * G)
    tok[0, :, 0], tok[0, :, 1] = (t // G).to(BF16), (t % G).to(BF16)        # channel 0 = row, 1 = column
    out = model.vision_model.downsample(tok)
    G2 = ((G + 1) // 2 + 1) // 2
    assert out.shape == (1, G2 * G2, 4 * W)
    i = torch.arange(G2 * G2)
    assert torch.equal(out[0, :, 0].float(), (4 * (i // G2)).float())          # output (i, j) <- input (4i, 4j)
    assert torch.equal(out[0, :, 1].float(), (4 * (i % G2)).float())


# ==================================================================================================
# 7. image_features: ordering and bad inputs
def test_image_features_order(tiny):
    model = tiny[0]
    ov = pixels(2, 728, seed=10)
    cr = pixels(3, 504, seed=11)
    with torch.no_grad():
        feats = model.image_features(ov.reshape(1, 2, 3, 728, 728), cr, torch.tensor([2, 1]))
        one = lambda v: model(v[None])[0]                                    # each view alone
        want = torch.cat([one(cr[0]), one(cr[1]), one(ov[0]), one(cr[2]), one(ov[1])])
        swapped = torch.cat([one(cr[1]), one(cr[0]), one(ov[0]), one(cr[2]), one(ov[1])])
        alone = model.image_features(ov[1:])                                 # no crops: overview only
    # batched vs single-view runs may differ by BF16 rounding flips (CPU GEMM blocking depends on batch size)
    err = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    assert feats.shape == (2 * 169 + 3 * 81, 256) and feats.dtype == BF16
    assert err(feats, want) < 1e-2 and err(alone, one(ov[1])) < 1e-2
    assert err(feats, swapped) > 0.2                                         # the check can see a crop swap


@pytest.mark.parametrize("args, match", [
    ((pixels(2, 728, 0), pixels(3, 504, 0), [2]), "num_patches has 1 entries"),
    ((pixels(2, 728, 0), pixels(3, 504, 0), [2, 2]), r"sum\(num_patches\)=4"),
    ((pixels(2, 728, 0), pixels(3, 504, 0), [4, -1]), "non-negative"),
    ((pixels(1, 728, 0), None, [1]), r"sum\(num_patches\)=1 .* 0 crops"),
    ((pixels(1, 728, 0), torch.empty(0, 3, 504, 504), [1]), "0 crops"),
    ((pixels(1, 728, 0), None, [0.5]), "integers"),
    ((torch.randn(1, 4, 728, 728), None, None), "4 channels"),
    ((pixels(1, 728, 0), torch.randn(1, 1, 504, 504), [1]), "patch_pixel_values: 1 channels"),
    ((torch.randn(1, 3, 728, 504), None, None), "square"),
    ((pixels(1, 720, 0), None, None), "side 720 is not a positive multiple of the patch size"),
    ((pixels(1, 742, 0), None, None), "exceeds the native view size"),
    ((pixels(1, 728, 0), pixels(1, 770, 0), [1]), "patch_pixel_values: side 770"),
    ((torch.zeros(1, 3, 728, 728, dtype=torch.uint8), None, None), "floating-point"),
    ((torch.randn(3, 728), None, None), "pixel_values: expected a tensor"),
    ((torch.empty(0, 3, 728, 728), None, None), "no image"),
])
def test_image_features_bad_input(tiny, args, match):
    with pytest.raises(ValueError, match=match):
        tiny[0].image_features(*args)


# ==================================================================================================
# 8. Model-level multimodal tests (Step5ForConditionalGeneration)
#
# With the FP8 VL tiny checkpoint converted by convert.py and loaded by model.py: the pixel path and the image_embeds
# path give the same tokens; bad multimodal inputs raise one clear ValueError; through generate.py under torchrun
# an image request gives the in-process tokens, and in a batch with a text request each gets the tokens it gets
# alone; an unsupported vision mode in the per-rank config fails at load.
IM_START, IM_PATCH, IM_END = 6, 5, 7
EOS8 = [1, 2, 4]
NEW8 = 4


def mm_prompt(n_feat: int) -> list:
    head = [11 + (7 * i) % 900 for i in range(9)]
    tail = [300 + (13 * i) % 700 for i in range(6)]
    return head + [IM_START] + [IM_PATCH] * n_feat + [IM_END] + tail


@pytest.fixture(scope="module")
def vl_out(converted):
    """vl_out(tp) -> OUT/tp{tp} of the FP8 VL tiny checkpoint, converted on first use."""
    return lambda tp: converted("fp8_vl", tp)


@pytest.fixture(scope="module")
def vl_model(tp1_models):
    m = tp1_models("fp8_vl")
    assert isinstance(m, M.Step5ForConditionalGeneration)
    return m


def complete(m, prompts, images=None):
    """Greedy completions of NEW8 tokens; images: per request None or a dict of image inputs."""
    return helpers.generate(m, prompts, NEW8, EOS8, images)[0]


def overview(seed=0):
    return torch.randn(1, 3, 728, 728, generator=torch.Generator().manual_seed(seed))


def crops(seed=1):
    return torch.randn(2, 3, 504, 504, generator=torch.Generator().manual_seed(seed))


def test_mm_pixel_path_equals_image_embeds_path(vl_model):
    m = vl_model
    pv = overview()
    feats = m.image_features(pixel_values=pv)
    assert feats.shape == (169, 256) and feats.dtype == BF16
    p = mm_prompt(169)
    by_pixels = complete(m, [p], [dict(pixel_values=pv)])
    assert by_pixels == complete(m, [p], [dict(image_embeds=feats)])
    # the image really enters the prefill: other features change the logits
    ids = torch.tensor(p)
    a = m.forward(ids, m.new_cache(1, len(p) + 1), [len(p)], embeds=m.input_embeds(ids, feats))
    b = m.forward(ids, m.new_cache(1, len(p) + 1), [len(p)], embeds=m.input_embeds(ids, feats.flip(0)))
    assert not torch.equal(a, b)


def test_mm_two_crops_pixel_path_equals_image_embeds_path(vl_model):
    m = vl_model
    pv, pp = overview(), crops()
    feats = m.image_features(pixel_values=pv, patch_pixel_values=pp, num_patches=[2])
    assert feats.shape == (2 * 81 + 169, 256)
    p = mm_prompt(2 * 81 + 169)
    got = complete(m, [p], [dict(pixel_values=pv, patch_pixel_values=pp, num_patches=[2])])
    assert got == complete(m, [p], [dict(image_embeds=feats)])


@pytest.mark.parametrize("n_ph, kw, match", [
    (168, dict(pixel_values=overview()), r"168 image placeholder\(s\) \(id 5\) .* 169 feature row"),
    (169, dict(pixel_values=overview(), image_embeds=torch.zeros(169, 256)), "exclusive"),
    (169, dict(pixel_values=torch.randn(1, 4, 728, 728)), "4 channels"),
    (331, dict(pixel_values=overview(), patch_pixel_values=crops(), num_patches=[3]), r"sum\(num_patches\)=3 .* 2 crops"),
    (331, dict(pixel_values=overview(), patch_pixel_values=crops(), num_patches=[1, 1]), "num_patches has 2 entries"),
])
def test_mm_bad_inputs_raise_value_error(vl_model, n_ph, kw, match):
    with pytest.raises(ValueError, match=match):
        complete(vl_model, [mm_prompt(n_ph)], [kw])


def _torchrun(n, *args):
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", f"--nproc-per-node={n}",
           "generate.py", *map(str, args)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, "\n".join(x for x in r.stderr.splitlines() if not x.startswith(("W1", "E1")))[:6000]
    return json.loads(r.stdout)


@pytest.mark.slow
def test_mm_generate_image_request_through_the_cli_and_in_batch(vl_model, vl_out, tmp_path):
    """The CLI's image path gives the in-process tokens at TP=1 exactly (TP=2 and 4 with images: the pinned cross-TP
    comparison of tests/test_generate.py). In a batch with a text request each gets its tokens alone (the batch's
    decisions pinned, as another batch size rounds its GEMMs differently; a token may differ at a measured near-tie)."""
    pv = overview()
    save_file({"pixel_values": pv.contiguous()}, str(tmp_path / "img.safetensors"))
    p = mm_prompt(169)
    with open(tmp_path / "p.json", "w") as f:
        json.dump({"prompt_ids": p}, f)
    want = complete(vl_model, [p], [dict(pixel_values=pv)])[0]
    doc = _torchrun(1, "--tp-dir", vl_out(1), "--ep-size", 1, "--prompt-json", tmp_path / "p.json",
                    "--image-inputs", tmp_path / "img.safetensors", "--max-new-tokens", NEW8, "--json")
    assert doc["prompt_token_count"] == len(p)
    assert doc["completion_token_ids"] == want
    # a batch mixing a text request and the image request (image path relative to the batch file)
    text = [11 + (29 * i) % 1000 for i in range(20)]
    with open(tmp_path / "batch.json", "w") as f:
        json.dump({"prompts": [{"prompt_ids": text}, {"prompt_ids": p, "image_inputs": "img.safetensors"}]}, f)
    doc = _torchrun(1, "--tp-dir", vl_out(1), "--ep-size", 1, "--prompt-json-batch", tmp_path / "batch.json",
                    "--max-new-tokens", NEW8, "--json")
    imgs = [None, dict(pixel_values=pv)]
    with pinned(vl_model, M.Pins()) as rec:
        batch = complete(vl_model, [text, p], imgs)
    assert [r["completion_token_ids"] for r in doc["results"]] == batch  # the CLI batch is the in-process batch
    for b, (ids, img) in enumerate(zip([text, p], imgs)):
        with pinned(vl_model, M.Pins(rec.data, requests=[b])):
            alone = complete(vl_model, [ids], [img])[0]
        tokens_agree_up_to_near_tie(vl_model, ids, alone, batch[b], NOISE["fp8"], img)


def test_mm_unsupported_vision_select_layer_fails_at_load(vl_out, tmp_path):
    d = tmp_path / "tp1"
    shutil.copytree(vl_out(1), d)
    with open(d / "config-r0.json") as f:
        cfg = json.load(f)
    cfg["vision_config"]["vision_select_layer"] = -2
    with open(d / "config-r0.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="vision_select_layer"):
        config.load_config(str(d / "config-r0.json"))
    with open(tmp_path / "p.json", "w") as f:
        json.dump([11, 12, 13], f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    r = subprocess.run([sys.executable, "generate.py", "--tp-dir", d, "--ep-size", "1", "--prompt-json",
                        tmp_path / "p.json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "vision_select_layer" in err[0] and "config-r0.json" in err[0], r.stderr[-2000:]
