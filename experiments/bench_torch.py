"""The d2l LeNet / ResNet-18 and the GPT's train step in PyTorch, timed in its own process for experiments.bench.

Its own process so that PyTorch's OpenMP threads and XLA's thread pools never
share an address space (the two runtimes' spinning worker threads slowed each
other down by up to 40% in one process). The parent writes ``steps`` to its
stdin and reads back seconds per step, so the blocks still interleave. The
child may be another Python (``python``): PyTorch's CPU build exists for fewer
Python versions than JAX supports, and its speed does not depend on which.

    python -m experiments.bench_torch MODEL BATCH_SIZE LR [MODE [SHAPE]]    (driven by TorchWorker)

MODE: ``fp32`` or ``bf16`` train steps (bf16: ``torch.autocast`` around the
forward and loss, PyTorch's mixed precision on CPU), or ``int8`` / ``fp32-infer``
inference of the model in eval mode (int8: ``quantize_dynamic``, PyTorch's
dynamic quantisation, which covers its ``nn.Linear`` layers only: the
convolutions stay fp32). SHAPE: the GPT's ``VOCAB,SEQ_LEN,LAYERS,HEADS,WIDTH`` (``gpt``: jaxtrain.models.gpt's
network in PyTorch, a batch of windows of SEQ_LEN + 1 random tokens, the mean next-token cross-entropy).
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


def gpt(vocab: int, seq_len: int, layers: int, heads: int, width: int, rotary: int = 0, vocab_multiple: int = 64):
    """jaxtrain.models.gpt's network in PyTorch (GPT-2's decoder, fp32): learned positions (``rotary``: each head's
    queries and keys turned by their position instead, as ``gpt.rotate`` turns them), pre-LayerNorm blocks
    (eps 1e-5) of causal ``scaled_dot_product_attention`` and a GELU (tanh) MLP of 4 x width, a final LayerNorm,
    logits from the tied token embedding, its rows padded to a multiple of ``vocab_multiple`` (the padded rows'
    logits cut). GPT-2's initialisation: N(0, 0.02), the residual projections' std / sqrt(2 layers), biases 0.
    ``net(tokens [B, T]) -> logits [B, T, vocab]``; ``load_jaxtrain`` takes jaxtrain's params."""
    import math

    import torch
    import torch.nn.functional as F
    from torch import nn

    padded = -(-vocab // vocab_multiple) * vocab_multiple
    half = width // heads // 2
    angle = torch.arange(seq_len, dtype=torch.float32)[:, None] * 10000.0 ** (
        -torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half))  # [T, C/2]
    cos, sin = angle.cos(), angle.sin()

    def turned(x):  # [B, H, T, C]: the pairs (x[i], x[i + C/2]) turned by position * 10000^(-2i/C)
        a, b = x[..., :half], x[..., half:]
        c, s = cos[:x.shape[2]], sin[:x.shape[2]]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width, eps=1e-5), nn.LayerNorm(width, eps=1e-5)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)  # qkv's out: (3, heads, C)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)  # [B, H, T, C]
            if rotary:
                q, k = turned(q), turned(k)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Parameter(torch.empty(padded, width))
            self.wpe = None if rotary else nn.Parameter(torch.empty(seq_len, width))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width, eps=1e-5)
            with torch.no_grad():
                for name, p in self.named_parameters():
                    if name.endswith("bias"):
                        p.zero_()
                    elif p.dim() > 1:  # the embeddings and the linear layers' weights
                        std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                        p.normal_(0.0, std)

        def forward(self, tokens):
            x = F.embedding(tokens, self.wte)
            x = x if rotary else x + self.wpe[:tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte)
            return logits if padded == vocab else logits[..., :vocab]

        def load_jaxtrain(self, params: dict) -> None:
            """Copy jaxtrain.models.gpt's params (``{"embed/wte": array, "stages/qkv": ..., "head/ln": ...}``,
            its nested dict flattened with "/") into this network."""
            def t(name, layer=None):
                a = torch.as_tensor(params[name], dtype=torch.float32)
                return a if layer is None else a[layer]

            with torch.no_grad():
                self.wte.copy_(t("embed/wte"))
                if not rotary:
                    self.wpe.copy_(t("embed/wpe"))
                self.ln_f.weight.copy_(t("head/ln"))
                self.ln_f.bias.copy_(t("head/ln_b"))
                for i, blk in enumerate(self.blocks):
                    for ln, name in ((blk.ln1, "ln1"), (blk.ln2, "ln2")):
                        ln.weight.copy_(t(f"stages/{name}", i))
                        ln.bias.copy_(t(f"stages/{name}_b", i))
                    # jaxtrain's [in, out] matrices (qkv [D, 3, H, C], proj [H, C, D]) -> nn.Linear's [out, in]
                    blk.qkv.weight.copy_(t("stages/qkv", i).reshape(width, 3 * width).T)
                    blk.qkv.bias.copy_(t("stages/qkv_b", i).reshape(3 * width))
                    blk.proj.weight.copy_(t("stages/proj", i).reshape(width, width).T)
                    blk.proj.bias.copy_(t("stages/proj_b", i))
                    blk.fc.weight.copy_(t("stages/fc", i).T)
                    blk.fc.bias.copy_(t("stages/fc_b", i))
                    blk.out.weight.copy_(t("stages/out", i).T)
                    blk.out.bias.copy_(t("stages/out_b", i))

    return GPT()


def next_token_loss(net, tokens):
    """The mean next-token cross-entropy of ``tokens`` [B, T + 1] (jaxtrain.models.gpt.make_loss_fn's loss)."""
    import torch.nn.functional as F

    logits = net(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


MODELS = {"lenet": _lenet, "resnet18": _resnet18, "gpt": gpt}
LANGUAGE_MODELS = ("gpt",)  # built from a SHAPE, trained on windows of tokens


MODES = ("fp32", "bf16", "int8", "fp32-infer")


def _make_step(model: str, batch_size: int, lr: float, mode: str = "fp32", shape: tuple[int, ...] = ()):
    """A call that runs one train step (and returns its loss) or one inference of ``model`` on a fixed batch."""
    import torch
    from torch import nn

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    net = MODELS[model](*shape)
    if model in LANGUAGE_MODELS:
        vocab, seq_len = shape[:2]
        x = torch.randint(0, vocab, (batch_size, seq_len + 1))
    else:
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
                net(x[:, :-1] if model in LANGUAGE_MODELS else x)

        return infer
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = next_token_loss(net, x) if model in LANGUAGE_MODELS else loss_fn(net(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _serve(model: str, batch_size: int, lr: float, mode: str = "fp32", shape: str = "") -> None:
    step = _make_step(model, batch_size, lr, mode, tuple(int(n) for n in shape.split(",") if n))
    print("ready", flush=True)
    for line in sys.stdin:  # one block per line; EOF ends
        steps = int(line)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        print((time.perf_counter() - start) / steps, flush=True)


class TorchWorker:
    """A PyTorch train step or inference (``model``: lenet | resnet18 | gpt; ``mode``: one of ``MODES``) in a child
    process: ``worker.time(steps)`` -> s/step. ``shape``: the GPT's (vocab, seq_len, layers, heads, width[,
    rotary])."""

    def __init__(self, model: str, batch_size: int, lr: float = 0.2, python: str | None = None, mode: str = "fp32",
                 env: dict[str, str] | None = None, shape: tuple[int, ...] = ()):
        if model not in MODELS or mode not in MODES or (model in LANGUAGE_MODELS) != (len(shape) in (5, 6)):
            # said here, not as a child that never says "ready"
            raise ValueError(f"TorchWorker({model!r}, mode={mode!r}, shape={shape!r}): models {', '.join(MODELS)} "
                             f"(a shape (vocab, seq_len, layers, heads, width[, rotary]) for "
                             f"{', '.join(LANGUAGE_MODELS)} "
                             f"only); modes {', '.join(MODES)}")
        self._proc = subprocess.Popen([python or sys.executable, "-m", "experiments.bench_torch", model,
                                       str(batch_size), str(lr), mode, ",".join(map(str, shape))], cwd=ROOT,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, **(env or {})})
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
    _serve(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:6])
