"""Run a command as N cooperating JAX processes on this machine (like torchrun).

    python -m jaxtrain.launch --processes 2 [--devices-per-process 1] -- python -m experiments.lenet --epochs 3

Each process gets the coordinator address (a free localhost port), the
process count and its id in the environment, which ``jt.setup_devices``
reads to start ``jax.distributed``. Output lines are prefixed with the rank.
As soon as one process fails, the others are stopped and the launcher exits
with that process's code; Ctrl-C / SIGTERM are forwarded to all of them.
"""

from __future__ import annotations

import argparse
import os
import signal
import shutil
import socket
import subprocess
import sys
import threading
import time

from jaxtrain import settings

GRACE_SECONDS = 10  # after SIGTERM, before SIGKILL


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(rank: int, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[rank {rank}] {line}" if line.endswith("\n") else f"[rank {rank}] {line}\n")
            sys.stdout.flush()
    stream.close()


def _signal_all(procs, sig) -> None:
    """Send ``sig`` to every process (group) still running."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def _stop(procs, sig=signal.SIGTERM) -> None:
    _signal_all(procs, sig)
    deadline = time.monotonic() + GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def launch(command: list[str], processes: int, devices_per_process: int | None = None) -> int:
    """Run ``command`` as ``processes`` JAX processes; return the exit code."""
    port = free_port()
    lock = threading.Lock()
    procs, pumps = [], []
    for rank in range(processes):
        env = settings.launched(f"127.0.0.1:{port}", processes, rank, devices_per_process)
        # Own session: a terminal's Ctrl-C reaches the launcher only, which forwards it once.
        p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        procs.append(p)
        t = threading.Thread(target=_pump, args=(rank, p.stdout, lock), daemon=True)
        t.start()
        pumps.append(t)

    received = []

    received_at = []

    def forward(signum, _frame):
        received.append(signum)
        received_at.append(time.monotonic())
        _signal_all(procs, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        code = 0
        while True:
            codes = [p.poll() for p in procs]
            asked = 128 + received[0] if received else 0  # a worker stopping on our forwarded signal: no failure
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0, asked)]
            if failed:
                rank, code = failed[0]
                how = f"exited with code {code}"
                if code < 0:  # killed by a signal: exit as a shell would, 128 + signal
                    how, code = f"was killed by {signal.Signals(-code).name}", 128 - code
                with lock:
                    print(f"jaxtrain.launch: process {rank} {how}; stopping the others", file=sys.stderr, flush=True)
                _stop(procs)
                break
            if all(c in (0, asked) for c in codes):
                break
            if received and time.monotonic() - received_at[0] > GRACE_SECONDS:
                with lock:
                    print(f"jaxtrain.launch: processes still running {GRACE_SECONDS} s after the signal; killing them",
                          file=sys.stderr, flush=True)
                _signal_all(procs, signal.SIGKILL)
                received_at[0] = float("inf")
            time.sleep(0.1)
        if received and code == 0:
            code = 128 + received[0]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(procs)
        for t in pumps:
            t.join(timeout=5)
    return code


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, []
    p = argparse.ArgumentParser(prog="python -m jaxtrain.launch",
                                description="Run a command as N cooperating JAX processes on this machine.",
                                usage="python -m jaxtrain.launch --processes N [--devices-per-process K] -- "
                                      "COMMAND ...")
    p.add_argument("--processes", type=int, required=True, help="number of processes to start")
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="CPU virtual devices per process (sets JAXTRAIN_DEVICES_PER_PROCESS)")
    args = p.parse_args(own)
    if not command:
        p.error("give the command to run after --, e.g. -- python -m experiments.lenet")
    if args.processes < 1:
        p.error("--processes must be >= 1")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        p.error("--devices-per-process must be >= 1")
    if shutil.which(command[0]) is None:  # before any process starts: none is left waiting for its peers
        p.error(f"command not found: {command[0]} (give a program on PATH or a path to an executable file)")
    return launch(command, args.processes, args.devices_per_process)


if __name__ == "__main__":
    sys.exit(main())
