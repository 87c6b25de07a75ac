"""Raw images -> the vision path's inputs (the Step3-VL preprocessing policy) and their prompt placeholder blocks.

    img = load_image("cat.jpg")                           # RGB PIL image; one clear ImageError per bad file
    batch = preprocess([img], vcfg)                       # pixel_values, patch_pixel_values, num_patches, layouts
    ids = image_block_ids(tok, batch.layouts[0], vcfg)    # <patch_start> <im_patch>*81 <patch_end> ... <im_end>

Legend: S = overview side (728), s = crop side (504), P = patch (14), w x h = image width x height in pixels,
window = side of one tile cut from the crop canvas (resized to s x s afterwards).

Geometry: the preprocessing policy states its pixel constants for the released 728/14 tower. `geometry(vcfg)` derives each one
from (image_size, patch_size) so that a smaller test tower makes the same decisions at its own scale; the released
config gives back exactly 728 / 504 / 3024 / 32. The ratios (aspect limits 1.5 and 4, rounding 0.2) are scale-free.
"""
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

from config import tokens_per_view

CLIP_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073])  # float32, as torchvision's Normalize holds them
CLIP_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711])
REF_OVERVIEW = 728  # the overview side the spec's pixel constants are stated for
WIDE, STRIP = 1.5, 4.0  # aspect limits: above WIDE a small image gets crops; above STRIP the window shrinks
ROUND_UP = 0.2  # a side more than 0.2 windows past a whole number of windows gets one more window
IMAGE_TOKENS = ("<im_patch>", "<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>")


class ImageError(ValueError):
    """A bad image file or image; the message names the file (or the image's index) and what is wrong."""


# --------------------------------------------------------------------------------------------------
# geometry and layout: pure arithmetic on (w, h), shared by preprocess() and the token count
@dataclass(frozen=True)
class Geometry:
    overview: int   # S: overview side, the tower's image_size (728)
    crop: int       # s: crop side (504)
    max_side: int   # long-side clamp (3024)
    tiny_side: int  # a strip thinner than this is padded to a square (32)


def geometry(vcfg) -> Geometry:
    """Section 6.1's pixel constants for a VisionConfig's (image_size, patch_size); exact for the released tower."""
    S, P = vcfg.image_size, vcfg.patch_size
    g = S // P
    # 504 = 36 patches = 9/13 of the 52-patch overview: keep that ratio, rounded half up to whole patches
    crop = P * max(1, (18 * g + 13) // 26)
    # 3024 = 6 crops (a square image gets at most 6 x 6 crops); 32 px of a 728 overview scales with the overview
    return Geometry(S, crop, 6 * crop, max(1, (32 * S + REF_OVERVIEW // 2) // REF_OVERVIEW))


@dataclass(frozen=True)
class ImageLayout:
    """How one image is cut: what preprocess() does to it and the shape of its placeholder block."""
    size: tuple           # (w, h) after strip padding and the long-side clamp: the overview's source image
    padded: bool          # a degenerate strip, pasted at the top-left of a black square
    window: int           # tile side in canvas pixels; 0: no crops
    canvas: tuple | None  # (w, h) the image is resized to before tiling; None without crops
    cols: int             # nx tiles per row (0 without crops)
    rows: int             # ny tile rows (0 without crops)

    @property
    def n_crops(self) -> int:
        return self.cols * self.rows

    def newline_after(self, k: int) -> bool:
        """<patch_newline> after crop k (0-based) iff it ends a row and is not the last crop."""
        return (k + 1) % self.cols == 0 and k < self.n_crops - 1


def _canvas_side(x: int, window: int) -> int:
    if x < window:
        return x  # shorter than one window: kept, its tiles get a black fill
    q = x / window  # float arithmetic as in the reference, so boundary cases round the same way
    return window * (math.floor(q) + 1 if q - math.floor(q) > ROUND_UP else math.floor(q))


def tile_origins(side: int, window: int) -> list[int]:
    """Tile starts along one canvas side: window * k, the last pulled back to side - window if it would overflow."""
    n = 1 if side <= window else math.ceil((side - window) / window + 1)
    starts = [window * k for k in range(n)]
    if n > 1 and starts[-1] + window > side:
        starts[-1] = side - window
    return starts


def plan(w: int, h: int, geo: Geometry) -> ImageLayout:
    """Section 6.2 steps 1-6 for an image of w x h pixels. The crop count has no fixed maximum: thin strips get many
    small windows (3024x33 gives 92 crops, 7621 feature rows), so budget from the layout, not from a 3024^2 image."""
    if w <= 0 or h <= 0:
        raise ImageError(f"image has zero size ({w}x{h})")
    # 1. a thin, long strip would give windows of a few pixels: square it with black instead
    padded = min(w, h) < geo.tiny_side and (w / h > STRIP or w / h < 1 / STRIP)
    if padded:
        w = h = max(w, h)
    # 2. clamp the long side: the factor first, then truncation, as the reference computes it. The max(1, ...)
    #    is ours: a side the reference would truncate to 0 (and then divide by) stays one pixel.
    if max(w, h) > geo.max_side:
        f = geo.max_side / max(w, h)
        w, h = max(1, int(w * f)), max(1, int(h * f))
    # 3. window. `<=` at the overview side (the release's rule): a 728x728 image is overview-only; `<` would give 4 crops
    L, s = max(w, h), min(w, h)
    if L <= geo.overview:
        window = s if L / s > WIDE else 0
    else:
        window = min(s, geo.crop) if L / s > STRIP else geo.crop
    if window == 0:
        return ImageLayout((w, h), padded, 0, None, 0, 0)
    # 5-6. canvas of whole windows (0.2 rule), then tiles in rows top to bottom, columns left to right
    cw, ch = _canvas_side(w, window), _canvas_side(h, window)
    return ImageLayout((w, h), padded, window, (cw, ch), len(tile_origins(cw, window)), len(tile_origins(ch, window)))


# --------------------------------------------------------------------------------------------------
# files and pixels
def to_rgb(img: Image.Image, name: str) -> Image.Image:
    """Any mode Pillow decodes -> 8-bit RGB; `name` (the file, or "image i") goes into the error.

    Alpha is dropped without compositing, as the reference's convert("RGB") does (the spec only says "converted to
    RGB"): LA, PA, RGBA and P with a transparent entry keep their colour channels; the premultiplied La / RGBa are
    un-premultiplied first, so they give the same colour as their straight forms. convert("RGB") clips integer and
    float modes at 255 (a 16-bit photo would be nearly all white), so those are scaled first: 16-bit samples (I;16*,
    and I, which Pillow gives 16-bit PGM/PPM and older 16-bit PNGs) keep their high byte, as Pillow decodes 16-bit RGB
    and LA PNGs, so a grey and a colour 16-bit file agree; wider I values clip. F is taken as 0..1 (the float image
    convention of TIFF/EXR writers and editors), clipped and rounded; a NaN/Inf pixel is refused."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        a = np.asarray(img)
        a = np.clip(a, 0, 65535) if img.mode == "I" else a  # 32-bit signed
        return Image.fromarray((a >> 8).astype(np.uint8), "L").convert("RGB")
    if img.mode == "F":
        a = np.asarray(img)
        if not np.isfinite(a).all():
            y, x = np.argwhere(~np.isfinite(a))[0]
            raise ImageError(f"{name}: mode F image has a non-finite pixel ({a[y, x]}) at x={x}, y={y}")
        return Image.fromarray(np.rint(np.clip(a, 0, 1) * 255).astype(np.uint8), "L").convert("RGB")
    if img.mode in ("La", "RGBa"):
        img = img.convert(img.mode[:-1] + "A")
    try:
        return img.convert("RGB")
    except ValueError as e:  # a mode Pillow cannot turn into RGB
        raise ImageError(f"{name}: cannot convert a mode {img.mode} image to RGB ({e})") from None


def load_image(path) -> Image.Image:
    """Open and decode an image file to RGB (to_rgb), or raise one ImageError naming the file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ImageError(f"{path}: no such image file")
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ImageError(f"{path}: empty file (0 bytes), not an image")
    try:
        with warnings.catch_warnings():
            # a photo of 90-180 Mpx is decoded (and clamped to 3024 px), without Pillow's bomb warning; past that
            # Pillow refuses (DecompressionBombError below)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                im.load()  # decode now: a truncated file fails here, not later inside preprocess()
                img = to_rgb(im, path)
    except UnidentifiedImageError:
        raise ImageError(f"{path}: not an image (Pillow cannot identify its format)") from None
    except Image.DecompressionBombError as e:
        raise ImageError(f"{path}: too large to decode safely ({e})") from None
    except (OSError, SyntaxError) as e:  # a directory, no permission, a truncated or corrupt image
        raise ImageError(f"{path}: cannot read the image ({getattr(e, 'strerror', None) or e})") from None
    if 0 in img.size:
        raise ImageError(f"{path}: image has zero size ({img.size[0]}x{img.size[1]})")
    return img


def _unit(img: Image.Image) -> torch.Tensor:
    """RGB PIL image -> [3, h, w] float32 in [0, 1] (torchvision's ToTensor: uint8 / 255)."""
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).float().div(255)


def _normalize(x: torch.Tensor) -> torch.Tensor:
    """[..., 3, h, w] -> same, CLIP mean/std per channel (torchvision's Normalize: subtract, then divide)."""
    return (x - CLIP_MEAN[:, None, None]) / CLIP_STD[:, None, None]


def _resized(x: torch.Tensor, side: int) -> torch.Tensor:
    """[N, 3, h, w] -> [N, 3, side, side]: antialiased bilinear on normalized values, aspect ignored (squash)."""
    return F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False, antialias=True)


@dataclass
class ImageBatch:
    pixel_values: torch.Tensor               # [n_img, 3, S, S] float32: one overview per image
    patch_pixel_values: torch.Tensor | None  # [n_crop, 3, s, s] float32, image-major then row-major; None: no crops
    num_patches: list                        # crops per image, ints
    layouts: list                            # ImageLayout per image

    def model_inputs(self) -> dict:
        """Keyword arguments of VisionModel.image_features (and the image-inputs file keys)."""
        d = {"pixel_values": self.pixel_values, "num_patches": self.num_patches}
        if self.patch_pixel_values is not None:
            d["patch_pixel_values"] = self.patch_pixel_values
        return d


def preprocess(images, vcfg) -> ImageBatch:
    """PIL images (or paths) in prompt order -> the tensors the vision path takes (the numbered steps below)."""
    geo = geometry(vcfg)
    overviews, crops, layouts = [], [], []
    for i, img in enumerate(images):
        img = load_image(img) if isinstance(img, (str, os.PathLike)) else img
        if not isinstance(img, Image.Image):
            raise ImageError(f"image {i}: expected a PIL image or a path, got {type(img).__name__}")
        if 0 in img.size:
            raise ImageError(f"image {i}: image has zero size ({img.size[0]}x{img.size[1]})")
        img = to_rgb(img, f"image {i}") if img.mode != "RGB" else img
        lay = plan(*img.size, geo)
        if lay.padded:  # 1. top-left of a black square
            side = max(img.size)
            if Image.MAX_IMAGE_PIXELS and side * side > 2 * Image.MAX_IMAGE_PIXELS:  # where Pillow refuses to decode
                raise ImageError(f"image {i}: the {img.size[0]}x{img.size[1]} strip would be padded to a {side}x{side} "
                                 "square, more pixels than Pillow decodes safely (its DecompressionBombError)")
            sq = Image.new("RGB", (side, side))
            sq.paste(img, (0, 0))
            img = sq
        if img.size != lay.size:  # 2. long-side clamp
            img = img.resize(lay.size, Image.Resampling.BILINEAR)
        # 7. the overview comes from this image, not from the crop canvas
        overviews.append(_resized(_normalize(_unit(img))[None], geo.overview))           # [1, 3, S, S]
        if lay.window:
            canvas = img if img.size == lay.canvas else img.resize(lay.canvas, Image.Resampling.BILINEAR)
            # black is 0 before normalization (as PIL's crop past the edge gives), so pad in [0, 1] space
            px = _unit(canvas)                                                            # [3, ch, cw]
            win = lay.window
            tiles = torch.zeros(lay.n_crops, 3, win, win)                                 # [n, 3, win, win]
            for k, (y0, x0) in enumerate((y, x) for y in tile_origins(lay.canvas[1], win)
                                         for x in tile_origins(lay.canvas[0], win)):
                part = px[:, y0:y0 + win, x0:x0 + win]
                tiles[k, :, :part.shape[1], :part.shape[2]] = part
            crops.append(_resized(_normalize(tiles), geo.crop))                           # 8. [n, 3, s, s]
        layouts.append(lay)
    if not layouts:
        raise ImageError("preprocess() got no images")
    return ImageBatch(torch.cat(overviews), torch.cat(crops) if crops else None,
                      [lay.n_crops for lay in layouts], layouts)


# --------------------------------------------------------------------------------------------------
# placeholder block: crops in row-major order, then the overview, one <im_patch> per feature row
def image_token_ids(tok) -> dict:
    """The six wrapper/placeholder ids, looked up by string in the tokenizer (never hard-coded)."""
    ids = {}
    for t in IMAGE_TOKENS:
        i = tok.convert_tokens_to_ids(t)
        # an unknown string maps to None (no unk token) or to the unk id
        if not isinstance(i, int) or i < 0 or i == getattr(tok, "unk_token_id", None):
            raise ValueError(f"the tokenizer has no {t!r} token (needed for image placeholders)")
        ids[t] = i
    return ids


def image_block_ids(tok, layout: ImageLayout, vcfg) -> list[int]:
    """One image's prompt ids: each crop as <patch_start> <im_patch>*n <patch_end>, <patch_newline> after every
    row but the last, then <im_start> <im_patch>*m <im_end>. One <im_patch> per feature row of that view."""
    t, geo = image_token_ids(tok), geometry(vcfg)
    crop_rows = tokens_per_view(geo.crop, vcfg.patch_size)       # 81
    view_rows = tokens_per_view(geo.overview, vcfg.patch_size)   # 169
    ids = []
    for k in range(layout.n_crops):
        ids += [t["<patch_start>"]] + [t["<im_patch>"]] * crop_rows + [t["<patch_end>"]]
        if layout.newline_after(k):
            ids.append(t["<patch_newline>"])
    return ids + [t["<im_start>"]] + [t["<im_patch>"]] * view_rows + [t["<im_end>"]]
