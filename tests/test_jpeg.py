"""The JPEG region decoder (jaxtrain.data.jpeg): Pillow's pixels, only the crop read, and a clear fallback. Its tests
skip where it cannot be built, saying why, and fail under CI=true (make test installs g++ and libjpeg-dev)."""

import io
import logging
import os
import re
import subprocess
import sys
import tracemalloc
import warnings

import numpy as np
import pytest
from PIL import Image
from conftest import ROOT, unavailable

from jaxtrain.data import images, jpeg
from jaxtrain.errors import ConfigError


@pytest.fixture
def region_decoder():
    """The region decoder is built here; else a skip, or under CI (``make test`` installs g++ and libjpeg-dev) a
    failure: its tests never vanish silently."""
    why = jpeg.unusable()
    if why is not None:
        unavailable(f"the JPEG region decoder is not usable: {why}")


usable = pytest.mark.usefixtures("region_decoder")


def photo(w=301, h=203, seed=0) -> np.ndarray:
    """Smooth shapes and some noise: a JPEG with detail at every scale, not a flat field."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    rng = np.random.default_rng(seed)
    img = np.stack([128 + 100 * np.sin(x / (9 + 7 * c) + y / (13 + 5 * c) + c) for c in range(3)], -1)
    return np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, **options) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", **options)
    return buf.getvalue()


def pillows(data: bytes, size: int, box) -> np.ndarray:
    """The independent reference: Pillow decodes the whole file at the same reduction, then resizes the box."""
    with Image.open(io.BytesIO(data)) as img:
        w, h = img.size
        d = jpeg.reduction(box, size)
        img.draft("RGB", (w // d, h // d))
        assert img.size == (-(-w // d), -(-h // d))  # Pillow took the same scale
        sx, sy = img.size[0] / w, img.size[1] / h
        scaled = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        return np.asarray(img.convert("RGB").resize((size, size), Image.BILINEAR, box=scaled))


@usable
@pytest.mark.parametrize("options", [dict(quality=90), dict(quality=90, subsampling=0), dict(quality=75, subsampling=1),
                                     dict(quality=90, progressive=True), dict(quality=95, optimize=True)],
                         ids=["4:2:0", "4:4:4", "4:2:2", "progressive", "optimized"])
def test_a_crop_decoded_alone_is_pillows_whole_decode_to_a_level(options):
    data = encoded(photo(), **options)
    w, h, space, sampling = jpeg.header(data)
    assert (w, h) == (301, 203) and jpeg.decodable(space, sampling)
    reductions = set()
    for k in range(40):
        rng = np.random.default_rng(k)
        size = int(rng.choice([8, 16, 32, 64, 150]))
        box = images.random_resized_box(w, h, rng) if k % 4 else images.centre_box(w, h, 0.875)
        reductions.add(jpeg.reduction(box, size))
        ours = np.asarray(jpeg.decode(data, w, h, size, box))
        assert ours.shape == (size, size, 3)
        assert np.abs(ours.astype(int) - pillows(data, size, box)).max() <= 1, (k, size, box)
    assert reductions == {1, 2, 4, 8}  # every scale was checked


@usable
def test_images_decode_takes_the_region_decoder_for_a_jpeg_and_pillow_for_the_rest(tmp_path, monkeypatch):
    pixels = photo(120, 90)
    Image.fromarray(pixels).save(tmp_path / "a.jpg", quality=90)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    Image.fromarray(pixels).convert("CMYK").save(tmp_path / "cmyk.jpg", quality=90)  # libjpeg: no CMYK -> RGB
    Image.fromarray(pixels[..., 0]).save(tmp_path / "grey.jpg", quality=90)
    calls = []
    monkeypatch.setattr(jpeg, "decode", lambda *a, _decode=jpeg.decode: calls.append(1) or _decode(*a))
    box_of = lambda w, h: (10, 5, 90, 85)  # noqa: E731
    for name, by_region in (("a.jpg", 1), ("a.png", 0), ("cmyk.jpg", 0), ("grey.jpg", 1)):
        calls.clear()
        out = images.decode(tmp_path / name, 32, box_of, flip=True)
        pillow = images.decode(tmp_path / name, 32, box_of, flip=True, region=False)
        assert out.shape == (32, 32, 3) and len(calls) == by_region, name
        assert np.abs(out.astype(int) - pillow).max() <= 1, name
    grey = images.decode(tmp_path / "grey.jpg", 32, box_of)
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()


def declaring(data: bytes, w: int, h: int) -> bytes:
    """The JPEG ``data`` with its frame header (SOF) declaring ``w`` x ``h`` pixels: a decompression bomb."""
    at = 2
    while data[at + 1] not in (0xC0, 0xC1, 0xC2):  # each segment: FF, its marker, its length (2 bytes), ...
        at += 2 + int.from_bytes(data[at + 2:at + 4], "big")
    return data[:at + 5] + h.to_bytes(2, "big") + w.to_bytes(2, "big") + data[at + 9:]


@usable
def test_a_jpeg_declaring_a_huge_size_is_refused_as_pillow_refuses_it_before_anything_is_allocated(tmp_path):
    bomb = declaring(encoded(photo(64, 64), quality=90), 65500, 65500)  # 4.3 gigapixels in a few KB
    (tmp_path / "bomb.jpg").write_bytes(bomb)
    assert jpeg.header(bomb)[:2] == (65500, 65500) and len(bomb) < 10_000
    tracemalloc.start()  # numpy's arrays are traced (the region's buffer would be 200 MB at 1/8 scale)
    try:
        for region in (True, False):
            with pytest.raises(Image.DecompressionBombError, match=r"Image size \(4290250000 pixels\) exceeds limit"):
                images.decode(tmp_path / "bomb.jpg", 224, images.centre_box, region=region)
        with pytest.raises(Image.DecompressionBombError):
            jpeg.decode(bomb, 65500, 65500, 224, images.centre_box(65500, 65500))
        with pytest.raises(Image.DecompressionBombError):  # libjpeg's own guard: the caller's size is not the file's
            jpeg.decode(bomb, 64, 64, 32, images.centre_box(64, 64))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated for a bomb"


@usable
@pytest.mark.parametrize("limit, outcome", [(None, "decoded"), (4096, "decoded"), (3000, "warned"), (2000, "refused")])
def test_the_region_decoder_warns_and_refuses_where_pillow_does(tmp_path, monkeypatch, limit, outcome):
    """Pillow's limit (Image.MAX_IMAGE_PIXELS, read at each decode): a warning above it, an error above twice it."""
    Image.fromarray(photo(64, 64)).save(tmp_path / "a.jpg", quality=90)  # 4096 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    for region in (True, False):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                images.decode(tmp_path / "a.jpg", 32, images.centre_box, region=region)
                got = "warned" if [w for w in seen if w.category is Image.DecompressionBombWarning] else "decoded"
            except Image.DecompressionBombError:
                got = "refused"
        assert got == outcome, (region, [str(w.message) for w in seen])


@usable
def test_only_the_crop_is_read_and_a_damaged_crop_is_an_error():
    data = encoded(photo(256, 256), quality=90)
    cut = data[: len(data) // 2] + b"\xff\xd9"  # the top half's data, then the end: the bottom rows are lost
    top, bottom = (0, 0, 256, 64), (0, 192, 256, 256)
    np.testing.assert_array_equal(np.asarray(jpeg.decode(cut, 256, 256, 64, top)),
                                  np.asarray(jpeg.decode(data, 256, 256, 64, top)))  # never reads below the crop
    with pytest.raises(jpeg.DecodeError):
        jpeg.decode(data[: len(data) // 2], 256, 256, 64, bottom)  # ends early, inside the crop
    with pytest.raises(jpeg.DecodeError):
        jpeg.header(b"\xff\xd8\xff" + bytes(100))
    with pytest.raises(OSError, match="truncated"):  # Pillow's whole decode finds what the crop never reached
        Image.open(io.BytesIO(data[: len(data) // 2])).load()


@usable
def test_a_jpeg_damaged_inside_its_crop_is_a_bad_file_of_the_folder(tmp_path):
    from jaxtrain.data import folder

    data = encoded(photo(64, 64), quality=90)
    for where in ("train", "val"):
        (tmp_path / "d" / where / "cat").mkdir(parents=True)
        (tmp_path / "d" / where / "cat" / "good.jpg").write_bytes(data)
    (tmp_path / "d" / "train" / "cat" / "cut.jpg").write_bytes(data[: len(data) // 3])
    split = folder.load(tmp_path / "d", 16, on_bad="error", warn=lambda text: None)["train"]
    assert split.jpeg_library  # the workers' decoder, built by the main process
    with pytest.raises(ConfigError, match=r"cut.jpg cannot be decoded \(OSError: image file is truncated.*"
                                          r"on_bad_image=skip"):
        split.examples(np.arange(len(split)), None, 0, 0)  # refused by region, then by Pillow: damaged


@usable
def test_jpegs_the_region_decoder_refuses_are_pillows_counted_in_the_epochs_line(tmp_path, monkeypatch, caplog):
    """Never silently Pillow's: the JPEGs the region decoder refused travel with each batch (the workers are other
    processes) and are said in one line an epoch with their count and the first's reason, as damaged files are;
    none is said where none was refused. A file Pillow refuses too is a damaged file (counted by the loader)."""
    import itertools

    from jaxtrain.data import folder
    from jaxtrain.data.loader import Loader

    data = encoded(photo(64, 64), quality=90)
    for where, n in (("train", 4), ("val", 1)):
        (tmp_path / "d" / where / "cat").mkdir(parents=True)
        for k in range(n):
            (tmp_path / "d" / where / "cat" / f"{k}.jpg").write_bytes(data)
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    split = folder.load(tmp_path / "d", 32, warn=lambda text: None)["train"]
    loader = Loader(split, 2, train=True, process_index=0, process_count=1)
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        list(itertools.islice(loader.epoch(0), len(loader)))
        assert not caplog.records  # the region decoder's own: nothing to say

        def refuse(*args):
            raise jpeg.DecodeError("Unsupported marker type 0x99")

        monkeypatch.setattr(jpeg, "decode", refuse)
        for epoch in (1, 2):
            list(itertools.islice(loader.epoch(epoch), len(loader)))  # as the loop takes them: never one more
    said = (r"epoch {}: 4 JPEG file\(s\) decoded by Pillow, slower: the region decoder refused them \(the first: "
            + re.escape(str(tmp_path / "d" / "train" / "cat")) + r"/\d.jpg: Unsupported marker type 0x99\)")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(re.fullmatch(said.format(e), line) for e, line in zip((1, 2), lines)), lines
    refused = []  # one file: its pixels are Pillow's, noted for the caller
    np.testing.assert_array_equal(images.decode(tmp_path / "d" / "val" / "cat" / "0.jpg", 32, images.centre_box,
                                                refused=refused),
                                  images.decode(tmp_path / "d" / "val" / "cat" / "0.jpg", 32, images.centre_box,
                                                region=False))
    assert refused == [f"{tmp_path / 'd' / 'val' / 'cat' / '0.jpg'}: Unsupported marker type 0x99"]
    with pytest.raises(OSError, match="truncated"):  # Pillow's too: a damaged file, not noted here
        images.decode(tmp_path / "cut.jpg", 32, images.centre_box, refused=refused)
    assert len(refused) == 1


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_without_a_compiler_jpegs_are_pillows_and_one_line_says_why(tmp_path):
    (tmp_path / "d" / "cat").mkdir(parents=True)
    Image.fromarray(photo(64, 64)).save(tmp_path / "d" / "cat" / "a.jpg")
    Image.fromarray(photo(64, 64, 1)).save(tmp_path / "d" / "cat" / "b.jpg")
    code = ("import numpy as np; from jaxtrain.data import folder\n"
            f"s = folder.load({str(tmp_path / 'd')!r}, 16, val_fraction=0.5)['train']\n"
            "folder.load(s.root, 16, val_fraction=0.5)\n"
            "print(s.examples(np.arange(len(s)), 'rrc+flip', 0, 0)[0].shape)")
    env = {"CXX": "/nonexistent", "JAXTRAIN_JPEG_CACHE": str(tmp_path / "cache"),
           "JAXTRAIN_INDEX_CACHE": str(tmp_path / "index")}
    out = _python(code, **env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["(1,", "16,", "16,", "3)"]
    assert out.stderr.splitlines() == [  # a log warning, said by folder.load as a command line would
        "warning: JPEGs are decoded whole by Pillow, slower: the region decoder is not usable: no C++ compiler "
        "found (/nonexistent): install g++ (make onednn; Debian: apt-get install g++)"], out.stderr
    quiet = _python(code, JAXTRAIN_JPEG_DECODER="pillow", **env)  # Pillow's, asked for: nothing to say
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    built = subprocess.run([sys.executable, "-m", "jaxtrain.data.jpeg"], capture_output=True, text=True,
                           timeout=300, env={**os.environ, **env})
    assert built.returncode == 1 and built.stderr.splitlines() == [
        "JPEG region decoder: not usable: no C++ compiler found (/nonexistent): install g++ (make onednn; Debian: "
        "apt-get install g++)"], built.stderr


def test_what_the_region_decoder_leaves_to_pillow():
    assert jpeg.decodable(3, 2) and jpeg.decodable(1, 1)  # YCbCr 4:2:0, greyscale
    assert not jpeg.decodable(4, 1)  # CMYK: libjpeg does not make RGB of it
    assert not jpeg.decodable(3, 4)  # a 4x2 luma block: its crop came out up to 5 levels off Pillow's


@usable
def test_a_decoder_that_does_not_load_in_a_worker_stops_in_one_line_not_silently_pillows(tmp_path):
    import dataclasses

    from jaxtrain.data import folder

    for where in ("train", "val"):
        (tmp_path / "d" / where / "cat").mkdir(parents=True)
        Image.fromarray(photo(32, 32)).save(tmp_path / "d" / where / "cat" / "a.jpg")
    split = folder.load(tmp_path / "d", 16, warn=lambda text: None)["train"]
    broken = dataclasses.replace(split, jpeg_library=str(tmp_path / "gone.so"))
    with pytest.raises(ConfigError, match=r"the JPEG region decoder the run built does not load in a decode "
                                          r"worker: .*gone.so does not load"):
        broken.examples(np.arange(1), None, 0, 0)


@pytest.mark.slow
def test_without_the_decoder_its_tests_skip_saying_why_and_under_ci_fail(tmp_path):
    """No compiler: a test of the decoder skips with the reason; under CI=true it fails (it would have passed)."""
    test = "tests/test_jpeg.py::test_only_the_crop_is_read_and_a_damaged_crop_is_an_error"
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(CXX="/nonexistent", JAXTRAIN_JPEG_CACHE=str(tmp_path / "cache"))
    skipped, failed = (subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-rsE",
                                       test], capture_output=True, text=True, timeout=300, cwd=ROOT, env={**env, **ci})
                       for ci in ({}, {"CI": "true"}))
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout[-2000:]
    assert "SKIPPED" in skipped.stdout and "no C++ compiler found (/nonexistent)" in skipped.stdout, skipped.stdout
    assert failed.returncode == 1 and "1 error" in failed.stdout, failed.stdout[-2000:]
    assert "Failed: the JPEG region decoder is not usable: no C++ compiler found" in failed.stdout, failed.stdout
