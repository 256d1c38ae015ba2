"""crop+flip augmentation: a function of (seed, epoch, example index) only; inside the padded image; train only."""

import numpy as np
import pytest

from jaxtrain import ConfigError
from jaxtrain.data import augment, loader
from jaxtrain.data.split import Split

RNG = np.random.default_rng(0)
SPLIT = Split(RNG.integers(1, 256, (40, 32, 32, 3), dtype=np.uint8), RNG.integers(0, 10, 40).astype(np.int32))


def windows(image, pad=augment.PAD):
    """Every crop of the zero-padded image and of its mirror: what crop_flip may return."""
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
    h, w, _ = image.shape
    return [(dy, dx, flip) for dy in range(2 * pad + 1) for dx in range(2 * pad + 1) for flip in (False, True)], \
        lambda dy, dx, flip: (padded[:, ::-1] if flip else padded)[dy:dy + h, (2 * pad - dx if flip else dx):][:, :w]


def test_each_output_is_a_crop_of_the_padded_image_possibly_mirrored():
    index = np.arange(40)
    out = augment.crop_flip(SPLIT.images, seed=1, epoch=2, index=index)
    assert out.shape == SPLIT.images.shape and out.dtype == np.uint8
    chosen = []
    for image, got in zip(SPLIT.images, out):
        choices, crop = windows(image)
        matches = [c for c in choices if np.array_equal(crop(*c), got)]
        assert matches, "not a window of the padded image"
        chosen.append(matches[0])
    dys, dxs, flips = zip(*chosen)
    assert len(set(dys)) > 4 and len(set(dxs)) > 4 and 0.2 < np.mean(flips) < 0.8  # really random


def test_choices_depend_on_seed_epoch_and_index_only():
    index = np.array([3, 17, 5, 29])
    a = augment.crop_flip(SPLIT.images[index], 7, 1, index)
    np.testing.assert_array_equal(a, augment.crop_flip(SPLIT.images[index], 7, 1, index))
    # the same example gets the same crop whatever batch it is in, in whatever position
    np.testing.assert_array_equal(a[1], augment.crop_flip(SPLIT.images[[17]], 7, 1, np.array([17]))[0])
    assert not np.array_equal(a, augment.crop_flip(SPLIT.images[index], 7, 2, index))  # another epoch
    assert not np.array_equal(a, augment.crop_flip(SPLIT.images[index], 8, 1, index))  # another seed


def batches(epoch, start=0, **kw):
    return list(loader.Loader(SPLIT, 8, train=True, seed=3, augment="crop+flip", **kw).epoch(epoch, start))


def test_one_process_two_processes_and_a_resume_see_the_same_augmented_batches():
    whole = batches(1)
    halves = [batches(1, process_index=p, process_count=2) for p in (0, 1)]
    for b, (first, second) in zip(whole, zip(*halves)):
        np.testing.assert_array_equal(b["image"], np.concatenate([first["image"], second["image"]]))
        np.testing.assert_array_equal(b["label"], np.concatenate([first["label"], second["label"]]))
    for b, resumed in zip(whole[2:], batches(1, start=2)):
        np.testing.assert_array_equal(b["image"], resumed["image"])
    workers = list(loader.Loader(SPLIT, 8, train=True, seed=3, augment="crop+flip", workers=2).epoch(1))
    for b, w in zip(whole, workers):
        np.testing.assert_array_equal(b["image"], w["image"])
    plain = list(loader.Loader(SPLIT, 8, train=True, seed=3).epoch(1))
    assert not np.array_equal(whole[0]["image"], plain[0]["image"])  # it augments...
    np.testing.assert_array_equal(whole[0]["label"], plain[0]["label"])  # ...the same examples


def test_evaluation_batches_are_never_augmented():
    test = list(loader.Loader(SPLIT, 16, train=False, augment="crop+flip").epoch(0))
    np.testing.assert_array_equal(np.concatenate([b["image"] for b in test])[:40], loader.normalise(SPLIT.images))


def test_an_unknown_augmentation_is_a_one_line_error():
    with pytest.raises(ConfigError, match="unknown augmentation 'mixup': use one of none, crop\\+flip"):
        loader.Loader(SPLIT, 8, train=True, augment="mixup")
