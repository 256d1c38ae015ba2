"""An image file decoded into a fixed-size uint8 RGB array, transformed on the way (in a loader's worker).

Evaluation, and training without augmentation: the centre square of ``crop_fraction`` of the shorter side,
resized to ``size`` (ImageNet's "resize 256, centre crop 224" is ``crop_fraction`` 0.875 at 224).
``rrc+flip``: ImageNet's random-resized-crop (torchvision's ``RandomResizedCrop``: 8% to 100% of the area,
aspect ratio 3/4 to 4/3, 10 tries, then the centre) and a horizontal flip with probability 1/2.
``crop+flip``: the whole image resized, then ``jaxtrain.data.augment.crop_flip`` (the CIFAR recipes').

Fast on one core: the crop box is chosen from the header's size before anything is decoded; a JPEG's box
alone is then decoded (``jaxtrain.data.jpeg``), at the smallest of libjpeg-turbo's scales 1/8, 1/4, 1/2, 1
that keeps it at least ``size`` wide; other images are Pillow's, and JPEGs too where that decoder cannot be
built (whole, at the same scale: ``draft``). The crop and the resize are one Pillow call (``resize(box=...)``).
Every random choice comes from (seed, epoch, example index), so a resumed or multi-process run decodes the
same pixels as an uninterrupted one.
"""

from __future__ import annotations

import errno
import io
import math
import struct
from pathlib import Path

import numpy as np

from jaxtrain import settings
from jaxtrain.data import augment as augment_lib
from jaxtrain.data import jpeg
from jaxtrain.errors import ConfigError, named

SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
TRIES = 16  # a damaged file is replaced by the next that decodes, among the next TRIES files

def centre_box(w: int, h: int, fraction: float = 1.0) -> tuple[float, float, float, float]:
    """The centre square of ``fraction`` of the shorter side: (left, top, right, bottom)."""
    side = min(w, h) * fraction
    left, top = (w - side) / 2, (h - side) / 2
    return left, top, left + side, top + side


def random_resized_box(w: int, h: int, rng: np.random.Generator) -> tuple[float, float, float, float]:
    """torchvision's RandomResizedCrop box: area and log-aspect drawn uniformly, 10 tries, then the centre."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        ratio = math.exp(rng.uniform(math.log(RATIO[0]), math.log(RATIO[1])))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return left, top, left + cw, top + ch
    ratio = w / h  # the fallback: the whole image, its aspect clamped to RATIO
    cw, ch = (w, round(w / RATIO[0])) if ratio < RATIO[0] else (round(h * RATIO[1]), h) if ratio > RATIO[1] else (w, h)
    cw, ch = min(cw, w), min(ch, h)
    left, top = (w - cw) // 2, (h - ch) // 2
    return left, top, left + cw, top + ch


def decode(path: str | Path, size: int, box_of, flip: bool = False, region: bool | None = None,
           library: str | None = None, refused: list | None = None) -> np.ndarray:
    """``path`` -> uint8 [size, size, 3]: ``box_of(w, h)`` picks the region (in the full image's pixels),
    decoded at a reduced scale where JPEG allows, cropped and resized in one call. ``region``: a JPEG's crop
    decoded alone (``jaxtrain.data.jpeg``, the built ``library`` if given; default: unless
    ``$JAXTRAIN_JPEG_DECODER`` is pillow), else with Pillow (whole, at 1/1, 1/2, 1/4 or 1/8). A JPEG the region
    decoder refuses is Pillow's to decode (noted as "PATH: REASON" in ``refused``, if given: the loader says them in
    its epoch's line), or to refuse (a damaged file)."""
    from PIL import Image

    data = Path(path).read_bytes()
    if region is None:
        region = settings.current().jpeg_decoder == "region"
    out = why = None
    if region and jpeg.is_jpeg(data) and jpeg.unusable(library) is None:
        try:
            w, h, space, sampling = jpeg.header(data, library)
            if jpeg.decodable(space, sampling):
                out = jpeg.decode(data, w, h, size, box_of(w, h), library)
        except jpeg.DecodeError as e:
            why = e  # Pillow's libjpeg may read it (a newer one); if not, its error says the file is damaged
    if out is None:  # not a JPEG, a CMYK one, or Pillow's way asked for
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            left, top, right, bottom = box_of(w, h)
            if img.format == "JPEG":  # decoded at 1/d: draft takes the largest reduction the request allows
                d = jpeg.reduction((left, top, right, bottom), size)
                img.draft("RGB", (w // d, h // d))
                sx, sy = img.size[0] / w, img.size[1] / h
                left, top, right, bottom = left * sx, top * sy, right * sx, bottom * sy
            # greyscale, CMYK, palette and RGBA (alpha dropped) become RGB; an RGB image is decoded by the resize
            rgb = img if img.mode == "RGB" else _eight_bit(img).convert("RGB")
            out = rgb.resize((size, size), Image.BILINEAR, box=(left, top, right, bottom))
        if why is not None and refused is not None:
            refused.append(f"{path}: {why}")
    if flip:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(out, np.uint8)


def _eight_bit(img):
    """A 16-bit greyscale image (a PNG's "I;16", or "I") scaled to 8 bits (Pillow's conversion clips it: white)."""
    if img.mode not in ("I", "I;16", "I;16B", "I;16L"):
        return img
    from PIL import Image

    wide = np.clip(np.asarray(img, np.int64), 0, 65535)
    return Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), "L")


def _rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed % 2**63, epoch, int(index)])


def read_batch(split, idx: np.ndarray, *, augment: str | None, seed: int, epoch: int
               ) -> tuple[np.ndarray, list, list]:
    """(uint8 [len(idx), S, S, 3], [what failed], [JPEGs the region decoder refused, Pillow's]) of ``split``'s files
    ``idx`` (a ``FolderSplit``): a file that fails to decode is replaced by the next file of the split
    (``on_bad="skip"``) or is a ConfigError."""
    from PIL import Image

    # the decoders' errors for a damaged file (Pillow's plugins raise all of these; jpeg.DecodeError is libjpeg's):
    # anything else is a bug, raised as it is
    damaged = (OSError, SyntaxError, ValueError, EOFError, struct.error, Image.DecompressionBombError, jpeg.DecodeError)
    size, root, n = split.size, Path(split.root), len(split)
    if split.jpeg_library and (why := jpeg.unusable(split.jpeg_library)) is not None:  # never Pillow's silently
        raise ConfigError(f"the JPEG region decoder the run built does not load in a decode worker: {why}")
    out, bad, pillows = np.empty((len(idx), size, size, 3), np.uint8), [], []
    for row, i in enumerate(np.asarray(idx)):
        if augment == "rrc+flip":
            rng = _rng(seed, epoch, i)
            box_of, flip = (lambda w, h, rng=rng: random_resized_box(w, h, rng)), bool(rng.integers(2))
        else:
            box_of, flip = (lambda w, h: centre_box(w, h, split.crop_fraction)), False
        for j in (int(i + k) % n for k in range(min(n, TRIES))):  # this file, or (skip) the next that decodes
            path = root / split.files[j]
            try:  # the decode only: a wrong shape stored into out (numpy's ValueError) is a bug, not a damaged file
                image = decode(path, size, box_of, flip, library=split.jpeg_library or None, refused=pillows)
            except damaged as e:  # replaced by the next file and counted (one warning line an epoch), or with
                # on_bad="error" one line naming it
                if isinstance(e, OSError) and e.errno not in (None, errno.ENOENT):  # the disk's, not the image's
                    raise ConfigError(f"{path} cannot be read ({e.strerror}): check the folder's disk or "
                                      "mount") from None
                if split.on_bad == "error":
                    raise ConfigError(f"{path} cannot be decoded ({type(e).__name__}: {str(e)[:120]}): replace or "
                                      f"remove it, or pass {named('on_bad_image', 'skip')} to skip damaged "
                                      "files") from None
                bad.append(f"{path} ({type(e).__name__})")
            else:
                out[row] = image
                break
        else:
            raise ConfigError(f"{root}: {min(n, TRIES)} files in a row fail to decode (e.g. {bad[0]}): is this a "
                              "folder of images?")
    if augment == "crop+flip":
        out = augment_lib.crop_flip(out, seed, epoch, np.asarray(idx))
    return out, bad, pillows
