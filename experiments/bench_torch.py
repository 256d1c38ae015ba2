"""The d2l LeNet / ResNet-18 train step in PyTorch, timed in its own process for experiments.bench.

Its own process so that PyTorch's OpenMP threads and XLA's thread pools never
share an address space (the two runtimes' spinning worker threads slowed each
other down by up to 40% in one process). The parent writes ``steps`` to its
stdin and reads back seconds per step, so the blocks still interleave. The
child may be another Python (``python``): PyTorch's CPU build exists for fewer
Python versions than JAX supports, and its speed does not depend on which.

    python -m experiments.bench_torch MODEL BATCH_SIZE LR [MODE]    (driven by TorchWorker)

MODE: ``fp32`` or ``bf16`` train steps (bf16: ``torch.autocast`` around the
forward and loss, PyTorch's mixed precision on CPU), or ``int8`` / ``fp32-infer``
inference of the model in eval mode (int8: ``quantize_dynamic``, PyTorch's
dynamic quantisation, which covers its ``nn.Linear`` layers only: the
convolutions stay fp32).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def available(python: str | None = None) -> bool:
    """Can ``python`` (default: this one) import torch?"""
    if python is None:
        from importlib.util import find_spec

        return find_spec("torch") is not None
    try:
        return subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
    except OSError:  # no such interpreter
        return False


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


MODES = ("fp32", "bf16", "int8", "fp32-infer")


def _make_step(model: str, batch_size: int, lr: float, mode: str = "fp32"):
    import torch
    from torch import nn

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    net = MODELS[model]()
    x, y = torch.rand(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
    if mode in ("int8", "fp32-infer"):
        net.eval()
        if mode == "int8":
            import warnings

            with warnings.catch_warnings():  # torch.ao.quantization is deprecated (still there in 2.13)
                warnings.simplefilter("ignore")
                net = torch.ao.quantization.quantize_dynamic(net, {nn.Linear}, dtype=torch.qint8)

        def infer():
            with torch.no_grad():
                net(x)

        return infer
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()

    return step


def _serve(model: str, batch_size: int, lr: float, mode: str = "fp32") -> None:
    step = _make_step(model, batch_size, lr, mode)
    print("ready", flush=True)
    for line in sys.stdin:  # one block per line; EOF ends
        steps = int(line)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        print((time.perf_counter() - start) / steps, flush=True)


class TorchWorker:
    """A PyTorch train step or inference (``model``: lenet | resnet18; ``mode``: one of ``MODES``) in a child
    process: ``worker.time(steps)`` -> s/step."""

    def __init__(self, model: str, batch_size: int, lr: float = 0.2, python: str | None = None, mode: str = "fp32",
                 env: dict[str, str] | None = None):
        if model not in MODELS or mode not in MODES:  # said here, not as a child that never says "ready"
            raise ValueError(f"TorchWorker({model!r}, mode={mode!r}): models {', '.join(MODELS)}; "
                             f"modes {', '.join(MODES)}")
        self._proc = subprocess.Popen([python or sys.executable, "-m", "experiments.bench_torch", model,
                                       str(batch_size), str(lr), mode], cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the PyTorch worker did not start")

    def time(self, steps: int) -> float:
        self._proc.stdin.write(f"{steps}\n")
        self._proc.stdin.flush()
        return float(self._proc.stdout.readline())

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:5])
