"""The d2l LeNet / ResNet-18 train step in PyTorch, timed in its own process for experiments.bench.

Its own process so that PyTorch's OpenMP threads and XLA's thread pools never
share an address space (the two runtimes' spinning worker threads slowed each
other down by up to 40% in one process). The parent sends ``steps`` over a
pipe and gets back seconds per step, so the blocks still interleave.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time


def available() -> bool:
    from importlib.util import find_spec

    return find_spec("torch") is not None


def _lenet():
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(20, 50, 5), nn.ReLU(),
                         nn.AvgPool2d(2), nn.Flatten(), nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10))


def _resnet18():
    """d2l's ResNet-18 for 28x28 input, as jaxtrain.models.resnet: 3x3 stem, no max-pool."""
    from torch import nn

    class Residual(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.BatchNorm2d(cout), nn.ReLU(),
                                      nn.Conv2d(cout, cout, 3, 1, 1), nn.BatchNorm2d(cout))
            self.short = nn.Conv2d(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

        def forward(self, x):
            return (self.body(x) + self.short(x)).relu()

    layers, cin = [nn.Conv2d(1, 64, 3, 1, 1), nn.BatchNorm2d(64), nn.ReLU()], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Residual(cin, cout, stride), Residual(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))


MODELS = {"lenet": _lenet, "resnet18": _resnet18}


def _make_step(model: str, batch_size: int, lr: float):
    import torch
    from torch import nn

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    net = MODELS[model]()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    x, y = torch.rand(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()

    return step


def _serve(conn, model: str, batch_size: int, lr: float) -> None:
    step = _make_step(model, batch_size, lr)
    conn.send("ready")
    while (steps := conn.recv()) is not None:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        conn.send((time.perf_counter() - start) / steps)


class TorchWorker:
    """A PyTorch train step (``model``: lenet | resnet18) in a child process: ``worker.time(steps)`` -> s/step."""

    def __init__(self, model: str, batch_size: int, lr: float = 0.2):
        ctx = mp.get_context("spawn")  # no fork of a process that runs XLA threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, model, batch_size, lr), daemon=True)
        self._proc.start()
        if self._conn.recv() != "ready":
            raise RuntimeError("the PyTorch worker did not start")

    def time(self, steps: int) -> float:
        self._conn.send(steps)
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(timeout=30)
