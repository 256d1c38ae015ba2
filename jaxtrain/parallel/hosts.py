"""Which processes share this host and its cores: learned once, from the processes themselves.

Thread counts follow from it: oneDNN splits a convolution's reductions over its threads, so a device's
numbers depend on its thread count, and 2 processes x 1 device must give each device the threads that
1 process x 2 devices gives it (the cores over the devices at once) to match it bit for bit. No launcher's
environment says this for every launcher (jaxtrain.launch, srun, mpirun, the --coordinator flags), so after
``jax.distributed`` starts every process sends its hostname, local device count and CPU affinity to all
(``learn``), and each host's share is counted from what came back.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import socket
from pathlib import Path

import numpy as np

from jaxtrain import settings

log = logging.getLogger(__name__)

MAX_CPUS = 4096  # the affinity bitmask's width: CPUs numbered beyond it are not counted
NAME_BYTES = 64  # a hostname's first bytes, sent along for messages that name a process's host


@dataclasses.dataclass(frozen=True)
class Share:
    """This host as one process sees it: ``devices`` of all its processes, the ``cores`` they may run on
    together (the union of their affinities), this process's own ``own_cores``, and ``processes`` on it."""

    devices: int
    cores: int
    own_cores: int
    processes: int = 1

    @property
    def bound(self) -> bool:
        """True where a launcher bound this process to fewer cores than its host's processes use together (e.g.
        mpirun's default, one core per rank): XLA:CPU sizes its own thread pool by the cores a process sees."""
        return self.own_cores < self.cores


_learned: Share | None = None
_names: list[str] = []  # every process's hostname, in process order (``learn``)


def _mine(local_devices: int) -> np.ndarray:
    """[hostname digest (4 x int32), local devices, affinity bitmask (MAX_CPUS / 32 x int32), hostname
    (NAME_BYTES / 4 x int32)]."""
    host = socket.gethostname().encode()
    digest = np.frombuffer(hashlib.sha256(host + _boot_id()).digest()[:16], np.int32)
    mask = np.zeros(MAX_CPUS, np.uint8)
    mask[[c for c in settings.affinity() if c < MAX_CPUS]] = 1
    name = np.frombuffer(host[:NAME_BYTES].ljust(NAME_BYTES, b"\0"), np.int32)
    return np.concatenate([digest, [local_devices], np.packbits(mask).view(np.int32), name]).astype(np.int32)


_MASK = slice(5, 5 + MAX_CPUS // 32)


def _boot_id() -> bytes:
    """The running kernel's boot id: two machines (or containers on them) with one hostname are still two hosts;
    containers on one machine share it, and its cores."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_bytes()
    except OSError:
        return b""


def share_of(rows: np.ndarray, me: int) -> Share:
    """The share of process ``me`` from every process's ``_mine`` row (one per process, in process order)."""
    rows = np.asarray(rows, np.int32)
    same_host = (rows[:, :4] == rows[me, :4]).all(axis=1)
    masks = np.unpackbits(rows[:, _MASK].view(np.uint8), axis=1)
    cores = int(np.logical_or.reduce(masks[same_host], axis=0).sum())
    return Share(devices=int(rows[same_host, 4].sum()), cores=max(1, cores), own_cores=max(1, int(masks[me].sum())),
                 processes=int(same_host.sum()))


def learn() -> Share:
    """Exchange every process's hostname, devices and affinity (one all-gather; all processes call it, after
    ``jax.distributed`` starts) and keep this process's share; rank 0 says, in one line, if a launcher's binding
    keeps a process from the cores its host's others use."""
    global _learned
    import jax
    from jax.experimental import multihost_utils

    rows = np.asarray(multihost_utils.process_allgather(_mine(jax.local_device_count())))
    shares = [share_of(rows, p) for p in range(len(rows))]
    _names[:] = [row[_MASK.stop:].tobytes().rstrip(b"\0").decode(errors="replace") for row in rows]
    _learned = shares[jax.process_index()]
    bound = [p for p, s in enumerate(shares) if s.bound]
    if bound and jax.process_index() == 0 and jax.local_devices()[0].platform == "cpu":
        s = shares[bound[0]]
        log.info(f"note: process {bound[0]} may run on {s.own_cores} of the {s.cores} cores its host's processes "
                 "use (its launcher binds it: mpirun by default, srun with --cpu-bind): XLA:CPU sizes its threads by "
                 "them, so parameters may differ in the last bits from a 1-process run on as many devices; "
                 "mpirun --bind-to none (srun --cpu-bind=none) keeps them equal")
    return _learned


def current() -> Share:
    """This process's share: ``learn``'s in a multi-process run, else this process alone on its cores."""
    import jax

    if _learned is not None:
        return _learned
    if jax.process_count() > 1:
        _say_unknown()
    return Share(devices=jax.local_device_count(), cores=settings.cores(), own_cores=settings.cores())


@functools.cache
def _say_unknown() -> None:
    log.info("note: jax.distributed was started outside jt.setup_devices, so the processes sharing this host are "
             "unknown: thread counts assume this process is alone on its cores")


def host_of(process: int) -> str:
    """Process ``process``'s hostname (after ``learn``; this host's own before)."""
    return _names[process] if process < len(_names) else socket.gethostname()


def disagreeing(values: list[str]) -> list[int]:
    """The processes whose value differs from process 0's."""
    return [p for p, v in enumerate(values) if v != values[0]]


def agree(value: str, what: str, fix: str) -> None:
    """Every process's ``value`` (a hex digest) is process 0's, or a ConfigError on every process naming the
    first that differs and its host (one all-gather; every process calls it)."""
    import jax
    from jax.experimental import multihost_utils

    from jaxtrain.errors import ConfigError

    if jax.process_count() == 1:
        return
    row = np.frombuffer(value.encode().ljust(64, b"\0")[:64], np.uint8)
    values = [r.tobytes().rstrip(b"\0").decode() for r in np.asarray(multihost_utils.process_allgather(row))]
    if bad := disagreeing(values):
        p = bad[0]
        raise ConfigError(f"process {p} on {host_of(p)} has other {what} than process 0 on {host_of(0)} "
                          f"({values[p][:12]}... vs {values[0][:12]}...): {fix}")
