"""A run's dataset, by the kind its name says: the shape it is known to have before it is read, and its splits.

    fashion_mnist, mnist, cifar10   local files, converted once, or TFDS's copy (``jaxtrain.data.sources``)
    tfds:NAME                       a dataset TFDS has prepared (``sources``)
    folder:DIR                      images, one sub-folder per class, streamed from disk (``jaxtrain.data.folder``)
    text:PATH                       text for a language model, tokenized once (``jaxtrain.data.text``)

A run asks its data section (``driver.sections.Data``: ``dataset``, ``classes``, ``seq_len``, ...) three things,
and each kind answers them its own way: the shape before any file is read (``known_shape``: so that a run fails
before a conversion or a folder's index takes minutes), the splits (``read``, then ``cut`` to the section's
classes and subsets), and the shape they turned out to have (``found``). A local dataset's shape is known before
the read: a read that finds another is an error. Text's is its windows and its tokenizer's vocabulary, known
before the read and not read again. A folder's classes and a TFDS dataset's images are known only once read:
their read settles the shape.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxtrain.choices import FOLDER_PREFIX, KJV, TEXT_PREFIX, TFDS_PREFIX, check_dataset
from jaxtrain.data import classes, folder, sources, text
from jaxtrain.errors import ConfigError, named

SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class Read:
    """A dataset read: its ``splits`` ("train", "test"; ``cut``: to the classes and subsets), the ``digest`` of
    the whole dataset (a folder's: of its index; its images are read as a run streams them), and text's
    ``tokenizer``."""

    splits: dict
    digest: str  # of the whole dataset, before any cut
    tokenizer: text.Tokenizer | None = None


class Local:
    """fashion_mnist, mnist, cifar10: their images and classes are known before they are read."""

    def known_shape(self, c, teacher_classes: int | None) -> dict:
        shape = sources.shape_of(c.dataset)
        if c.classes:
            shape["num_classes"] = len(classes.pick(c.classes, classes.NAMES[c.dataset]))
        return shape

    def read(self, c, progress: bool | None, warn) -> Read:
        splits = {k: sources.load_split(c.dataset, k, data_dir=c.data_dir, tfds_dir=c.tfds_dir, progress=progress)
                  for k in SPLITS}
        return Read(splits, sources.split_digest(*splits.values()))

    def found(self, c, train, known: dict) -> dict:
        if (shape := sources.shape_of(c.dataset, train)) != known:
            raise ConfigError(f"dataset {c.dataset}: its files hold images {shape['input_shape']} of "
                              f"{shape['num_classes']} classes, not {known['input_shape']} of "
                              f"{known['num_classes']}: check {named('data_dir')}")
        return shape


class Tfds(Local):
    """tfds:NAME: read as the local datasets are; its images and classes are assumed until read."""

    def known_shape(self, c, teacher_classes: int | None) -> dict:
        return sources.shape_of(c.dataset)

    def found(self, c, train, known: dict) -> dict:
        return sources.shape_of(c.dataset, train)


class Folder:
    """folder:DIR: ``image_size`` square RGB images; its classes (the teacher's, or 10) assumed until its index is
    read."""

    def known_shape(self, c, teacher_classes: int | None) -> dict:
        return {"input_shape": (c.image_size, c.image_size, 3), "num_classes": teacher_classes or 10}

    def read(self, c, progress: bool | None, warn) -> Read:
        splits = folder.load(c.dataset[len(FOLDER_PREFIX):], c.image_size, val_fraction=c.val_fraction,
                             on_bad=c.on_bad_image, crop_fraction=0.875 if c.augment == "rrc+flip" else 1.0,
                             warn=warn)
        return Read(splits, folder.digest(*splits.values()))

    def found(self, c, train, known: dict) -> dict:
        return sources.shape_of(c.dataset, train)


class Text:
    """text:PATH: windows of ``seq_len`` tokens over the tokenizer's vocabulary (a tokenizer file is read for it)."""

    def known_shape(self, c, teacher_classes: int | None) -> dict:
        return {"input_shape": (c.seq_len,), "num_classes": text.vocab_size(c.tokenizer, c.vocab_size)}

    def read(self, c, progress: bool | None, warn) -> Read:
        path = c.dataset[len(TEXT_PREFIX):]
        if path == KJV and not Path(path).expanduser().exists():
            raise ConfigError(f"dataset {c.dataset}: the King James Bible is not there yet: `make kjv` writes it "
                              f"(in jaxtrain's checkout, from Debian's bible-kjv), or give any text: "
                              f"{named('dataset', 'text:PATH')}")
        splits, tokenizer, digest = text.load(Path(path).expanduser(), seq_len=c.seq_len, tokenizer=c.tokenizer,
                                              bpe_vocab=c.vocab_size, val_fraction=c.val_fraction, warn=warn)
        return Read(splits, digest, tokenizer)

    def found(self, c, train, known: dict) -> dict:
        return known


KINDS = {TFDS_PREFIX: Tfds(), FOLDER_PREFIX: Folder(), TEXT_PREFIX: Text()}  # by prefix; else Local
LOCAL = Local()


def kind(dataset: str) -> Local | Tfds | Folder | Text:
    """The kind of dataset ``dataset`` names; a ConfigError for none."""
    check_dataset(dataset)
    return next((k for prefix, k in KINDS.items() if dataset.startswith(prefix)), LOCAL)


def known_shape(c, teacher_classes: int | None = None) -> dict:
    """``{"input_shape", "num_classes"}`` of the data section ``c``'s dataset, before it is read (a teacher's
    classes: a folder's, until its index is read)."""
    return kind(c.dataset).known_shape(c, teacher_classes)


def read(c, *, progress: bool | None, warn) -> Read:
    """The data section ``c``'s dataset read whole, its digest of all of it; ``progress``: a conversion's bar
    (None: on a terminal); ``warn``: how files left out or a damaged cache are said (a run's: by its first
    process)."""
    return kind(c.dataset).read(c, progress, warn)


def cut(c, whole: Read) -> Read:
    """``whole`` cut to the data section ``c``'s ``classes`` (relabelled) and its ``train_subset`` and
    ``test_subset``; its digest stays the whole dataset's. A dataset of one class is a ConfigError (a folder's
    reader takes one: ``folder.load`` serves decoding too)."""
    splits = classes.restricted(c.dataset, whole.splits, c.classes)
    if splits["train"].num_classes < 2:  # a folder of one sub-folder, say (text: a class per token)
        raise ConfigError(f"dataset {c.dataset} has one class ({classes.names_of(c.dataset, splits['train'])[0]}): a "
                          "classifier needs at least two")
    return dataclasses.replace(whole, splits={"train": splits["train"].head(c.train_subset),
                                              "test": splits["test"].head(c.test_subset)})


def found(c, train, known: dict) -> dict:
    """The shape of the training split ``train`` as read: ``known`` where the kind knew it before (a read that
    holds another is a ConfigError), else what the read found."""
    return kind(c.dataset).found(c, train, known)
