"""Image folders (``--dataset folder:DIR``): the index, decoding, the transforms, bad input, and the loader's
batches (worker processes, exactly once across processes, mid-epoch resume)."""

import itertools
import os

import numpy as np
import pytest
from image_folders import CLASSES, code, make_coded, make_folder, noise
from PIL import Image

from jaxtrain import settings
from jaxtrain.data import folder, images
from jaxtrain.data.loader import Loader, normalise
from jaxtrain.errors import ConfigError


@pytest.fixture
def cache(tmp_path):
    with settings.override(index_cache=tmp_path / "index-cache"):
        yield tmp_path / "index-cache"


def test_train_and_val_folders_give_sorted_classes_and_every_file(tmp_path, cache):
    root = make_folder(tmp_path / "d", {"train": 6, "val": 2}, classes=("ship", "cat", "dog"))
    data = folder.load(root, 16)
    train, test = data["train"], data["test"]
    assert train.class_names == test.class_names == ("cat", "dog", "ship")  # sorted by name
    assert (len(train), len(test)) == (18, 6) and np.bincount(train.labels).tolist() == [6, 6, 6]
    for split in (train, test):  # each file's label is its folder's place among the classes
        assert all(split.class_names[label] == f.split(os.sep)[0] for f, label in zip(split.files, split.labels))
    assert sorted(train.files) == sorted(str(p.relative_to(root / "train")) for p in (root / "train").rglob("*.*"))
    assert train.image_shape == (16, 16, 3) and train.raw


def test_one_folder_is_split_per_class_by_val_fraction_the_same_way_every_time(tmp_path, cache):
    root = make_folder(tmp_path / "d", {"": 10})
    data = folder.load(root, 8, val_fraction=0.3)
    assert np.bincount(data["test"].labels).tolist() == [3, 3, 3] and np.bincount(data["train"].labels).tolist() == [
        7, 7, 7]
    assert not set(data["train"].files) & set(data["test"].files)
    assert folder.load(root, 8, val_fraction=0.3)["test"].files == data["test"].files  # fixed
    with pytest.raises(ConfigError, match="pass val_fraction="):
        folder.load(root, 8)
    with pytest.raises(ConfigError, match="between 0 and 1"):
        folder.load(root, 8, val_fraction=1.5)


def test_head_takes_a_subset_of_every_class(tmp_path, cache):
    train = folder.load(make_folder(tmp_path / "d", {"train": 10, "val": 1}), 8)["train"]
    assert set(train.head(9).labels.tolist()) == {0, 1, 2}


def test_the_index_is_cached_and_a_changed_folder_is_indexed_again(tmp_path, cache, monkeypatch):
    root = make_folder(tmp_path / "d", {"train": 4, "val": 1})
    opened = []
    real = folder._opens
    monkeypatch.setattr(folder, "_opens", lambda path: opened.append(path) or real(path))
    first = folder.load(root, 8)
    assert len(opened) == 15 and len(list(cache.glob("*.json"))) == 2  # train/ and val/
    opened.clear()
    assert folder.load(root, 8)["train"].files == first["train"].files and opened == []  # from the cache
    Image.fromarray(noise((9, 9, 3), 1)).save(root / "train" / "cat" / "new.png")
    again = folder.load(root, 8)
    assert len(again["train"]) == 13 and "cat/new.png" in again["train"].files
    assert folder.digest(*again.values()) != folder.digest(*first.values())
    replaced = root / "train" / "dog" / "001.jpg"  # the same name, other bytes: a new size and time
    Image.fromarray(noise((31, 41, 3), 2)).save(replaced, quality=50)
    os.utime(replaced, ns=(1, 1))
    assert folder.load(root, 8)["train"].index_digest != again["train"].index_digest


@pytest.mark.parametrize("mode", ["L", "RGBA", "CMYK", "P", "RGB"])
def test_every_colour_mode_becomes_rgb_uint8_of_the_size_asked(tmp_path, mode):
    path = tmp_path / f"x.{'jpg' if mode in ('L', 'CMYK', 'RGB') else 'png'}"
    Image.fromarray(noise((30, 50, 3), 3)).convert(mode).save(path)
    out = images.decode(path, 12, lambda w, h: images.centre_box(w, h))
    assert out.shape == (12, 12, 3) and out.dtype == np.uint8


def test_a_16_bit_greyscale_png_is_scaled_to_8_bits_not_clipped(tmp_path):
    levels = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    Image.fromarray(levels).save(tmp_path / "deep.png")
    out = images.decode(tmp_path / "deep.png", 64, lambda w, h: images.centre_box(w, h))
    assert (out[..., 0] == out[..., 2]).all()
    assert np.abs(out[..., 0].astype(int) - np.round(levels / 257)).max() <= 1  # Pillow alone: all 255 but one


def test_a_jpeg_decoded_at_a_reduced_scale_is_close_to_the_full_decode(tmp_path):
    path = tmp_path / "big.jpg"
    smooth = np.kron(noise((30, 40, 3), 4), np.ones((32, 32, 1), np.uint8))  # 960x1280, blocks of one colour
    Image.fromarray(smooth).save(path, quality=95)
    reduced = images.decode(path, 64, lambda w, h: images.centre_box(w, h)).astype(float)
    with Image.open(path) as img:
        full = np.asarray(img.convert("RGB").resize((64, 64), Image.BILINEAR, box=images.centre_box(*img.size)))
    assert np.abs(reduced - full).mean() < 4  # the same picture (draft decodes at 1/8 here)


def test_random_resized_crops_follow_torchvision_and_depend_only_on_seed_epoch_and_index():
    boxes = [images.random_resized_box(500, 375, np.random.default_rng(i)) for i in range(400)]
    areas = np.array([(r - left) * (b - t) for left, t, r, b in boxes]) / (500 * 375)
    ratios = np.array([(r - left) / (b - t) for left, t, r, b in boxes])
    assert all(0 <= left < r <= 500 and 0 <= t < b <= 375 for left, t, r, b in boxes)
    assert 0.07 < areas.min() and areas.max() <= 1.0 and areas.mean() > 0.3
    assert ratios.min() > 0.7 and ratios.max() < 1.4
    assert images.random_resized_box(10, 1000, np.random.default_rng(0)) == (0, 493, 10, 506)  # the fallback
    a, b = images._rng(1, 2, 3).random(), images._rng(1, 2, 3).random()
    assert a == b != images._rng(1, 3, 3).random()


def _loader(split, train=True, **kw):
    return Loader(split, kw.pop("batch_size", 6), train=train, seed=kw.pop("seed", 5), process_index=kw.pop("pi", 0),
                  process_count=kw.pop("pc", 1), **kw)


def _all(loader, epoch=0, start=0):
    return list(loader.epoch(epoch, start))


def test_worker_processes_give_the_batches_of_the_callers_thread_and_a_resume_mid_epoch_the_same(tmp_path, cache):
    train = folder.load(make_folder(tmp_path / "d", {"train": 8, "val": 2}), 16)["train"]
    here = [_all(_loader(train, augment="rrc+flip"), epoch=e) for e in (1, 2)]
    workers = _loader(train, augment="rrc+flip", workers=2)
    try:
        first = _all(workers, epoch=1)
        stream = workers._stream
        second = _all(workers, epoch=2)
        assert workers._stream is stream  # the processes went on to the next epoch: started once
        assert workers.starts == 1  # so epoch 2's first wait is no start-up (timing.Chrono)
        _all(workers, epoch=4)
        assert workers.starts == 2  # a break in the stream: started again
    finally:
        workers.close()
    for a, b in zip(here[0] + here[1], first + second, strict=True):
        assert a["image"].dtype == np.uint8 and set(a) == {"image", "label"}
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["label"], b["label"])
    assert not np.array_equal(here[0][0]["image"], here[1][0]["image"])  # another epoch, other crops
    resumed = _loader(train, augment="rrc+flip", workers=2)
    try:
        for a, b in zip(here[0][2:], _all(resumed, epoch=1, start=2), strict=True):
            np.testing.assert_array_equal(a["image"], b["image"])
        assert resumed.starts == 1
    finally:
        resumed.close()


@pytest.mark.parametrize("train", [True, False])
def test_two_processes_read_every_example_exactly_once_per_epoch(tmp_path, cache, train):
    split = folder.load(make_coded(tmp_path / "d", 10), 8, val_fraction=0.2)["train" if train else "test"]
    batch = 6 if train else 4
    seen = []
    for pi in (0, 1):
        loader = _loader(split, train=train, batch_size=batch, pi=pi, pc=2, workers=1, augment="none")
        for b in _all(loader):
            rows = code(b["image"])
            seen += rows[b["mask"]].tolist() if not train else rows.tolist()
        loader.close()
    numbers = {f: int(code(np.asarray(Image.open(os.path.join(split.root, f)))[None])[0]) for f in split.files}
    expected = sorted(numbers.values())
    if train:  # the remainder of the shuffled epoch is dropped: each read once, none twice
        assert len(seen) == len(set(seen)) == len(split) // batch * batch and set(seen) <= set(expected)
    else:
        assert sorted(seen) == expected


@pytest.mark.parametrize("name", ["lenet", "resnet18", "vit"])
def test_uint8_batches_are_normalised_on_the_device_as_the_host_would(name):
    import jax

    from jaxtrain import models

    model = models.get(name, input_shape=(32, 32, 3), conv="xla")
    params, state = model.init(jax.random.key(0))
    pixels = noise((2, 32, 32, 3), 5)
    np.testing.assert_array_equal(np.asarray(model.logits(params, state, pixels)),  # bit for bit
                                  np.asarray(model.logits(params, state, normalise(pixels))))


def _bad_folder(root):
    make_folder(root, {"train": 4, "val": 1})
    cat = root / "train" / "cat"
    (cat / "notes.jpg").write_text("not an image")
    (cat / "empty.jpg").write_bytes(b"")
    Image.new("1", (20000, 20000)).save(cat / "huge.png")  # 400 megapixels: over Pillow's limit
    (cat / "gone.jpg").symlink_to(cat / "nowhere.jpg")
    (cat / "loop").symlink_to(cat)  # a folder that contains itself
    (cat / "readme.txt").write_text("not listed: not an image's extension")
    Image.fromarray(noise((200, 200, 3), 9)).save(cat / "whole.jpg")
    whole = (cat / "whole.jpg").read_bytes()
    (cat / "truncated.jpg").write_bytes(whole[: len(whole) * 6 // 10])  # its header whole, its data cut
    return root


def test_files_that_do_not_open_are_left_out_of_the_index_in_one_line(tmp_path, cache):
    lines = []
    data = folder.load(_bad_folder(tmp_path / "d"), 8, warn=lines.append)
    assert len(lines) == 1 and lines[0].startswith(f"{tmp_path / 'd' / 'train'}: 5 file(s) left out")
    files = set(data["train"].files)
    assert "cat/truncated.jpg" in files  # its header opens: found only when decoded
    assert not files & {"cat/notes.jpg", "cat/empty.jpg", "cat/huge.png", "cat/gone.jpg", "cat/readme.txt"}
    assert not any(f.startswith("cat/loop") for f in files)


def test_a_file_that_fails_to_decode_is_replaced_and_counted_once_per_epoch_or_is_one_line(tmp_path, cache, capsys,
                                                                                            caplog):
    """Counted in one log line per epoch: the library's names its parameter (on_bad_image=error), the command
    line's its flag (issue 64: it named the parameter, printed, to the command line's user)."""
    from jaxtrain import cli

    data = folder.load(_bad_folder(tmp_path / "d"), 8, warn=lambda text: None)
    loader = _loader(data["train"], batch_size=14, workers=1)
    batches = list(itertools.islice(loader.epoch(0), len(loader)))  # as the loop takes them: never one more
    loader.close()
    assert len(batches) == 1 and batches[0]["image"].shape == (14, 8, 8, 3)
    said = [r for r in caplog.records if r.name.startswith("jaxtrain")]
    assert len(said) == 1 and said[0].levelname == "WARNING", said
    assert said[0].getMessage().startswith("epoch 0: 1 image file(s) could not be decoded")
    assert "truncated.jpg" in said[0].getMessage() and "(on_bad_image=error stops instead)" in said[0].getMessage()
    capsys.readouterr()
    with cli.library_log():  # as python -m experiments.* says it
        list(itertools.islice(_loader(data["train"], batch_size=14).epoch(1), 1))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: epoch 1: 1 image file(s) could not be decoded"), err
    assert err[0].endswith("(--on-bad-image error stops instead)"), err
    strict = folder.load(tmp_path / "d", 8, on_bad="error", warn=lambda text: None)
    with pytest.raises(ConfigError, match=r"truncated.jpg cannot be decoded .*pass on_bad_image=skip"):
        _all(_loader(strict["train"], batch_size=14))
    with cli.library_log(), pytest.raises(ConfigError, match=r"cannot be decoded .*pass --on-bad-image skip"):
        _all(_loader(strict["train"], batch_size=14, workers=1))  # made in a worker process, said as its parent does


def test_a_programming_error_while_decoding_is_raised_not_counted_as_a_damaged_file(tmp_path, cache, monkeypatch):
    split = folder.load(_bad_folder(tmp_path / "d"), 8, warn=lambda text: None)["train"]
    everything = np.arange(len(split))
    _, bad, _ = split.examples(everything, None, 0, 0)
    assert [b.split(os.sep)[-1] for b in bad] == ["truncated.jpg (OSError)"]  # the decoders' errors: damaged
    for bug, error in ((lambda *args, **kwargs: len(None), TypeError),  # a bug, not a damaged file: raised
                       (lambda *args, **kwargs: None.shape, AttributeError),
                       # a decoded image of the wrong shape: numpy's ValueError storing it, not a decoder's
                       (lambda path, size, *args, **kwargs: np.zeros((size + 1, size, 3), np.uint8), ValueError)):
        monkeypatch.setattr(images, "decode", bug)
        with pytest.raises(error) as raised:
            split.examples(everything, None, 0, 0)
        assert not isinstance(raised.value, ConfigError), raised.value  # not "N files in a row fail to decode"


@pytest.mark.parametrize("layout, says", [
    ("missing", "not a directory"),
    ("no classes", "has no class folders"),
    ("empty class", r"class folder\(s\) with no usable image: dog"),
    ("train only", "has train/ but no val/ or test/"),
    ("val has more", "has classes train/ lacks: owl"),
    ("val only", r"has val/ but no train/ beside it: add train/ \(one sub-folder per class\)$"),
    ("nothing held out", r"val_fraction=0\.2 holds out no image of .* raise val_fraction="),
    # issue 64: said the (right) split was empty by the wrong name, and advised raising val_fraction
    ("nothing to train on", r"val_fraction=0\.999 holds out every image of .*, leaving none to train on: lower "
                            "val_fraction="),
])
def test_a_folder_that_cannot_be_used_is_one_line_naming_it(tmp_path, cache, layout, says):
    root = tmp_path / "d"
    if layout == "no classes":
        root.mkdir()
        Image.fromarray(noise((8, 8, 3), 0)).save(root / "loose.png")
    elif layout == "empty class":
        make_folder(root, {"train": 2, "val": 1}, classes=("cat",))
        (root / "train" / "dog").mkdir()
    elif layout == "train only":
        make_folder(root, {"train": 2})
    elif layout == "val has more":
        make_folder(root, {"train": 2, "val": 1}, classes=CLASSES)
        make_folder(root, {"val": 1}, classes=("owl",))
    elif layout == "val only":  # was: one class named "val", trained on without a word
        make_folder(root, {"val": 2})
    elif layout in ("nothing held out", "nothing to train on"):
        make_folder(root, {"": 2})
    with pytest.raises(ConfigError, match=says) as e:
        folder.load(root, 8, val_fraction={"no classes": 0.5, "nothing held out": 0.2,
                                           "nothing to train on": 0.999}.get(layout))
    assert "\n" not in str(e.value)


def test_a_val_folder_lacking_some_of_trains_classes_is_said_in_one_line(tmp_path, cache):
    # a new user's finding: val/ with one of train/'s classes evaluated on it alone, "test acc 1.00", without a word
    root = make_folder(tmp_path / "d", {"train": 2, "val": 1}, classes=CLASSES)
    for f in (root / "val" / CLASSES[1]).iterdir():
        f.unlink()
    said = []
    data = folder.load(root, 8, warn=said.append)
    assert said == [f"{root / 'val'} has no images of 1 of train/'s {len(CLASSES)} classes ({CLASSES[1]}): the "
                    "evaluation covers the others only"], said
    assert data["test"].class_names == data["train"].class_names
    folder.load(make_folder(tmp_path / "e", {"train": 2, "val": 1}, classes=CLASSES), 8, warn=said.append)
    assert len(said) == 1  # every class there: nothing said


def test_a_flat_folder_may_have_a_class_named_val_or_test(tmp_path, cache):
    make_folder(tmp_path / "d", {"": 4}, classes=("cat", "test", "val"))
    data = folder.load(tmp_path / "d", 8, val_fraction=0.25, warn=lambda text: None)
    assert data["train"].class_names == ("cat", "test", "val") and len(data["test"]) == 3


def test_a_file_failing_in_an_evaluation_batch_is_counted_once_not_again_for_each_padded_slot(tmp_path, cache,
                                                                                              caplog):
    """The last evaluation batch is padded with example 0 (masked); a damaged example 0 was counted once more for
    each padded slot (3 files said for 1)."""
    root = make_folder(tmp_path / "d", {"train": 2, "val": 1})
    test = folder.load(root, 8, warn=lambda text: None)["test"]
    first = root / "val" / test.files[0]  # example 0 of the test split: its header opens, its data is cut
    first.write_bytes(first.read_bytes()[:len(first.read_bytes()) * 6 // 10])
    test = folder.load(root, 8, warn=lambda text: None)["test"]
    assert len(test) == 3
    batches = _all(_loader(test, train=False, batch_size=5))
    assert [b["mask"].sum() for b in batches] == [3] and len(batches[0]["image"]) == 5
    np.testing.assert_array_equal(batches[0]["image"][3], batches[0]["image"][0])  # the padding: example 0
    said = [r.getMessage() for r in caplog.records if "could not be decoded" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("epoch 0: 1 image file(s) could not be decoded"), said


def test_a_folder_stays_on_the_host_said_as_a_folder_and_a_batch_larger_than_the_data_says_what_to_do(tmp_path,
                                                                                                     cache):
    from jaxtrain.driver import busy

    train = folder.load(make_folder(tmp_path / "d", {"train": 2, "val": 1}), 8)["train"]
    assert busy.data_on_device("auto", "gpu", train, None) == (False, "auto: an image folder stays on the host")
    with pytest.raises(ConfigError, match="image folder"):
        busy.data_on_device("on", "gpu", train, None)
    with pytest.raises(ConfigError, match=r"batch size 7 is larger than the 6 training examples: give a smaller "
                                          r"batch_size=, or more training examples"):
        _loader(train, batch_size=7)


@pytest.mark.parametrize("given, says", [
    (dict(dataset="folder:/x", data_dir="/d"), r"data_dir= is for the local datasets' files \(fashion_mnist, mnist, "
                                               r"cifar10\); dataset=folder:/x names its own place"),
    (dict(dataset="tfds:mnist", data_dir="/d"), "data_dir= is for the local datasets' files"),
    (dict(dataset="folder:/x", tfds_dir="/t"), "tfds_dir= is where TFDS keeps .*an image folder keeps a cache of its"),
    (dict(model="gpt", dataset="text:/x", tfds_dir="/t"), "tfds_dir= is where TFDS keeps .*text keeps a cache of its"),
    (dict(on_bad_image="error"), "on_bad_image=error is for image folders"),
    (dict(classes=""), "classes='': empty; name at least two classes"),
    (dict(classes=" "), "classes=' ': empty; name at least two classes"),
])
def test_a_setting_for_another_kind_of_dataset_is_refused_not_ignored(given, says):
    from jaxtrain.driver.config import RunConfig

    with pytest.raises(ConfigError, match=says):
        RunConfig(**given)


def test_rrc_flip_is_for_folders_and_the_folder_settings_for_folders_only():
    from jaxtrain.data.split import Split
    from jaxtrain.driver.config import RunConfig

    split = Split(np.zeros((8, 4, 4, 1), np.uint8), np.zeros(8, np.int32))
    with pytest.raises(ConfigError, match="rrc\\+flip crops each image before it is decoded"):
        Loader(split, 4, train=True, augment="rrc+flip", process_index=0, process_count=1)
    with pytest.raises(ConfigError, match="for image folders"):
        RunConfig(image_size=64)
    assert RunConfig(model="resnet50", dataset="folder:/x").augment == "rrc+flip"
    assert RunConfig(model="resnet50", dataset="folder:/x").image_size == 224
    assert (RunConfig(dataset="folder:/x").augment, RunConfig(dataset="folder:/x").image_size) == ("none", 32)
    assert RunConfig().augment == "none"
    from jaxtrain.cli import parse, to_argv

    for config in (RunConfig(model="resnet50", dataset="folder:/x", augment="none"),
                   RunConfig(model="lenet", dataset="folder:/x", image_size=64), RunConfig(augment="crop+flip")):
        assert parse(to_argv(config), model=config.model) == config  # a sweep's trials get the settings asked
    from jaxtrain.sweep.trials import parse_param

    assert parse_param("image_size=choice:64,128").values == (64, 128)  # a sweep over a folder's settings
    assert parse_param("on_bad_image=choice:skip,error").values == ("skip", "error")
    with pytest.raises(ConfigError, match="image_size=0"):
        parse_param("image_size=choice:0,128")


def test_workers_from_a_script_read_on_stdin_are_one_line_before_any_starts(tmp_path):
    """Issue 68: ``python - <<EOF`` with workers: each worker died importing the script from "<stdin>", and grain
    said so in a long traceback. Now the loader says why and what to do, before any worker starts."""
    import subprocess
    import sys
    from pathlib import Path

    root = make_folder(tmp_path / "d", {"train": 4, "val": 1})
    script = (f"from jaxtrain.data import folder\nfrom jaxtrain.data.loader import Loader\nfrom jaxtrain.errors import "
              f"ConfigError\nsplits = folder.load({str(root)!r}, 16)\ntry:\n    Loader(splits['train'], 2, train=True, "
              "workers=1, process_index=0, process_count=1)\nexcept ConfigError as e:\n    print(e)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, env=env, timeout=300)
    assert run.stdout == ("workers=1: worker processes start from the main script's file, and this script has none "
                          "(<stdin>): save it as a file and run that, or use workers=0\n"), run.stderr[-2000:]
