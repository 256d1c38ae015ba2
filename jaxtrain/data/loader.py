"""Batches of a split with grain: seeded shuffle, process shard, pad for eval.

grain maps batch indices to batches: ``MapDataset.range(batches).map(make_batch)``. The epoch's order depends
only on (seed, epoch), never on the device or process count; each process builds only its rows of every
global batch (the contiguous slice its devices hold), so across processes every example is read exactly
once per epoch, and a run resumed at batch k of an epoch builds the very batches k, k+1, ... it would have.

Two kinds of split: a ``Split`` held in memory (``workers``: grain threads; float32 batches) and a
``FolderSplit`` of image files (``workers``: grain worker processes, each decoding whole batches; uint8
batches, normalised on the device by the model). A folder's files that fail to decode are replaced and
counted (``FolderSplit.on_bad``), and JPEGs the region decoder refused are Pillow's: each count is said in one
line at the end of each epoch (the workers' notes travel with the batches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import atexit
import contextlib
import functools
import gc
import logging
import os
import signal
import sys

import grain
import numpy as np
from grain.multiprocessing import SharedMemoryArray

from jaxtrain.choices import AUGMENTATIONS
from jaxtrain.data import augment as augment_lib
from jaxtrain.data.folder import FolderSplit
from jaxtrain.data.split import Split, normalise  # noqa: F401 - normalise: its public home was here
from jaxtrain import errors
from jaxtrain.errors import ConfigError, named

log = logging.getLogger(__name__)


def _absl_flags_parsed() -> None:
    """grain 0.2.18's worker processes read absl flags (their defaults), which fails unless something parsed them:
    a program that never used absl marks them parsed, as absl's own tests do."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


# What a Ctrl-C, a SIGTERM or a scheduler's SIGUSR1 sends to the whole process group: the parent's to handle.
_PARENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def _signals_held():
    """Block the parent's signals in this thread while worker processes start: the threads grain starts here, and
    the processes they spawn, inherit the block, so a signal sent to the process group while a worker still
    imports (seconds) waits in it until ``_worker_started`` ignores it, instead of killing it (grain: "Worker
    process was terminated unexpectedly"). This process still gets the signal, in one of its other threads."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _PARENT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _worker_started(index: int, count: int, flags: dict | None = None) -> None:
    """A decode worker leaves signals to its parent (which stops it with ``Loader.close``: a Ctrl-C, a SIGTERM or
    a scheduler's SIGUSR1 sent to the process group reaches the run's own handlers, not a traceback per worker),
    exits if its parent is gone (killed: nothing else would stop it), and names parameters as its parent does
    (``flags``: ``errors.spoken()``; a command line's flags in the errors it raises)."""
    errors.speak(flags)
    import os
    import threading
    import time

    _absl_flags_parsed()
    for sig in _PARENT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # one sent while this process started, blocked until now, is dropped
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _PARENT_SIGNALS)
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=watch, name="jaxtrain-orphan-watch", daemon=True).start()


@atexit.register
def _give_back_shared_memory() -> None:
    """Unlink the shared memory of the batches let go: those in reference cycles (grain's buffers, a traceback's
    frames) collected now, then grain's one unlinking thread waited for (first in, first out). At exit too: none is
    left to Python's resource_tracker, which would warn of "leaked shared_memory objects". A grain without that
    thread's (private) attribute is said in one line, once (``_cannot_await_shared_memory``)."""
    if not hasattr(SharedMemoryArray, "_del_thread_pool"):  # grain 0.2.18 has no public way to wait for it
        _cannot_await_shared_memory()
        return
    pool = SharedMemoryArray._del_thread_pool  # None: no unlinking thread (each batch unlinked as it goes)
    if pool is not None:
        gc.collect()
        pool.apply(int)


@functools.cache  # once per process
def _cannot_await_shared_memory() -> None:
    import multiprocessing

    if multiprocessing.parent_process() is not None:  # a decode worker: the batches it sends are its parent's to
        return  # unlink, never its own
    log.warning("the shared memory of the batches let go cannot be awaited: grain %s's SharedMemoryArray has no "
                "_del_thread_pool (the private attribute of grain 0.2.18's unlinking thread jaxtrain waits for); "
                "Python's resource_tracker may then warn at exit of leaked shared_memory objects",
                getattr(grain, "__version__", "(unknown version)"))


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of one epoch: depends only on (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


_order = functools.lru_cache(maxsize=2)(epoch_order)  # a worker's: one permutation per epoch, not per batch
_EPOCHS_AHEAD = 1 << 20  # the stream's length in epochs: more than any run


def _check_spawnable(workers: int) -> None:
    """Worker processes start by spawning: each imports the main script again, from its file. A script read from
    stdin (``python - <<EOF``) has none, and every worker died with grain's long traceback."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is not None and not os.path.isfile(path):
        raise ConfigError(f"{named('workers', workers)}: worker processes start from the main script's file, and "
                          f"this script has none ({path}): save it as a file and run that, or use "
                          f"{named('workers', 0)}")


class Loader:
    """This process's share of each global batch, as dicts of numpy arrays.

    Training (``train=True``): shuffled per epoch, remainder dropped.
    Evaluation: in order, every example exactly once; the last global batch
    is padded to full size and carries ``mask`` (0 for padding).
    ``workers``: grain workers building batches ahead (threads for a
    ``Split``, processes for a ``FolderSplit``; 0: in the caller's thread).
    ``augment``: on training batches (``jaxtrain.data.augment``, and
    ``rrc+flip`` for folders: ``jaxtrain.data.images``); ``transform``: an
    extra per-batch function; both run in the workers.
    ``starts``: how many times the loader started its pipeline for an epoch,
    counted when its first batch is asked for: every epoch of a ``Split``
    (a new grain iterator) or of a folder without workers; a folder's worker
    processes only when they start (the first epoch, a resume, a break), not
    when they carry on into the next epoch. The loop's clock counts the wait
    for such a start as start-up, not data wait (``timing.Chrono``).
    """

    def __init__(self, split: Split | FolderSplit, batch_size: int, *, train: bool, seed: int = 0, workers: int = 0,
                 process_index: int | None = None, process_count: int | None = None,
                 transform: Callable[[dict], dict] | None = None, augment: str = "none"):
        import jax

        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if batch_size < 1 or batch_size % self.process_count:
            raise ConfigError(f"batch size {batch_size} does not split over {self.process_count} processes: "
                              f"use a multiple of {self.process_count}")
        if workers < 0:
            raise ConfigError(f"{named('workers', workers)}: must be >= 0")
        if train and len(split) < batch_size:
            raise ConfigError(f"batch size {batch_size} is larger than the {len(split)} training examples: give a "
                              f"smaller {named('batch_size')}, or more training examples")
        if split.raw and workers:
            _check_spawnable(workers)
        self.split, self.batch_size, self.train, self.seed = split, batch_size, train, seed
        self.workers, self.transform = workers, transform
        self._stream, self._next = None, 0  # the worker processes' batches, and the global batch they give next
        self.starts = 0  # pipelines started (``starts``)
        if not split.raw:
            augment_lib.get(augment)  # a bad name, or rrc+flip without files: a ConfigError here
        elif augment not in AUGMENTATIONS:
            raise ConfigError(f"unknown augmentation {augment!r}: use one of {', '.join(AUGMENTATIONS)}")
        self.augment = augment if train and augment != "none" else None  # never on evaluation batches

    def __len__(self) -> int:
        """Global batches per epoch."""
        n = len(self.split)
        return n // self.batch_size if self.train else -(-n // self.batch_size)

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    def dataset(self, epoch: int, start: int = 0) -> grain.MapDataset:
        """Batches ``start..`` of ``epoch`` as a grain MapDataset (random access), by their global numbers as the
        worker processes' stream takes them."""
        first = epoch * len(self)
        return grain.MapDataset.range(first + start, first + len(self)).map(self._global_batch)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[dict]:
        """Iterate over one epoch from batch ``start`` (a resumed run starts mid-epoch)."""
        if self.split.raw and self.workers:  # files: whole batches decoded in worker processes, kept across epochs
            return self._counted(self._from_stream(epoch, start), epoch, len(self) - start)
        # explicit options: iterating a MapDataset directly would start grain's default 16 threads
        options = grain.ReadOptions(num_threads=self.workers, prefetch_buffer_size=2 * self.workers)
        return self._counted(self._started(iter(self.dataset(epoch, start).to_iter_dataset(options))), epoch,
                             len(self) - start)

    def _started(self, batches: Iterator[dict]) -> Iterator[dict]:
        """``batches``, a start counted when the first is asked for (see ``starts``)."""
        self.starts += 1
        yield from batches

    def _from_stream(self, epoch: int, start: int) -> Iterator[dict]:
        """The worker processes' stream of batches over every epoch to come (batch g: epoch g // len, batch
        g % len; evaluation passes are all alike), so they start once (seconds each: Python, grain, JAX), not
        every epoch: continued where the last epoch ended, started again anywhere else (a resume, a break)."""
        g = (epoch if self.train else 0) * len(self) + start
        fresh = self._stream is None or (self._next != g and (self.train or start or self._next % len(self)))
        if fresh:
            self.starts += 1
            self.close()
            _absl_flags_parsed()
            steps = grain.MapDataset.range(g, g + len(self) * _EPOCHS_AHEAD).map(self._global_batch)
            self._stream = iter(steps.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
                                .mp_prefetch(grain.MultiprocessingOptions(self.workers, per_worker_buffer_size=2),
                                             worker_init_fn=functools.partial(_worker_started,
                                                                              flags=errors.spoken())))
            self._next = g
        stream = self._stream
        for i in range(len(self) - start):
            try:
                with _signals_held() if fresh and i == 0 else contextlib.nullcontext():  # the workers start here
                    batch = next(stream)
            except BaseException:  # a worker's error (raised here) ends this stream: the next epoch starts anew
                if self._stream is stream:
                    self.close()
                raise
            if self._stream is not stream:  # closed meanwhile (a new epoch began): this epoch's reader stops
                return
            self._next += 1
            yield batch

    def batch_at(self, epoch: int, b: int) -> dict:
        """Batch ``b`` of ``epoch``, built in the calling thread (one batch to compile for: no workers started)."""
        batch = self._global_batch(epoch * len(self) + b)
        batch.pop("bad"), batch.pop("pillow")
        return batch

    def _global_batch(self, g: int) -> dict:
        epoch, b = divmod(g, len(self))
        return self._batch(_order(len(self.split), self.seed, epoch) if self.train else None, b, epoch)

    def close(self) -> None:
        """Stop the worker processes (if any run); the next epoch starts new ones. The shared memory of the batches
        grain still held is given back now (else Python's resource_tracker warns at exit of "leaked" blocks)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
            del stream
            _give_back_shared_memory()

    def __getstate__(self) -> dict:  # what the worker processes get: never the stream they make
        return {**self.__dict__, "_stream": None}

    def _counted(self, batches: Iterator[dict], epoch: int, count: int) -> Iterator[dict]:
        """The batches without their lists of failed files and of JPEGs Pillow decoded; each count logged in one
        line with the epoch's last batch (before it is handed on: a loop that stops at its last batch never asks for
        more)."""
        counts, first = {"bad": 0, "pillow": 0}, {}  # this epoch's, and the first file of each
        for i in range(count):
            batch = next(batches)
            for key in counts:
                noted = batch.pop(key)
                counts[key] += len(noted)
                if noted:
                    first.setdefault(key, noted[0])
            if i == count - 1 and counts["bad"]:
                log.warning("epoch %d: %d image file(s) could not be decoded and were replaced by the next file of "
                            f"the split, e.g. %s ({named('on_bad_image', 'error')} stops instead)", epoch,
                            counts["bad"], first["bad"])
            if i == count - 1 and counts["pillow"]:
                log.warning("epoch %d: %d JPEG file(s) decoded by Pillow, slower: the region decoder refused them "
                            "(the first: %s)", epoch, counts["pillow"], first["pillow"])
            yield batch

    def _batch(self, order: np.ndarray | None, b: int, epoch: int) -> dict:
        bs, n = self.batch_size, len(self.split)
        lo, hi = (b * bs + self.process_index * self.local_batch_size,
                  b * bs + (self.process_index + 1) * self.local_batch_size)
        if order is not None:
            batch, bad, pillow = self.split.rows(order[lo:hi], train=True, augment=self.augment, seed=self.seed,
                                                 epoch=epoch)
        else:  # eval: in order, padded past the end with example 0 (its failures counted where it is real), masked
            idx = np.arange(lo, hi)
            real = idx < n
            batch, bad, pillow = self.split.rows(idx[real], train=False, augment=None, seed=self.seed, epoch=epoch)
            if pad := int((~real).sum()):
                first = self.split.rows(np.zeros(1, np.int64), train=False, augment=None, seed=self.seed,
                                        epoch=epoch)[0]
                batch = {k: np.concatenate([v, np.repeat(first[k], pad, axis=0)]) for k, v in batch.items()}
            batch["mask"] = real
        batch = self.transform(batch) if self.transform is not None else batch
        return {**batch, "bad": bad, "pillow": pillow}
