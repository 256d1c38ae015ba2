"""--classes: a dataset cut to some of its classes, relabelled in the order given (jaxtrain.data.classes)."""

import json

import numpy as np
import pytest
from conftest import run_cli
from image_folders import make_folder

from jaxtrain.data import classes, folder
from jaxtrain.data.split import Split
from jaxtrain.errors import ConfigError


def test_a_folder_keeps_the_named_classes_relabelled_in_their_order(tmp_path):
    data = folder.load(make_folder(tmp_path / "d", {"train": 4, "val": 2}), 16, warn=lambda text: None)
    cut = classes.restricted("folder:x", data, "ship,cat")
    train = cut["train"]
    assert train.class_names == ("ship", "cat") and train.num_classes == 2 and len(train) == 8
    for f, label in zip(train.files, train.labels):
        assert f.split("/")[0] == ("ship", "cat")[label]
    assert len(cut["test"]) == 4 and set(cut["test"].labels) == {0, 1}


def test_an_in_memory_dataset_by_name_or_number():
    labels = np.arange(20, dtype=np.int32) % 10
    split = Split(np.arange(20, dtype=np.uint8).reshape(20, 1, 1, 1), labels)
    cut = classes.restricted("cifar10", {"train": split, "test": split}, "truck,3")["train"]
    assert cut.num_classes == 2 and list(cut.labels) == [1, 0, 1, 0]  # cat (3) -> 1, truck (9) -> 0
    assert list(cut.images.ravel()) == [3, 9, 13, 19]


def test_where_class_names_are_numbers_a_number_is_a_name_only():
    """A new user's folder of years: label 1 was taken for a folder "1" that is not there (it is "2013/")."""
    names = ("2012", "2013", "7")
    assert classes.pick("7,2012", names) == [2, 0]
    with pytest.raises(ConfigError, match=r"'1' is not a class .* its names are numbers, so name them"):
        classes.pick("1,2012", names)
    assert classes.pick("7,3", classes.NAMES["mnist"]) == [7, 3]  # MNIST's names are its label numbers
    assert classes.pick("2,cat", ("bird", "cat", "dog")) == [2, 1]  # no name is a number: numbers are labels


@pytest.mark.parametrize("spec, says", [("cat,horse", r"'horse' is not a class of this dataset \(its classes: "
                                                       r"cat, dog, ship"),
                                        ("cat,cat", "'cat' is named twice"), ("cat", "at least two classes"),
                                        ("cat,7", "'7' is not a class")])
def test_bad_selections_are_one_line(tmp_path, spec, says):
    data = folder.load(make_folder(tmp_path / "d", {"train": 2, "val": 1}), 16, warn=lambda text: None)
    with pytest.raises(ConfigError, match=says):
        classes.restricted("folder:x", data, spec)


def test_classes_that_leave_a_split_empty_are_one_line(tmp_path):
    """Issue found by a new user: a test split without the named classes trained and said "test acc nan"."""
    labels = np.arange(20, dtype=np.int32) % 10
    train = Split(np.zeros((20, 1, 1, 1), np.uint8), labels)
    test = Split(np.zeros((10, 1, 1, 1), np.uint8), np.arange(10, dtype=np.int32) % 5)  # classes 0-4 only
    with pytest.raises(ConfigError, match=r"classes='ship,truck': the test split holds no example of them: name "
                                          "classes it holds"):
        classes.restricted("cifar10", {"train": train, "test": test}, "ship,truck")
    with pytest.raises(ConfigError, match="the training split holds no example of them"):
        classes.restricted("cifar10", {"train": test, "test": train}, "ship,truck")
    assert len(classes.restricted("cifar10", {"train": train, "test": test}, "cat,dog")["test"]) == 2


def test_a_run_on_two_of_a_folders_classes(tmp_path):
    root = make_folder(tmp_path / "d", {"train": 8, "val": 2})
    run = run_cli("-m", "experiments.lenet", "--dataset", f"folder:{root}", "--classes", "dog,cat", "--devices", "2",
                  "--batch-size", "8", "--max-steps", "2", "--no-progress", "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["class_names"] == ["dog", "cat"] and summary["train_examples"] == 16
    assert json.loads((tmp_path / "run" / "model.json").read_text())["num_classes"] == 2
