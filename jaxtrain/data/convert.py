"""Local dataset files converted ONCE into array_record by jaxtrain's small TFDS builder (one config per set of
files, keyed by their sha256), under a lock; process 0 converts, the others wait for it."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from jaxtrain.data import cifar, idx
from jaxtrain.data.split import Split, files_digest
from jaxtrain.errors import ConfigError, named
from jaxtrain.io.dirlock import DirLock

log = logging.getLogger(__name__)


@functools.cache
def _builder_class(fmt: ModuleType):
    """Our TFDS builder for one local file format (idx or cifar), defined lazily (once): importing jaxtrain stays
    cheap."""
    import logging

    import tensorflow_datasets as tfds

    # Our configs are made per set of source files on purpose: not worth a warning each run.
    logging.getLogger("absl").addFilter(lambda r: not r.getMessage().startswith("Using custom data configuration"))

    class LocalImages(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """Images read from local files (their format: ``fmt``), stored as uint8 tensors."""

        name = {idx: "jaxtrain_idx_images", cifar: "jaxtrain_cifar10_binary"}[fmt]
        VERSION = tfds.core.Version("1.0.0")
        BUILDER_CONFIGS = []  # one config per set of source files: NAME_<digest>, see data_source
        MANUAL_DOWNLOAD_INSTRUCTIONS = "Put the dataset's files in the manual dir."

        def _info(self):
            return self.dataset_info_from_configs(
                features=tfds.features.FeaturesDict({
                    "image": tfds.features.Tensor(shape=fmt.IMAGE_SHAPE, dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=fmt.NUM_CLASSES)}),
                supervised_keys=("image", "label"))

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(fmt.read_split(Path(dl_manager.manual_dir), split))
                    for split in fmt.FILES}

        def _generate_examples(self, split: Split):
            for i in range(len(split)):
                yield i, {"image": split.images[i], "label": int(split.labels[i])}

    return LocalImages


def process_index() -> int:
    import jax

    return jax.process_index() if jax.distributed.is_initialized() else 0


def _wait_until_prepared(make_builder, timeout: float = 600.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        builder = make_builder()
        if builder.is_prepared():
            return builder
        time.sleep(0.5)
    raise ConfigError(f"process 0 did not finish converting the dataset within {timeout:.0f} s")


def conversion_dir(fmt: ModuleType, name: str, local: Path, tfds_dir) -> Path:
    """Where our builder keeps the conversion of the files in ``local``: ``TFDS_DIR/BUILDER/NAME_<digest>`` (the
    directory's name is the builder config's)."""
    import tensorflow_datasets as tfds

    config = f"{name}_{files_digest(fmt.paths(local))[:12]}"
    return Path(tfds_dir or tfds.core.constants.DATA_DIR).expanduser() / _builder_class(fmt).name / config


def conversion_lock(where: Path, local: Path) -> DirLock:
    """The lock of one conversion (``where``), beside it: runs converting the same files take turns."""
    return DirLock(where.parent, named("tfds_dir"), name=f".{where.name}.lock",
                   waiting=f"waiting for another run converting the files in {local}")


def converted(fmt: ModuleType, name: str, split: str, local: Path, tfds_dir):
    """The data source of our conversion of the files in ``local``, converted first if it is not there yet.

    Runs that convert the same files at once take turns on a lock file: the first converts, the others find
    its result. Process 0 converts for a multi-process run; the others wait for it.
    """
    import tensorflow_datasets as tfds

    where = conversion_dir(fmt, name, local, tfds_dir)
    config = tfds.core.BuilderConfig(name=where.name, description=f"{name} from the files in {local}")

    def make_builder():
        return _builder_class(fmt)(config=config, data_dir=tfds_dir)

    if process_index() > 0:
        builder = make_builder()
        return (builder if builder.is_prepared() else _wait_until_prepared(make_builder)).as_data_source(split=split)
    where.parent.mkdir(parents=True, exist_ok=True)
    with conversion_lock(where, local):
        builder = make_builder()
        if not builder.is_prepared():
            for s in fmt.FILES:  # validate before writing anything
                fmt.read_split(local, s)
            log.info(f"converting the files in {local} to array_record (once) ...")
            builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
                manual_dir=str(cifar.directory_of(local) if fmt is cifar else local)), file_format="array_record")
        return builder.as_data_source(split=split)
