"""A JPEG's region decoded at a reduced scale (libjpeg-turbo, through ``jpeg_region.cc``): the fast path of
``jaxtrain.data.images``.

Pillow decodes a whole JPEG (at 1/2, 1/4 or 1/8 of its size where asked). This decodes only what a crop
needs, at the same scale (``reduction``: the smallest of 1/8, 1/4, 1/2, 1 that keeps the crop at least the
output's size; libjpeg-turbo's other scales M/8 use slower, non-SIMD transforms and bought nothing here):
the rows above the crop are skipped (no inverse DCT, no colour conversion), the rows below it never read, the
columns beside it left untransformed. A margin of the resize filter's reach is decoded around the crop, so the
result is Pillow's whole decode at that scale, resized, to within one level (tested).

The library is compiled on first use (g++ against the system's libjpeg: Debian's ``libjpeg-dev``; a second)
into ``$JAXTRAIN_JPEG_CACHE``; where it cannot be, JPEGs are decoded with Pillow, and ``check()`` says so in one
line with the reason. CMYK JPEGs are always Pillow's (libjpeg does not convert them to RGB).
"""

from __future__ import annotations

import ctypes
import functools
import math
import platform
import warnings
from pathlib import Path

import numpy as np

from jaxtrain.io import native

SOURCE = Path(__file__).with_name("jpeg_region.cc")
RGB_SPACES = (1, 2, 3)  # libjpeg's JCS_GRAYSCALE, JCS_RGB, JCS_YCbCr: decoded to RGB by libjpeg itself
_MESSAGE_BYTES = 200
BOMB = "Image size ({} pixels) exceeds limit of {} pixels, could be decompression bomb DOS attack."  # Pillow's
INSTALL_LIBJPEG = "install libjpeg-turbo's headers (Debian: apt-get install libjpeg-dev; make setup does)"


class DecodeError(ValueError):
    """libjpeg refused the file (corrupt, truncated): a damaged image, as Pillow's errors are."""


def _command(compiler: str, out: Path) -> list[str]:
    return [compiler, "-O2", "-shared", "-fPIC", "-std=c++17", "-w", str(SOURCE), "-ljpeg", "-o", str(out)]


LIBRARY = native.Native(
    short="JPEG decoder", what="the JPEG region decoder", prefix="jpeg-region", source=SOURCE, command=_command,
    key=lambda: f"2 {platform.machine()}", cache="jpeg_cache",
    fix=lambda error: INSTALL_LIBJPEG if "jpeglib" in error or "ljpeg" in error else
    f"{native.INSTALL_CXX}; {INSTALL_LIBJPEG}", rebuild="python -m jaxtrain.data.jpeg")


@functools.cache
def _library(path: str | None = None) -> ctypes.CDLL | native.Unusable:
    """The loaded library (``path``: one already built, as a loader's workers take it from their split; else
    built here if need be), its functions typed; or why it cannot be."""
    try:
        lib = ctypes.CDLL(path) if path else LIBRARY.load()
    except native.Unusable as e:
        return e
    except OSError as e:  # the main process's library, not loading in a worker: read_batch stops in one line
        return native.Unusable(f"{path} does not load ({e})", f"delete it and run {LIBRARY.rebuild}")
    ints = ctypes.POINTER(ctypes.c_int)
    lib.jt_jpeg_header.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ints, ints, ints, ints, ctypes.c_char_p]
    lib.jt_jpeg_region.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.c_int, ints, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_void_p, ints, ctypes.c_ulonglong, ctypes.c_char_p]
    return lib


def unusable(path: str | None = None) -> native.Unusable | None:
    """None when the region decoder is usable here; else why not (``.cause``, ``.fix``)."""
    lib = _library(path)
    return lib if isinstance(lib, native.Unusable) else None


@functools.cache
def check() -> str:
    """The built library's path, for a loader's workers (built now if need be, before any starts); "" where it
    cannot be built, and one warning line (once a process) says JPEGs are decoded whole by Pillow, and why."""
    why = unusable()
    if why is not None:
        native.note(f"JPEGs are decoded whole by Pillow, slower: the region decoder is not usable: {why}")
        return ""
    return str(LIBRARY.build())


def is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def header(data: bytes, library: str | None = None) -> tuple[int, int, int, int]:
    """(width, height, libjpeg's colour space, largest sampling factor) from the JPEG's header; DecodeError if
    it has none."""
    lib, w, h, space, sampling = _library(library), ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    if lib.jt_jpeg_header(data, len(data), w, h, space, sampling, message):
        raise DecodeError(message.value.decode(errors="replace"))
    return w.value, h.value, space.value, sampling.value


def bomb_check(w: int, h: int) -> int:
    """Pillow's decompression-bomb check of a ``w`` x ``h`` image (``Image.open``'s, against
    ``PIL.Image.MAX_IMAGE_PIXELS`` as it is now): a DecompressionBombWarning above the limit, a
    DecompressionBombError above twice it. Returns the most pixels a file may declare (0: no limit)."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if limit is None:
        return 0
    pixels = max(1, w) * max(1, h)
    if pixels > 2 * limit:
        raise Image.DecompressionBombError(BOMB.format(pixels, 2 * limit))
    if pixels > limit:
        warnings.warn(BOMB.format(pixels, limit), Image.DecompressionBombWarning)
    return 2 * limit


def decodable(space: int, sampling: int) -> bool:
    """What the region decoder gives Pillow's pixels for: RGB-convertible colour spaces (not CMYK), sampling
    factors of at most 2 (a 4x2 luma block came out up to 5 levels off, inside the crop)."""
    return space in RGB_SPACES and sampling <= 2


def reduction(box: tuple[float, float, float, float], size: int) -> int:
    """The largest of libjpeg-turbo's fast reductions (8, 4, 2, 1) that keeps ``box`` at least ``size`` wide
    and high: the scale a JPEG is decoded at, by region or by Pillow."""
    shrink = min(box[2] - box[0], box[3] - box[1]) / size
    return next(d for d in (8, 4, 2, 1) if shrink >= d or d == 1)


def decode(data: bytes, w: int, h: int, size: int, box: tuple[float, float, float, float],
           library: str | None = None):
    """``box`` (left, top, right, bottom, in the full image's pixels) of a ``w`` x ``h`` JPEG, resized to
    ``size`` x ``size``: a PIL image, the one Pillow gives decoding it whole at the same ``reduction`` and
    resizing (bilinear) the box, to within a level (libjpeg's rounding at the region's edges)."""
    from PIL import Image

    most = bomb_check(w, h)  # before anything is allocated for it; libjpeg checks the file's own size against it
    left, top, right, bottom = box
    d = reduction(box, size)
    sw, sh = -(-w // d), -(-h // d)  # libjpeg's scaled size: rounded up
    sx, sy = sw / w, sh / h
    left, top, right, bottom = left * sx, top * sy, right * sx, bottom * sy
    # bilinear reaches one input pixel per output pixel's width either side: decode that margin as well
    mx, my = math.ceil(max((right - left) / size, 1)) + 1, math.ceil(max((bottom - top) / size, 1)) + 1
    x0, x1 = max(0, math.floor(left) - mx), min(sw, math.ceil(right) + mx)
    y0, y1 = max(0, math.floor(top) - my), min(sh, math.ceil(bottom) + my)
    pixels = np.empty((y1 - y0) * x1 * 3, np.uint8)  # the widest rows libjpeg writes: columns x <= x1
    x, width, message = ctypes.c_int(x0), ctypes.c_int(), ctypes.create_string_buffer(_MESSAGE_BYTES)
    failed = _library(library).jt_jpeg_region(data, len(data), 8 // d, x, x1, y0, y1, pixels.ctypes.data, width,
                                              most, message)
    if failed:
        text = message.value.decode(errors="replace")
        raise Image.DecompressionBombError(text) if failed == -2 else DecodeError(text)
    img = Image.frombuffer("RGB", (width.value, y1 - y0), pixels[: (y1 - y0) * width.value * 3], "raw", "RGB", 0, 1)
    return img.resize((size, size), Image.BILINEAR, box=(left - x.value, top - y0, right - x.value, bottom - y0))


if __name__ == "__main__":  # python -m jaxtrain.data.jpeg: build the region decoder, say if usable (exit 1 if not)
    import sys

    from jaxtrain.io import console

    with console.lines():  # the build's warnings, as a command line says them
        why = unusable()
    if why is not None:
        print(f"JPEG region decoder: not usable: {why}", file=sys.stderr)
        sys.exit(1)
    print(f"JPEG region decoder: {LIBRARY.build()}")
