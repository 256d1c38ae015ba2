"""CIFAR-10's binary files and datasets TFDS has prepared (tfds:NAME): read, validated, converted once."""

import socket
import sys

import numpy as np
import pytest
from test_data import as_sorted_pairs

from jaxtrain import ConfigError, cli
from jaxtrain.data import cifar, sources


def make_cifar_dir(root, per_file=3, n_test=4, seed=0):
    """The six binary files, small: returns {split: (images [N, 32, 32, 3], labels)} as they should read."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    expected = {}
    for split, names in cifar.FILES.items():
        parts = []
        for name in names:
            n = per_file if split == "train" else n_test
            labels = rng.integers(0, 10, n, dtype=np.uint8)
            planes = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)  # channel-major, as in the files
            (root / name).write_bytes(np.concatenate([labels[:, None], planes.reshape(n, -1)], axis=1).tobytes())
            parts.append((planes.transpose(0, 2, 3, 1), labels.astype(np.int32)))
        expected[split] = tuple(np.concatenate(x) for x in zip(*parts))
    return expected


@pytest.mark.parametrize("nested", [False, True])
def test_cifar10_binary_files_round_trip_through_the_tfds_conversion(tmp_path, nested):
    data_dir = tmp_path / "c"
    expected = make_cifar_dir(data_dir / "cifar-10-batches-bin" if nested else data_dir)
    for split, (images, labels) in expected.items():
        got = sources.load_split("cifar10", split, data_dir=data_dir, tfds_dir=tmp_path / "tfds")
        assert got.image_shape == (32, 32, 3) and got.num_classes == 10 and len(got) == len(labels)
        assert as_sorted_pairs(got.images, got.labels) == as_sorted_pairs(images, labels)  # TFDS shuffles
        direct = cifar.read_split(data_dir, split)  # the reader alone keeps the files' order
        np.testing.assert_array_equal(direct.images, images)
        np.testing.assert_array_equal(direct.labels, labels)
    assert list((tmp_path / "tfds").glob("jaxtrain_cifar10_binary/cifar10_*/1.0.0/*.array_record*"))
    red = expected["test"][0][0, 0, 0, 0]  # the first pixel's red byte is the file's second byte
    assert red == (data_dir / ("cifar-10-batches-bin" if nested else "") / "test_batch.bin").read_bytes()[1]


def damage_truncated(d):
    raw = (d / "data_batch_3.bin").read_bytes()
    (d / "data_batch_3.bin").write_bytes(raw[:-100])


def damage_record_size(d):  # CIFAR-100's records: 2 label bytes
    (d / "test_batch.bin").write_bytes(bytes(4 * 3074))


def damage_label(d):
    raw = bytearray((d / "data_batch_2.bin").read_bytes())
    raw[cifar.RECORD] = 12  # the second record's label
    (d / "data_batch_2.bin").write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, message", [
    (damage_truncated, r"data_batch_3\.bin: \d+ bytes is not a whole number of 3073-byte"),
    (damage_record_size, r"test_batch\.bin: \d+ bytes is not a whole number"),
    (damage_label, r"data_batch_2\.bin: record 1 has label 12, expected 0-9"),
    (lambda d: (d / "data_batch_5.bin").unlink(), r"data_batch_5\.bin is missing; pass data_dir= holding"),
])
def test_bad_cifar10_files_are_one_line_errors_naming_the_file(tmp_path, damage, message):
    make_cifar_dir(tmp_path / "c")
    damage(tmp_path / "c")
    with pytest.raises(ConfigError, match=message) as e:
        sources.load_split("cifar10", "train" if "test" not in message else "test", data_dir=tmp_path / "c",
                           tfds_dir=tmp_path / "tfds")
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "tfds").glob("**/*.array_record*")), "nothing may be written from bad files"


def png(image) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def prepare_tfds_dataset(tfds_dir, shape=(8, 6, 3), classes=5, n=(7, 3)):
    """A tiny image-classification dataset prepared by TFDS itself (PNG-encoded images, array_record)."""
    import tensorflow_datasets as tfds

    tfds_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    data = {split: (rng.integers(0, 256, (k, *shape), dtype=np.uint8), rng.integers(0, classes, k))
            for split, k in zip(("train", "test"), n)}

    class TinyShapes(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        name = "tiny_shapes"
        VERSION = tfds.core.Version("1.0.0")
        pkg_dir_path = tfds_dir  # where TFDS looks for README/citation files (none): not this test module

        def _info(self):
            return self.dataset_info_from_configs(
                features=tfds.features.FeaturesDict({"picture": tfds.features.Image(shape=shape),
                                                     "kind": tfds.features.ClassLabel(num_classes=classes)}),
                supervised_keys=("picture", "kind"))

        def _split_generators(self, dl_manager):
            return {s: self._generate_examples(*data[s]) for s in data}

        def _generate_examples(self, images, labels):
            for i, (image, label) in enumerate(zip(images, labels)):
                yield i, {"picture": png(image), "kind": int(label)}  # TFDS itself would encode with TensorFlow

    TinyShapes(data_dir=tfds_dir).download_and_prepare(file_format="array_record")
    return data


def test_a_dataset_tfds_prepared_is_read_by_name_with_its_shape_and_classes(tmp_path):
    data = prepare_tfds_dataset(tmp_path / "tfds")
    for split, (images, labels) in data.items():
        got = sources.load_split("tfds:tiny_shapes", split, tfds_dir=tmp_path / "tfds")  # no builder code: files
        assert got.image_shape == (8, 6, 3) and got.num_classes == 5
        assert as_sorted_pairs(got.images, got.labels) == as_sorted_pairs(images, labels)


def test_tfds_datasets_not_prepared_or_not_images_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"tfds:nothing_here.*tfds build nothing_here --file_format=array_record"):
        sources.load_split("tfds:nothing_here", "train", tfds_dir=tmp_path / "tfds")
    with pytest.raises(ConfigError, match="unknown dataset 'tfds:'"):
        sources.load_split("tfds:", "train")


def _damage(version_dir, how):
    for cached in version_dir.glob("*.npz"):  # the arrays kept beside it would serve the split without the records
        cached.unlink()
    records = next(version_dir.glob("*train.array_record*"))
    if how == "zeroed":
        raw = bytearray(records.read_bytes())
        raw[10:200] = bytes(190)
        records.write_bytes(bytes(raw))
    elif how == "truncated":
        records.write_bytes(records.read_bytes()[:100])
    else:
        (version_dir / "dataset_info.json").write_text("{not json")


@pytest.mark.parametrize("how", ["zeroed", "truncated", "metadata"])
def test_a_damaged_conversion_is_converted_again_with_a_warning(tmp_path, capsys, how):
    """(BAD 5) It raised a Riegeli or protobuf traceback on every run until the user deleted the cache."""
    from test_data import make_idx_dir

    arrays = make_idx_dir(tmp_path / "d", n_train=64, n_test=16)
    first = sources.load_split("fashion_mnist", "train", data_dir=tmp_path / "d", tfds_dir=tmp_path / "tfds")
    _damage(next((tmp_path / "tfds").rglob("1.0.0")), how)
    capsys.readouterr()
    with cli.library_log():  # a log warning, as a command line says it
        again = sources.load_split("fashion_mnist", "train", data_dir=tmp_path / "d", tfds_dir=tmp_path / "tfds")
    err = capsys.readouterr().err
    assert "is damaged" in err and "converting again" in err, err
    assert as_sorted_pairs(again.images, again.labels) == as_sorted_pairs(*arrays["train"])
    assert as_sorted_pairs(first.images, first.labels) == as_sorted_pairs(*arrays["train"])


def test_a_damaged_dataset_tfds_prepared_is_a_one_line_error_naming_its_directory(tmp_path):
    prepare_tfds_dataset(tmp_path / "tfds")
    _damage(next((tmp_path / "tfds" / "tiny_shapes").rglob("1.0.0")), "zeroed")
    with pytest.raises(ConfigError, match=rf"tfds:tiny_shapes in {tmp_path / 'tfds'} cannot be read .*Riegeli.*delete"):
        sources.load_split("tfds:tiny_shapes", "train", tfds_dir=tmp_path / "tfds")


def test_runs_converting_the_same_files_at_once_take_turns(tmp_path):
    """(BAD 4) Two runs converting one dataset into a fresh TFDS dir at once: one crashed with FileExistsError.
    Here a held lock makes both wait; released, one converts and the other reads its result."""
    import subprocess
    import sys

    from conftest import ROOT
    from test_data import make_idx_dir

    from jaxtrain.data import idx
    from jaxtrain.io.dirlock import DirLock

    make_idx_dir(tmp_path / "d", n_train=64, n_test=16)
    config = f"fashion_mnist_{sources.files_digest(idx.paths(tmp_path / 'd'))[:12]}"
    code = (f"from jaxtrain.data import sources; s = sources.load_split('fashion_mnist', 'train', "
            f"data_dir={str(tmp_path / 'd')!r}, tfds_dir={str(tmp_path / 'tfds')!r}); print(len(s), s.labels.sum())")
    holder = tmp_path / "tfds" / "jaxtrain_idx_images"
    holder.mkdir(parents=True)
    with DirLock(holder, "--tfds-dir", name=f".{config}.lock"):  # another run converting: both must wait
        procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for p in procs:  # reads until each says it waits (no sleep); '' if it ended instead
            line = "-"
            while line and "waiting for another run converting" not in line:  # a progress line, on stdout
                line = p.stdout.readline()
            assert line, p.communicate()[1][-2000:]
        assert all(p.poll() is None for p in procs)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    results = [out.strip().splitlines()[-1] for out, _ in outs]  # TFDS prints its progress on stdout
    assert results[0] == results[1] and results[0].startswith("64 "), results
    assert sum("to array_record (once)" in out for out, _ in outs) == 1, [out[-2000:] for out, _ in outs]


@pytest.mark.parametrize("terminal, progress", [(False, None), (True, False)])
def test_tfds_progress_bars_show_only_where_the_runs_would(tmp_path, capsys, monkeypatch, terminal, progress):
    """--no-progress with output to a file still got TFDS's progress lines, with escape codes, while converting."""
    import tensorflow_datasets as tfds
    from test_data import make_idx_dir

    tfds.enable_progress_bar()  # TFDS's default: its switch is process-wide
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    make_idx_dir(tmp_path / "d", n_train=64, n_test=16)
    with cli.library_log():
        sources.load_split("fashion_mnist", "train", data_dir=tmp_path / "d", tfds_dir=tmp_path / "tfds",
                           progress=progress)
    out, err = capsys.readouterr()
    assert "converting the files" in out  # it did convert here
    assert "\r" not in err and "\x1b[" not in err and "examples/s" not in err, err



def test_each_kind_of_dataset_knows_its_shape_before_the_read_or_takes_the_reads(tmp_path):
    """``data/datasets.py``: a local dataset's shape is known before any file is read, and a read that finds
    another is an error; text's is its windows and vocabulary, not read again; a folder's classes and a TFDS
    dataset's images are the read's. ``classes=`` counts before the read only for a local dataset."""
    from jaxtrain.data import datasets
    from jaxtrain.data.split import Split
    from jaxtrain.driver.sections import Data

    local = Data(dataset="cifar10", classes="cat,dog,ship")
    assert datasets.known_shape(local) == {"input_shape": (32, 32, 3), "num_classes": 3}
    split = Split(np.zeros((2, 32, 32, 3), np.uint8), np.array([0, 1], np.int32), 3)
    assert datasets.found(local, split, datasets.known_shape(local)) == datasets.known_shape(local)
    with pytest.raises(ConfigError, match=r"cifar10: its files hold images \(32, 32, 3\) of 3 classes, not "
                                          r"\(32, 32, 3\) of 10: check data_dir"):
        datasets.found(Data(dataset="cifar10"), split, datasets.known_shape(Data(dataset="cifar10")))
    tfds = Data(dataset="tfds:tiny_shapes", classes="0,1")  # assumed until read, its classes too
    assert datasets.known_shape(tfds) == {"input_shape": (28, 28, 1), "num_classes": 10}
    assert datasets.found(tfds, split, datasets.known_shape(tfds)) == {"input_shape": (32, 32, 3), "num_classes": 3}
    folder = Data(dataset="folder:/nowhere", image_size=48, classes="a,b")
    assert datasets.known_shape(folder) == {"input_shape": (48, 48, 3), "num_classes": 10}
    assert datasets.known_shape(folder, teacher_classes=4)["num_classes"] == 4
    assert datasets.found(folder, split, datasets.known_shape(folder)) == {"input_shape": (32, 32, 3),
                                                                          "num_classes": 3}
    text = Data(dataset="text:/nowhere", seq_len=16, tokenizer="bytes")
    assert datasets.known_shape(text) == {"input_shape": (16,), "num_classes": 256}
    assert datasets.found(text, split, datasets.known_shape(text)) == datasets.known_shape(text)  # not an image's
    with pytest.raises(ConfigError, match="unknown dataset 'svhn'"):
        datasets.known_shape(Data(dataset="svhn"))


def test_each_kind_of_dataset_reads_itself_whole_and_is_cut_to_its_classes_and_subsets(tmp_path, monkeypatch):
    """``datasets.read`` gives the whole dataset and its digest, by the kind's own reader and the section's
    settings; ``datasets.cut`` keeps the named classes (relabelled in their order) and the subsets, and the
    digest stays the whole dataset's."""
    from image_folders import make_folder

    from jaxtrain.choices import KJV
    from jaxtrain.data import datasets, folder, text
    from jaxtrain.driver.sections import Data

    said = []
    make_cifar_dir(tmp_path / "c", per_file=4)
    local = Data(dataset="cifar10", data_dir=str(tmp_path / "c"), tfds_dir=str(tmp_path / "tfds"),
                 classes="cat,dog,frog", train_subset=5, test_subset=3)
    whole = datasets.read(local, progress=False, warn=said.append)
    assert len(whole.splits["train"]) == 20 and whole.splits["train"].num_classes == 10
    assert whole.digest == sources.split_digest(*(sources.load_split("cifar10", k, data_dir=tmp_path / "c",
                                                                     tfds_dir=tmp_path / "tfds")
                                                   for k in ("train", "test")))
    cut = datasets.cut(local, whole)
    labels = whole.splits["train"].labels
    kept = labels[np.isin(labels, [3, 5, 6])][:5]  # cat, dog, frog
    assert cut.digest == whole.digest and cut.splits["train"].num_classes == 3
    np.testing.assert_array_equal(cut.splits["train"].labels, np.searchsorted([3, 5, 6], kept))
    assert len(cut.splits["test"]) == min(3, int(np.isin(whole.splits["test"].labels, [3, 5, 6]).sum()))

    root = make_folder(tmp_path / "f", {"train": 3, "val": 2})
    images = Data(dataset=f"folder:{root}", image_size=12, augment="rrc+flip", classes="cat,dog", train_subset=4)
    whole = datasets.read(images, progress=False, warn=said.append)
    assert whole.digest == folder.digest(*whole.splits.values()) and whole.splits["train"].crop_fraction == 0.875
    assert datasets.read(Data(dataset=f"folder:{root}", image_size=12), progress=False,
                         warn=said.append).splits["train"].crop_fraction == 1.0
    cut = datasets.cut(images, whole)
    assert cut.splits["train"].class_names == ("cat", "dog") and len(cut.splits["train"]) == 4
    assert len(cut.splits["test"]) == 4

    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    words = Data(dataset=f"text:{tmp_path / 't.txt'}", seq_len=8, tokenizer="bytes", val_fraction=0.2, train_subset=3)
    whole = datasets.read(words, progress=False, warn=said.append)
    splits, tokenizer, digest = text.load(tmp_path / "t.txt", seq_len=8, tokenizer="bytes", val_fraction=0.2)
    assert whole.digest == digest and whole.tokenizer.vocab_size == tokenizer.vocab_size == 256
    np.testing.assert_array_equal(whole.splits["train"].tokens, splits["train"].tokens)
    assert len(datasets.cut(words, whole).splits["train"]) == 3 and said == []

    for layout, named_class in (({"train": 2, "val": 1}, "cat"), ({"": 3}, "cat"), ({"val": 2}, "val")):
        root = make_folder(tmp_path / f"one-{len(said)}-{named_class}-{len(layout)}", layout, classes=("cat",))
        one = Data(dataset=f"folder:{root}", image_size=8, val_fraction=None if "train" in layout else 0.3)
        whole = datasets.read(one, progress=False, warn=said.append)  # folder.load reads it (decoding serves too)
        with pytest.raises(ConfigError, match=rf"dataset folder:.* has one class \({named_class}\): a classifier "
                                              "needs at least two"):
            datasets.cut(one, whole)  # a run does not train on it (a folder holding val/ alone: "val")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no King James Bible here
    with pytest.raises(ConfigError, match=r"the King James Bible is not there yet: `make kjv` writes it"):
        datasets.read(Data(dataset=f"text:{KJV}", seq_len=8, tokenizer="bytes"), progress=False, warn=said.append)


def test_a_tfds_dir_that_is_a_file_and_missing_files_are_one_line_with_the_way_for_that_dataset(tmp_path):
    """A new user's findings: --tfds-dir naming a file gave two chained tracebacks (its mkdir's error was taken for a
    damaged copy); a missing cifar10 said "no files in None"; a missing mnist was told to install Fashion-MNIST's
    Debian package, and to let TFDS download what it had just failed to."""
    (tmp_path / "file").write_text("")
    for name in ("fashion_mnist", "tfds:mnist"):
        with pytest.raises(ConfigError, match=r"tfds_dir=.*file is not a directory: give the directory TFDS keeps its "
                                              "prepared datasets in") as e:
            sources.load_split(name, "train", tfds_dir=tmp_path / "file")
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"dataset cifar10 not found \(no data_dir= given, no prepared TFDS copy\); "
                                          r"pass data_dir="):
        sources.data_source("cifar10", "train", tfds_dir=tmp_path / "tfds", download=False)
    with pytest.raises(ConfigError, match=r"dataset mnist not found") as e:
        sources.data_source("mnist", "train", tfds_dir=tmp_path / "tfds", download=False)
    assert "fashion-mnist" not in str(e.value) and "pass data_dir= holding the four IDX files" in str(e.value)
    (tmp_path / "empty").mkdir()  # a data_dir given: TFDS is never tried, and either IDX dataset may be meant
    with pytest.raises(ConfigError, match=r"empty: train-images-idx3-ubyte\[\.gz\] is missing; pass data_dir= holding "
                                          r"the four IDX files \(train-images-idx3-ubyte\[\.gz\], \.\.\.\)$"):
        sources.load_split("mnist", "train", data_dir=tmp_path / "empty", tfds_dir=tmp_path / "tfds", download=False)
    from jaxtrain.data import idx

    assert "Debian package dataset-fashion-mnist" in idx.how_to_get("fashion_mnist")
    assert "TFDS" not in idx.how_to_get("mnist", download=False)


def test_a_download_that_cannot_connect_is_refused_at_once_naming_the_hosts(tmp_path, monkeypatch):
    """A new user's finding: offline, `--dataset mnist` waited over a minute on TFDS's ten retries of each file
    before its error. The hosts (or the proxy the environment names) are tried first, once each."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):  # this machine's own, if any
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    with socket.socket() as server, socket.socket() as gone:
        server.bind(("127.0.0.1", 0))
        server.listen()
        gone.bind(("127.0.0.1", 0))  # bound, never listening: its connections are refused
        port, refused = server.getsockname()[1], gone.getsockname()[1]
        up, down = f"http://127.0.0.1:{port}/file", f"http://127.0.0.1:{refused}/file"
        assert sources.unreachable([down]) == f"no connection to 127.0.0.1:{refused}: Connection refused"
        assert sources.unreachable([down, up]) is None
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
        assert sources.unreachable(["http://nowhere.invalid/file"]) is None  # through the proxy
        monkeypatch.delenv("http_proxy")
        monkeypatch.setenv("all_proxy", f"http://127.0.0.1:{port}")  # requests takes it for every scheme
        assert sources.unreachable(["https://nowhere.invalid/file"]) is None

    def offline(address, timeout=None):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(sources.socket, "create_connection", offline)
    with pytest.raises(ConfigError, match=r"dataset mnist not found .* and TFDS cannot download it \(no connection "
                                          r"to [^)]*Network is unreachable\); pass data_dir=") as e:
        sources.data_source("mnist", "train", tfds_dir=tmp_path / "tfds")
    assert "\n" not in str(e.value)


def test_files_tfds_has_downloaded_already_are_prepared_from_without_trying_the_hosts(tmp_path):
    """The review's finding: a cache of TFDS's downloads (a prepare cut short, a copy on a node offline) was
    refused offline, where TFDS prepares from it with no network."""
    import tensorflow_datasets as tfds
    from tensorflow_datasets.core.download import resource

    builder = tfds.builder("mnist", data_dir=tmp_path / "tfds")
    assert not sources._downloaded(builder)
    where = tmp_path / "tfds" / "downloads"
    (where / "mnist").mkdir(parents=True)
    files = [where / ("mnist" if i % 2 else "") / resource.get_dl_fname(url, info.checksum)  # TFDS's two places
             for i, (url, info) in enumerate(builder.url_infos.items())]
    for file in files[:-1]:
        file.write_bytes(b"x")
        resource.get_info_path(file).write_text("{}")
    assert not sources._downloaded(builder)  # one file missing: the hosts are tried
    files[-1].write_bytes(b"x")
    resource.get_info_path(files[-1]).write_text("{}")
    assert sources._downloaded(builder)
