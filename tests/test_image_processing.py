"""Raw-image preprocessing (STEP5_VISION.md section 6) and the per-image placeholder block (section 5.2).

Layout numbers come from the spec's worked-example table (6.3) at the released view geometry (728 / 504, patch 14);
the block's <im_patch> count is checked against the feature rows the tiny checkpoint's vision model really produces.
"""
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast

import tiny_checkpoint
from config import VisionConfig, tokens_per_view
from image_processing import (CLIP_MEAN, CLIP_STD, Geometry, ImageError, geometry, image_block_ids, image_token_ids,
                              load_image, plan, preprocess, tile_origins, to_rgb)
from vision_encoder import VisionModel

# the released tower's config (only image_size / patch_size matter here)
REAL = VisionConfig.from_dict(tiny_checkpoint.tiny_vision_config(width=1536, layers=47, heads=16,
                                                                 mlp_ratio=8960 / 1536))
SMALL = VisionConfig.from_dict(tiny_checkpoint.tiny_vision_config(image_size=112))  # an 8-patch overview


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    tiny_checkpoint.write_tokenizer(d, 1024)
    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"))


def normalized(rgb) -> torch.Tensor:
    """[3] float32: CLIP-normalized value of one RGB colour, computed as the pipeline does."""
    return (torch.tensor(rgb, dtype=torch.float32) / 255 - CLIP_MEAN) / CLIP_STD


# ==================================================================================================
# geometry
def test_geometry_of_released_tower_is_the_spec_constants():
    assert geometry(REAL) == Geometry(overview=728, crop=504, max_side=3024, tiny_side=32)
    assert tokens_per_view(728, 14) == 169 and tokens_per_view(504, 14) == 81


@pytest.mark.parametrize("image_size, want", [(112, Geometry(112, 84, 504, 5)), (56, Geometry(56, 42, 252, 2)),
                                              (14, Geometry(14, 14, 84, 1))])
def test_geometry_scales_with_a_smaller_tower(image_size, want):
    """Crop = 9/13 of the overview rounded to whole patches; clamp = 6 crops; tiny side = 32/728 of the overview."""
    g = geometry(VisionConfig.from_dict(tiny_checkpoint.tiny_vision_config(image_size=image_size)))
    assert g == want and g.crop % 14 == 0


# ==================================================================================================
# the worked examples of section 6.3, from synthetic images, through preprocess()
# (w, h) -> (size after pad/clamp, window, canvas, (nx, ny), newlines, feature rows, text tokens)
TABLE = [((728, 728), (728, 728), 0, None, (0, 0), 0, 169, 171),
         ((640, 480), (640, 480), 0, None, (0, 0), 0, 169, 171),
         ((729, 729), (729, 729), 504, (1008, 1008), (2, 2), 1, 493, 504),
         ((500, 300), (500, 300), 300, (600, 300), (2, 1), 0, 331, 337),
         ((1024, 768), (1024, 768), 504, (1008, 1008), (2, 2), 1, 493, 504),
         ((1920, 1080), (1920, 1080), 504, (2016, 1008), (4, 2), 1, 817, 836),
         ((4000, 3000), (3024, 2268), 504, (3024, 2520), (6, 5), 4, 2599, 2665),
         ((3024, 3024), (3024, 3024), 504, (3024, 3024), (6, 6), 5, 3085, 3164),
         ((3000, 500), (3000, 500), 500, (3000, 500), (6, 1), 0, 655, 669),
         ((3024, 33), (3024, 33), 33, (3036, 33), (92, 1), 0, 7621, 7807),
         ((20, 200), (200, 200), 0, None, (0, 0), 0, 169, 171)]


@pytest.mark.parametrize("wh, size, window, canvas, grid, newlines, rows, text", TABLE, ids=lambda v: str(v))
def test_worked_example_table(tok, wh, size, window, canvas, grid, newlines, rows, text):
    batch = preprocess([Image.new("RGB", wh, (90, 140, 200))], REAL)
    lay = batch.layouts[0]
    assert lay == plan(*wh, geometry(REAL))
    assert (lay.size, lay.window, lay.canvas, (lay.cols, lay.rows)) == (size, window, canvas, grid)
    assert lay.padded == (wh == (20, 200))
    n = grid[0] * grid[1]
    assert batch.num_patches == [n]
    assert batch.pixel_values.shape == (1, 3, 728, 728) and batch.pixel_values.dtype == torch.float32
    if n:
        assert batch.patch_pixel_values.shape == (n, 3, 504, 504)
        assert batch.patch_pixel_values.dtype == torch.float32
    else:
        assert batch.patch_pixel_values is None
    ids = image_block_ids(tok, lay, REAL)
    t = image_token_ids(tok)
    assert ids.count(t["<patch_newline>"]) == newlines
    assert ids.count(t["<im_patch>"]) == rows == 81 * n + 169
    assert len(ids) == text == 83 * n + newlines + 171


def test_vllm_strict_boundary_is_not_followed():
    """The spec's `<=` rule: 728x728 is overview-only (vLLM's `<` would give 2x2 crops)."""
    assert plan(728, 728, geometry(REAL)).n_crops == 0
    assert plan(729, 728, geometry(REAL)).n_crops == 4


# ==================================================================================================
# strips, clamp, tiles
@pytest.mark.parametrize("wh, padded", [((300, 31), True), ((31, 300), True), ((300, 32), False),
                                        ((124, 31), False), ((125, 31), True), ((31, 31), False)])
def test_degenerate_strip_rule(wh, padded):
    """Padded iff the short side is < 32 AND the aspect ratio is beyond 4 (exactly 4 is not)."""
    lay = plan(*wh, geometry(REAL))
    assert lay.padded == padded
    if padded:
        assert lay.size == (max(wh),) * 2


def test_strip_is_pasted_top_left_on_black():
    lay_img = Image.new("RGB", (20, 200), (255, 255, 255))
    ov = preprocess([lay_img], REAL).pixel_values[0]                      # [3, 728, 728] of a 200x200 square
    white, black = normalized((255, 255, 255)), normalized((0, 0, 0))
    # the strip covers columns 0..19 of 200, i.e. about 0..72 of 728; the rest is black at every row
    assert torch.allclose(ov[:, :, :68], white[:, None, None].expand(3, 728, 68), atol=1e-5)
    assert torch.allclose(ov[:, :, 80:], black[:, None, None].expand(3, 728, 648), atol=1e-5)


def test_strip_padded_past_pillows_pixel_limit_is_refused_before_it_is_drawn(monkeypatch):
    """A thin strip is padded to a square of its long side before the clamp: a 1 x 100000 file would allocate 30 GB.
    Refused past the limit where Pillow refuses to decode (2 x MAX_IMAGE_PIXELS; lowered here to keep the test small)."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100_000)
    preprocess([Image.new("RGB", (20, 400))], REAL)                      # 400^2 = 160k pixels: drawn
    with pytest.raises(ImageError, match=r"image 0: the 20x500 strip would be padded to a 500x500 square"):
        preprocess([Image.new("RGB", (20, 500))], REAL)                  # 250k > 200k


def test_a_large_photo_loads_without_pillows_warning_and_past_its_limit_is_refused(monkeypatch, tmp_path):
    import warnings
    path = str(tmp_path / "big.png")
    Image.new("RGB", (15, 10)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 150 pixels: Pillow warns (past 100), refuses past 200
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_image(path).size == (15, 10)
    Image.new("RGB", (21, 10)).save(path)
    with pytest.raises(ImageError, match="big.png: too large to decode safely"):
        load_image(path)


def test_clamp_truncates_and_never_reaches_zero():
    g = geometry(REAL)
    assert plan(4000, 3000, g).size == (3024, 2268)
    assert plan(4001, 2999, g).size == (3024, 2266)                       # 2266.68 truncated, not rounded
    assert plan(4236, 3000, g).size[0] == 3023      # the reference's float factor: 4236 * (3024 / 4236) < 3024
    assert plan(3025, 10, g).padded and plan(3025, 10, g).size == (3024, 3024)
    # a 40-px-high strip (not padded: 40 >= 32) would truncate to 0 rows; ours keeps one (the reference divides by 0)
    lay = plan(200000, 40, g)
    assert lay.size == (3024, 1) and lay.window == 1 and lay.n_crops == 3024


def test_canvas_adds_a_window_only_past_0_2_of_one():
    g = geometry(REAL)
    assert plan(1108, 1000, g).canvas == (1008, 1008)                     # 1108 / 504 = 2.198: two windows
    assert plan(1109, 1000, g).canvas == (1512, 1008)                     # 1109 / 504 = 2.2004: three windows
    assert plan(1109, 1000, g).n_crops == 6


def test_tile_origins_pull_back_the_last_tile():
    assert tile_origins(1100, 504) == [0, 504, 596]                      # would overflow: pulled back to 1100 - 504
    assert tile_origins(1008, 504) == [0, 504]
    assert tile_origins(300, 504) == [0]                                  # shorter than a window: one tile
    assert tile_origins(504, 504) == [0]


def test_short_side_tiles_are_black_filled():
    """1000x300: window 504 > 300, so each 504x504 tile holds 300 image rows and 204 black rows (black before
    normalization, so the fill is -mean/std, not 0)."""
    colour = (200, 100, 50)
    b = preprocess([Image.new("RGB", (1000, 300), colour)], REAL)
    lay = b.layouts[0]
    assert (lay.window, lay.canvas, lay.cols, lay.rows) == (504, (1008, 300), 2, 1)
    cr = b.patch_pixel_values                                             # [2, 3, 504, 504]; tiles need no resize
    image_part = normalized(colour)[None, :, None, None].expand(2, 3, 300, 504)
    assert torch.allclose(cr[:, :, :300], image_part, atol=1e-6)
    assert torch.equal(cr[:, :, 300:], normalized((0, 0, 0))[None, :, None, None].expand(2, 3, 204, 504))


def test_crops_are_row_major_with_newlines_after_rows():
    """A 1008x1008 image is its own canvas (2x2 tiles of 504): four coloured quadrants come out TL, TR, BL, BR."""
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
    img = Image.new("RGB", (1008, 1008))
    for k, c in enumerate(colours):
        img.paste(c, ((k % 2) * 504, (k // 2) * 504, (k % 2) * 504 + 504, (k // 2) * 504 + 504))
    b = preprocess([img], REAL)
    lay = b.layouts[0]
    assert [lay.newline_after(k) for k in range(4)] == [False, True, False, False]
    for k, c in enumerate(colours):
        assert torch.allclose(b.patch_pixel_values[k], normalized(c)[:, None, None].expand(3, 504, 504), atol=1e-6)


def test_overview_comes_from_clamped_image_normalized_then_antialiased():
    """500x300 noise: canvas 600x300 differs from the image; the overview is the image's own resize."""
    g = torch.Generator().manual_seed(0)
    arr = torch.randint(0, 256, (300, 500, 3), generator=g, dtype=torch.uint8).numpy()
    img = Image.fromarray(arr)
    ov = preprocess([img], REAL).pixel_values
    x = (torch.from_numpy(arr).permute(2, 0, 1).float() / 255 - CLIP_MEAN[:, None, None]) / CLIP_STD[:, None, None]
    want = torch.nn.functional.interpolate(x[None], size=(728, 728), mode="bilinear", align_corners=False,
                                           antialias=True)
    assert torch.equal(ov, want)
    canvas = img.resize((600, 300), Image.Resampling.BILINEAR)
    xc = torch.from_numpy(np.array(canvas)).permute(2, 0, 1).float() / 255
    xc = (xc - CLIP_MEAN[:, None, None]) / CLIP_STD[:, None, None]
    from_canvas = torch.nn.functional.interpolate(xc[None], size=(728, 728), mode="bilinear", align_corners=False,
                                                  antialias=True)
    assert (from_canvas - ov).abs().max() > 0.1                            # negative control


def test_batch_concatenates_images_in_order():
    imgs = [Image.new("RGB", (640, 480), (1, 2, 3)), Image.new("L", (1024, 768), 7),
            Image.new("RGBA", (500, 300), (9, 9, 9, 0))]
    b = preprocess(imgs, REAL)
    assert b.num_patches == [0, 4, 2] and b.pixel_values.shape == (3, 3, 728, 728)
    assert b.patch_pixel_values.shape == (6, 3, 504, 504)
    assert torch.allclose(b.patch_pixel_values[0], normalized((7, 7, 7))[:, None, None].expand(3, 504, 504), atol=1e-6)
    assert torch.allclose(b.patch_pixel_values[4], normalized((9, 9, 9))[:, None, None].expand(3, 504, 504), atol=1e-6)
    assert set(b.model_inputs()) == {"pixel_values", "patch_pixel_values", "num_patches"}
    assert "patch_pixel_values" not in preprocess(imgs[:1], REAL).model_inputs()


# ==================================================================================================
# placeholder block grammar and the model's feature rows
def test_block_grammar_two_by_two(tok):
    t = image_token_ids(tok)
    ids = image_block_ids(tok, plan(1024, 768, geometry(REAL)), REAL)
    crop = [t["<patch_start>"]] + [t["<im_patch>"]] * 81 + [t["<patch_end>"]]
    overview = [t["<im_start>"]] + [t["<im_patch>"]] * 169 + [t["<im_end>"]]
    want = crop + crop + [t["<patch_newline>"]] + crop + crop + overview
    assert ids == want


def test_block_without_crops_is_the_overview_only(tok):
    t = image_token_ids(tok)
    assert image_block_ids(tok, plan(640, 480, geometry(REAL)), REAL) == (
        [t["<im_start>"]] + [t["<im_patch>"]] * 169 + [t["<im_end>"]])


def test_token_ids_come_from_the_tokenizer(tok):
    ids = image_token_ids(tok)
    assert ids == {s: tiny_checkpoint.SPECIAL_TOKENS.index(s) for s in ids}
    assert all(tok.convert_ids_to_tokens(i) == s for s, i in ids.items())


class _DictTokenizer:
    def __init__(self, vocab, unk=None):
        self.vocab, self.unk_token_id = vocab, unk

    def convert_tokens_to_ids(self, t):
        return self.vocab.get(t, self.unk_token_id)


@pytest.mark.parametrize("unk", [None, 0])
def test_missing_wrapper_token_is_named(unk):
    vocab = {"<unk>": 0, "<im_patch>": 5, "<im_start>": 6, "<im_end>": 7, "<patch_start>": 8, "<patch_end>": 9}
    with pytest.raises(ValueError, match="<patch_newline>"):
        image_token_ids(_DictTokenizer(vocab, unk))


@pytest.mark.parametrize("vcfg", [SMALL, VisionConfig.from_dict(tiny_checkpoint.tiny_vision_config())],
                         ids=["overview112", "overview728"])
def test_placeholders_equal_tiny_model_feature_rows(tok, vcfg):
    """Run the tiny checkpoint's vision weights on preprocess()'s tensors: one <im_patch> per feature row."""
    vc = tiny_checkpoint.tiny_vision_config(image_size=vcfg.image_size)
    with torch.device("meta"):
        model = VisionModel(vcfg, 64)
    model.load_state_dict(tiny_checkpoint.vision_tensors(vc, 64, tiny_checkpoint._Gen(0)), strict=True, assign=True)
    s = vcfg.image_size
    sizes = [(s * 3, s * 2), (s, s // 2 + 10), (s, s)] if s < 728 else [(1024, 768), (640, 480)]
    batch = preprocess([Image.new("RGB", wh, (30 * i, 60, 90)) for i, wh in enumerate(sizes)], vcfg)
    assert sum(batch.num_patches) > 0 and any(n == 0 for n in batch.num_patches)
    with torch.no_grad():
        feats = model.image_features(**batch.model_inputs())
    patch = image_token_ids(tok)["<im_patch>"]
    n_ph = sum(image_block_ids(tok, lay, vcfg).count(patch) for lay in batch.layouts)
    assert feats.shape == (n_ph, 64)


# ==================================================================================================
# bad files: one clear error each, naming the file
def test_text_file_named_jpg_is_not_an_image(tmp_path):
    p = tmp_path / "x.jpg"
    p.write_text("hello, I am not a JPEG\n")
    with pytest.raises(ImageError, match=r"x\.jpg: not an image"):
        load_image(p)


def test_missing_path(tmp_path):
    with pytest.raises(ImageError, match=r"nope\.png: no such image file"):
        load_image(tmp_path / "nope.png")


def test_zero_byte_file(tmp_path):
    p = tmp_path / "empty.png"
    p.write_bytes(b"")
    with pytest.raises(ImageError, match=r"empty\.png: empty file \(0 bytes\)"):
        load_image(p)


def test_zero_size_image_object():
    with pytest.raises(ImageError, match=r"image 1: image has zero size \(0x5\)"):
        preprocess([Image.new("RGB", (4, 4)), Image.new("RGB", (0, 5))], REAL)


def test_truncated_image_file(tmp_path):
    p = tmp_path / "cut.png"
    Image.effect_noise((64, 64), 50).convert("RGB").save(p)
    p.write_bytes(p.read_bytes()[:200])
    with pytest.raises(ImageError, match=r"cut\.png: cannot read the image"):
        load_image(p)


def test_directory_is_not_an_image(tmp_path):
    with pytest.raises(ImageError, match=re.escape(f"{tmp_path}: cannot read")):
        load_image(tmp_path)


def test_load_image_decodes_to_rgb(tmp_path):
    p = tmp_path / "g.png"
    Image.new("LA", (7, 3), (100, 50)).save(p)
    img = load_image(str(p))
    assert img.mode == "RGB" and img.size == (7, 3) and img.getpixel((0, 0)) == (100, 100, 100)
    assert preprocess([p], REAL).num_patches == [3]                        # a path works too (7x3: 3 windows of 3)


# ==================================================================================================
# every decoded mode to 8-bit RGB. Alpha is dropped without compositing (the reference's convert("RGB")); 16-bit
# samples keep their high byte (as Pillow itself decodes 16-bit RGB and LA PNGs); floats are 0..1.
def _palette(mode):
    im = Image.new(mode, (3, 2))
    im.putpalette([10, 20, 30, 200, 100, 50, 7, 8, 9])
    for x in range(3):
        for y in range(2):
            im.putpixel((x, y), (x, 255 * y) if mode == "PA" else x)
    if mode == "P":
        im.info["transparency"] = 1  # palette entry 1 transparent: dropped like any alpha
    return im


_G16 = np.array([[0, 25700, 65535], [1000, 25900, 32767]], dtype=np.uint16)     # high bytes 0 100 255 / 3 101 127
_GRAY16 = np.array([[0, 100, 255], [3, 101, 127]], dtype=np.uint8)
_PAL = np.array([[[10, 20, 30], [200, 100, 50], [7, 8, 9]]] * 2, dtype=np.uint8)
MODES = {  # mode -> (image, file format that stores it or None, expected [2, 3, 3] uint8 RGB)
    "I;16": (lambda: Image.fromarray(_G16), "png", _GRAY16),
    "I;16B": (lambda: Image.frombytes("I;16B", (3, 2), _G16.astype(">u2").tobytes()), "tiff", _GRAY16),
    "I;16L": (lambda: Image.frombytes("I;16L", (3, 2), _G16.astype("<u2").tobytes()), "tiff", _GRAY16),
    "I": (lambda: Image.fromarray(np.array([[0, 70000, -5], [300, 25700, 65535]], dtype=np.int32), "I"), "tiff",
          np.array([[0, 255, 0], [1, 100, 255]], dtype=np.uint8)),                  # 16-bit scale, clipped
    "F": (lambda: Image.fromarray(np.array([[0, 0.5, 1.0], [2.0, -1, 0.25]], dtype=np.float32), "F"), "tiff",
          np.array([[0, 128, 255], [255, 0, 64]], dtype=np.uint8)),                 # 0..1, clipped, rounded
    "L": (lambda: Image.fromarray(_GRAY16), "png", _GRAY16),
    "1": (lambda: Image.frombytes("1", (3, 2), bytes([0b10100000, 0b01000000])), "png",
          np.array([[255, 0, 255], [0, 255, 0]], dtype=np.uint8)),
    "LA": (lambda: Image.fromarray(np.stack([_GRAY16, np.full((2, 3), 9, np.uint8)], -1), "LA"), "png", _GRAY16),
    "La": (lambda: Image.frombytes("La", (3, 2), bytes([100, 128, 0, 0, 255, 255] * 2)), None,
           np.array([[199, 0, 255]] * 2, dtype=np.uint8)),                          # un-premultiplied first
    "RGBA": (lambda: Image.fromarray(np.concatenate([_PAL, np.zeros((2, 3, 1), np.uint8)], -1), "RGBA"), "png", _PAL),
    "RGBa": (lambda: Image.frombytes("RGBa", (1, 1), bytes([100, 50, 20, 128])), None,
             np.array([[[199, 99, 39]]], dtype=np.uint8)),
    "P": (lambda: _palette("P"), "png", _PAL),
    "PA": (lambda: _palette("PA"), "tiff", _PAL),
    "CMYK": (lambda: Image.frombytes("CMYK", (3, 1), bytes([0, 255, 51, 0, 0, 0, 0, 102, 255, 0, 0, 0])), "tiff",
             np.array([[[255, 0, 204], [153, 153, 153], [0, 255, 255]]], dtype=np.uint8)),  # (255-c)(255-k)/255
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_decodes_to_the_expected_8bit_rgb(tmp_path, mode):
    build, fmt, want = MODES[mode]
    img = build()
    assert img.mode == mode
    got = [to_rgb(img, "x")]
    if fmt:
        p = tmp_path / f"x.{fmt}"
        img.save(p)
        got.append(load_image(p))
        with Image.open(p) as reopened:  # what the file gives back (a 16-bit PNG reopens as I;16)
            assert reopened.mode in (mode, "I;16"), reopened.mode
    for g in got:
        assert g.mode == "RGB" and np.array_equal(np.asarray(g), np.broadcast_to(want[..., None], want.shape + (3,))
                                                  if want.ndim == 2 else want), (mode, np.asarray(g))


def _png16(path, arr, color_type):
    """A 16-bit PNG (Pillow writes none with colour): arr [h, w, c] uint16, colour type 2 (RGB) or 4 (LA)."""
    import struct
    import zlib
    h, w = arr.shape[:2]
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def test_16bit_grey_png_matches_the_same_picture_as_16bit_rgb(tmp_path):
    """A grey 16-bit PNG (I;16) and the same samples as a 16-bit RGB PNG (decoded by Pillow to 8-bit RGB) give the
    same pixels: the release's convert("RGB") made the grey one all white."""
    _png16(tmp_path / "rgb.png", np.repeat(_G16[..., None], 3, -1), 2)
    Image.fromarray(_G16).save(tmp_path / "grey.png")
    a, b = np.asarray(load_image(tmp_path / "rgb.png")), np.asarray(load_image(tmp_path / "grey.png"))
    assert np.array_equal(a, b) and np.array_equal(a[..., 0], _GRAY16)
    noise = (np.random.default_rng(0).random((40, 60)) * 65535).astype(np.uint16)
    Image.fromarray(noise).save(tmp_path / "noise.png")
    px = np.asarray(load_image(tmp_path / "noise.png"))
    assert (px == 255).mean() < 0.01 and abs(px.mean() - 127.5) < 3


def test_float_image_with_nan_is_refused(tmp_path):
    a = np.zeros((4, 5), dtype=np.float32)
    a[2, 3] = np.nan
    Image.fromarray(a, "F").save(tmp_path / "nan.tiff")
    with pytest.raises(ImageError, match=r"nan\.tiff: mode F image has a non-finite pixel \(nan\) at x=3, y=2"):
        load_image(tmp_path / "nan.tiff")
    with pytest.raises(ImageError, match=r"image 0: mode F image has a non-finite pixel"):
        preprocess([Image.fromarray(a, "F")], SMALL)
