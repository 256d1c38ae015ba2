"""SIGTERM / SIGINT / SIGUSR1 over a whole run, from start-up to the last file.

- Start-up (before ``training()``): nothing is trained or saved yet, so a
  signal exits at once with 128 + N and a message, even in the middle of a
  compilation (Python's own KeyboardInterrupt there could crash XLA).
- Training: the first signal asks the loop to checkpoint and stop
  (``requested()`` turns true); a second one exits at once.
- Multi-process runs must stop at the same step: each step, every process
  puts its request (the signal number, or 0) into a tiny compiled max over
  all devices (``StopVote``), read one step late like the metrics; all
  processes read the same answer after the same step, so they all save that
  step. No coordinator round trip, no blocking. If no step finishes for a
  while after a signal (a peer is gone and the step waits on its collective
  forever), the process exits instead of waiting to be killed.

Why not JAX's preemption sync points (``multihost_utils.reached_preemption_sync_point``,
orbax's ``reached_preemption``): they need JAX's C++ notifier to own SIGTERM,
and then Python never sees it: no exit during start-up, no stuck-peer
watchdog, and SIGINT would still need this module.

The work is done by a thread woken through ``signal.set_wakeup_fd``, so it
happens even while the main thread is blocked inside JAX; the Python-level
handlers do nothing but keep the default actions away.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from jaxtrain.errors import ConfigError, named
from jaxtrain.io import console

log = logging.getLogger(__name__)

# SIGUSR1: what SLURM's --signal=B:USR1@SECONDS sends before a time limit (srun passes it on to the tasks).
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


STALLED_EXIT = 124  # a run ended by its stall watch (as timeout(1) reports a time-out)


class Exit(Exception):
    """The run ends with this process exit code (a signal stopped it: 128 + the signal)."""

    def __init__(self, code: int):
        self.code = code


def _ignore(*_):
    pass


def _exit_now(signum: int, why: str) -> None:
    try:  # on the watcher thread, not in a signal handler: logging's locks are free to take
        log.error(f"{signal.Signals(signum).name}: {why}")
    finally:
        console.exit_now(128 + signum)


class StopOnSignal:
    """``with StopOnSignal() as stop:`` ... ``stop.training()`` ... ``fit(should_stop=stop.requested)``."""

    STALL = 5.0  # seconds without a step after a signal (at least 3x the slowest step) before giving up
    # ... and at most this, in a multi-process run, even while a save is busy (a save can wait on a peer that is
    # gone): under half jaxtrain.parallel.processes.HEARTBEAT_TIMEOUT_SECONDS (30), after which JAX's coordination
    # service aborts every process without a word.
    STALL_LIMIT = 14.0

    def __init__(self, vote: Callable[[int], int] | None = None):
        self.vote = vote  # multi-process: StopVote(devices); None: this process decides alone
        self.at_start_up: Callable[[int], object] | None = None  # a signal during start-up: called, then exit
        self.signum = 0
        self._count = 0
        self._training = False
        self._started = False
        self._busy = 0
        self._finishing = False
        self._step = 0
        self._last = time.monotonic()
        self._slowest = 0.0
        self._checkpoints = True
        self._previous: dict = {}
        self._pipe: tuple[int, int] | None = None

    def watch_stalls(self, seconds: float, who: str) -> None:
        """Multi-process runs: when no train step finishes for ``seconds`` after the first (a collective waiting on
        a process that is stuck, or gone without JAX noticing), say so naming ``who`` and exit with
        ``STALLED_EXIT`` instead of waiting for the scheduler's limit. A save in flight is not a stall."""

        def watch():
            while not (self._started and not self._training):  # until training is over
                time.sleep(min(1.0, seconds / 4))
                quiet = time.monotonic() - self._last
                if self._training and self._step >= 2 and not self._busy and not self.signum and quiet > seconds:
                    log.error(f"{who}: no train step finished for {quiet:.0f} s "
                              f"({named('stall_timeout', format(seconds, 'g'))}): a "
                              "collective is waiting on a process that is stuck or gone; exiting")
                    console.exit_now(STALLED_EXIT)

        threading.Thread(target=watch, daemon=True, name="jaxtrain-stall-watch").start()

    def training(self, checkpoints: bool = True) -> None:
        """From now on a first signal asks for a checkpoint instead of exiting; ``checkpoints``: whether the run
        saves any (what a second signal, or a stalled stop, says is kept)."""
        self._last = time.monotonic()
        self._training = True
        self._started = True
        self._checkpoints = checkpoints

    def _kept(self, now: str) -> str:
        """What an exit now leaves: ``now`` about the checkpoint in flight, and the earlier ones intact; or, in a run
        without checkpoints, that nothing is saved."""
        if not self._checkpoints:
            return f"nothing saved (no {named('checkpoint_dir')})"
        return f"{now}; the ones before it are intact"

    def done(self) -> None:
        """Training is over (finished or stopped): no more stall watching."""
        self._training = False

    @contextlib.contextmanager
    def busy(self):
        """A save (or other long, legitimate pause of the loop): not a stall."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            self._last = time.monotonic()

    def _on_signal(self, signum: int) -> None:
        if self._finishing:  # stopped, saved, exiting with the first signal's code
            return
        self._count += 1
        if not self._started:
            if self.at_start_up is not None:
                self.at_start_up(signum)
            _exit_now(signum, "interrupted during start-up; nothing was trained or saved")
        if self._count > 1:
            _exit_now(signum, f"second signal: exiting now; {self._kept('a checkpoint being written is discarded')}")
        self.signum = signum
        if not self._training:  # after the last step: its end is being saved and written, then the run exits
            log.warning(f"{signal.Signals(signum).name}: training is over; the run ends once its files are written "
                        "(a second signal exits now)")
            return
        since = time.monotonic()
        while self.vote is not None and self._training:
            time.sleep(0.2)
            quiet = time.monotonic() - max(self._last, since)
            patience = self.STALL_LIMIT if self._busy else min(max(self.STALL, 3 * self._slowest), self.STALL_LIMIT)
            if self._training and self._step > 1 and quiet > patience:
                _exit_now(signum, f"no step finished for {quiet:.0f} s (a peer process is gone?): exiting; "
                                  f"{self._kept('no checkpoint of this stop')}")

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                data = b""
            if not data:
                os.close(read_fd)
                return
            for signum in data:
                if signum in SIGNALS:
                    threading.Thread(target=self._on_signal, args=(signum,), daemon=True).start()

    def stopped(self, step: int, checkpointer, say: Callable, then: Callable[[bool], None] | None = None) -> None:
        """Training stopped at ``step`` for the signal: say what was saved (``checkpointer``: the run's, or
        None), ``then(saved)`` (e.g. requeue the job), exit with 128 + the signal."""
        saved = False
        if checkpointer is None:
            say(f"stopped by signal at step {step}; nothing saved (no {named('checkpoint_dir')})")
        else:
            try:
                with self.busy():
                    checkpointer.close()
            except ConfigError as e:  # the stop's save failed (a full disk): said, and the stop still recorded
                say(f"stopped by signal at step {step}; {e}")
            else:
                saved = checkpointer.committed(step)
                say(f"stopped by signal at step {step}; checkpoint saved in {checkpointer.directory}: continue with "
                    f"{named('resume', True)}" if saved else
                    f"stopped by signal at step {step}; the checkpoint of step {step} was NOT written; the newest is "
                    f"step {checkpointer.latest()}: continue from there with {named('resume', True)}")
        self._finishing = True  # what was to be saved is saved: a further signal (e.g. the requeue's) is ignored
        if then is not None:
            then(saved)
        raise Exit(128 + self.signum) from None

    def requested(self) -> bool:
        """Called once per train step: whether the loop should checkpoint and stop now."""
        now = time.monotonic()
        if self._step >= 2:  # the first interval holds the first step's compilation
            self._slowest = max(self._slowest, now - self._last)
        self._last = now
        self._step += 1
        if self.vote is None:
            return bool(self.signum)
        agreed = self.vote(self.signum)  # the same on every process, one step late
        self.signum = self.signum or agreed
        return bool(agreed)

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: nothing to install
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._previous["wakeup"] = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, _ignore)  # the watcher thread acts
        threading.Thread(target=self._watch, args=(read_fd,), daemon=True, name="jaxtrain-signals").start()
        return self

    @contextlib.contextmanager
    def interrupts(self):
        """The Python API (a script's or a notebook cell's ``jt.run``): during training a first Ctrl-C (a kernel's
        interrupt) asks the loop to checkpoint and stop as a signal does; a second, or one outside training,
        is Python's KeyboardInterrupt. Never an exit: the interpreter (a notebook's kernel) lives on."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def on_sigint(signum, frame):
            if not self._training or self.signum:
                raise KeyboardInterrupt
            self.signum = signum

        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)

    def reinstall(self) -> None:
        """Take SIGTERM / SIGINT back (jax.distributed's preemption notifier takes SIGTERM when it starts)."""
        if self._pipe is not None:
            for s in SIGNALS:
                signal.signal(s, _ignore)

    def __exit__(self, *exc):
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous.pop("wakeup"))
        for s, handler in self._previous.items():
            if s == signal.SIGUSR1 and handler == signal.SIG_DFL:  # SLURM's time-limit warning after the run's end:
                handler = signal.SIG_IGN  # nothing to stop, and its default kills a process done (the job FAILED)
            signal.signal(s, handler)
        os.close(self._pipe[1])  # the watcher reads EOF and ends
        self._pipe = None


class StopVote:
    """``vote(signum) -> signum``: the largest request of any process, as posted at the previous call.

    Each process's request goes to its devices; one compiled max over all of
    them (a collective, dispatched without waiting) answers; the answer of the
    previous call is read, so the loop never waits for it beyond the step
    before. Every process calls it once per step, in the same order as its
    steps, and gets the same answers at the same steps.
    """

    def __init__(self, devices):
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        mesh = Mesh(np.asarray(devices), ("all",))
        self._sharding = NamedSharding(mesh, PartitionSpec("all"))
        self._mine = [d for d in devices if d.process_index == jax.process_index()]
        self._max = jax.jit(lambda requests: requests.max(), out_shardings=NamedSharding(mesh, PartitionSpec()))
        self._pending = None

    def __call__(self, signum: int) -> int:
        import jax
        import numpy as np

        mine = [jax.device_put(np.full((1,), signum, np.int32), d) for d in self._mine]
        requests = jax.make_array_from_single_device_arrays((self._sharding.mesh.size,), self._sharding, mine)
        previous, self._pending = self._pending, self._max(requests)
        return 0 if previous is None else int(jax.device_get(previous))
