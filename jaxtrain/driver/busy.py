"""Keeping the device busy: how many steps a call runs, and whether the training split lives on the devices.

``--steps-per-call auto`` on a GPU measures the step: the time one more
step adds to a call of ``PROBE`` steps is the device's work per step
(the host's part is paid once a call), and a call gets enough steps for
``TARGET_SEC`` of it. On CPUs the device is the host: ``auto`` is 1 there
(docs/gpu-busy.md has what K and device data do on a CPU, measured).
``--data-on-device auto`` holds an in-memory split on a GPU when it takes
at most ``DEVICE_SHARE`` of the device's memory. A multi-process run takes process
0's choices (``agreed``): every process must make the same calls.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from jaxtrain.driver.config import on_host_only
from jaxtrain.train.timing import median_seconds

TARGET_SEC = 0.010  # device work per call: enough that a call's host part (dispatch, read, hooks) hides behind it
PROBE = 8  # the steps of the call measured against a single step
MOST = 256  # steps per call at most: a signal stops the run at the end of the call in flight
DEVICE_SHARE = 0.25  # of a GPU's memory, the most an auto-placed training split may take


def steps_per_call(setting: str, platform: str, measure=None) -> tuple[int, str]:
    """(K, why) for ``--steps-per-call``: a number as given; ``auto``: 1 off GPUs, else ``measure()``'s
    seconds per step inside a call (``per_step_in_call``) turned into a call of ``TARGET_SEC``."""
    if setting != "auto":
        return int(setting), "as given"
    if platform != "gpu" or measure is None:
        return 1, f"auto: 1 on a {platform.upper()} (the host is the device)"
    per_step = measure()
    k = max(1, min(MOST, math.ceil(TARGET_SEC / max(per_step, 1e-9))))
    return k, f"auto: {1e3 * per_step:.3f} ms of device work a step, {k} steps make a call of >= 10 ms"


def per_step_in_call(trainer, state, batch: dict, repeats: int = 3) -> float:
    """Seconds one more step adds to a call: (a call of PROBE steps - a call of one) / (PROBE - 1), each the
    median of ``repeats`` after a warm-up, on a copy of ``state`` (the run's own is not advanced). The PROBE
    steps are a loop on a GPU (the runs' K-step call) and laid out straight on a CPU (``unroll=None``): there a
    loop's convolutions run other, far slower kernels, and a CPU's runs take one step a call (ResNet-18 with
    XLA's convolutions, batch 8: 7.1 s a step in a loop, 0.15 laid out, 0.14-0.17 one step a call)."""
    stacked = jax.tree.map(lambda x: np.stack([x] * PROBE), batch)  # this process's rows, as ``batch``
    one, many = trainer.shard(batch), trainer.shard_steps(stacked)
    state = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)

    def timed(call, batches):
        def once():
            nonlocal state
            state, metrics = call(state, batches)
            jax.block_until_ready(metrics)
        return median_seconds(once, repeats)

    single, call = timed(trainer.step, one), timed(functools.partial(trainer.placed_steps, unroll=None), many)
    return max(call - single, 0.0) / (PROBE - 1)


def data_on_device(setting: str, platform: str, split, device) -> tuple[bool, str]:
    """(on, why) for ``--data-on-device``: ``on`` refuses a split streamed from files in one line; ``auto``
    holds an in-memory split on a GPU when it fits in ``DEVICE_SHARE`` of the device's memory."""
    if setting == "off":
        return False, "as given"
    if split.raw:  # an image folder: its files decoded on the host as they stream
        if setting == "on":
            raise on_host_only(text=False)
        return False, "auto: an image folder stays on the host"
    if not hasattr(split, "images"):  # text: windows cut from the token file on the host
        if setting == "on":
            raise on_host_only(text=True)
        return False, "auto: text's windows are cut on the host"
    if setting == "on":
        return True, "as given"
    if platform != "gpu":
        return False, f"auto: off on a {platform.upper()}"
    size = split.images.nbytes + split.labels.nbytes
    limit = (device.memory_stats() or {}).get("bytes_limit", 0)  # a device of this process's
    if size > DEVICE_SHARE * limit:
        return False, f"auto: the split ({size / 2**20:.0f} MiB) is over a quarter of the GPU's memory"
    return True, f"auto: the split ({size / 2**20:.0f} MiB) fits in a quarter of the GPU's memory"


def agreed(k: int, on_device: bool) -> tuple[int, bool]:
    """Process 0's steps per call and data placement, on every process (one process: as given): a measured K
    or a memory limit may differ between processes, and their calls must not."""
    if jax.process_count() == 1:
        return k, on_device
    from jax.experimental import multihost_utils

    k, on_device = multihost_utils.broadcast_one_to_all(np.array([k, int(on_device)], np.int32))
    return int(k), bool(on_device)
