"""experiments.bench --model gpt (issue 67 item 6): jaxtrain's GPT step against the same GPT in PyTorch
(experiments/bench_torch.py's ``gpt``). The bench runs and reports tokens/s and its paired ratios; the PyTorch
network is jaxtrain's: with jaxtrain's initial weights it has its loss, and after one SGD step too."""

import json
import subprocess

import numpy as np
import pytest
from conftest import ROOT, run_cli

TINY = ["--model", "gpt", "--model-size", "tiny", "--batch-size", "8", "--repeats", "2", "--steps", "1"]


def bench(tmp_path, *flags):
    out = run_cli("-m", "experiments.bench", *TINY, "--json", str(tmp_path / "b.json"), *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| variant | ms/step | examples/s | tokens/s |" in out.stdout, out.stdout
    return out.stdout, json.loads((tmp_path / "b.json").read_text())


@pytest.mark.slow
def test_bench_gpt_reports_tokens_per_second_and_the_paired_ratios(tmp_path):
    stdout, got = bench(tmp_path, "--no-torch", "--unroll", "on")
    assert (got["model"], got["model_size"], got["seq_len"], got["vocab"]) == ("gpt", "tiny", 64, 256)
    assert got["unroll"] is True and "2 heads, unrolled; windows of 64 tokens" in stdout, stdout
    for variant in ("jaxtrain", "handwritten"):
        assert got[f"{variant}_tokens_per_s"] == pytest.approx(8 * 64 / (got[f"{variant}_ms"] / 1000))
    assert got["paired_jaxtrain_over_handwritten"] > 0 and got["paired_torch_over_jaxtrain"] is None
    assert got["model_flops_per_example"] > 0 and "epoch_wall_sec" not in got  # no Fashion-MNIST epoch for a GPT
    assert "jaxtrain/handwritten " in stdout and "torch/jaxtrain n/a" in stdout


@pytest.mark.slow
def test_bench_gpt_against_pytorch(tmp_path, torch_python):
    _, got = bench(tmp_path, "--torch-python", torch_python)
    assert got["torch_tokens_per_s"] > 0 and got["paired_torch_over_jaxtrain"] > 0


def test_a_language_models_flag_for_an_image_model_is_a_one_line_error(capsys):
    from experiments import bench

    assert bench.main(["--model", "lenet", "--seq-len", "64", "--vocab", "100", "--unroll", "on"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "bench: error: --seq-len, --vocab, --unroll: a language model's (gpt), not lenet's", err


# Run in the PyTorch venv: bench_torch's GPT with jaxtrain's weights (DIR/params.npz), its loss on DIR/tokens.npy
# before and after one SGD step (lr 0.2), and the losses of bench's own step (its own init and batch) over 6 steps.
TORCH_SIDE = """
import sys, json
import numpy as np, torch
from experiments import bench_torch
out, shape = sys.argv[1], tuple(map(int, sys.argv[2].split(",")))
net = bench_torch.gpt(*shape)
net.load_jaxtrain(dict(np.load(out + "/params.npz")))
tokens = torch.from_numpy(np.load(out + "/tokens.npy")).long()
opt = torch.optim.SGD(net.parameters(), lr=0.2)
loss = bench_torch.next_token_loss(net, tokens)
loss.backward()
opt.step()
after = bench_torch.next_token_loss(net, tokens)
step = bench_torch._make_step("gpt", 8, 0.2, "fp32", shape)
print(json.dumps({"loss": loss.item(), "after": after.item(), "steps": [step().item() for _ in range(6)]}))
"""


@pytest.mark.parametrize("rotary", [False, True], ids=["learned", "rotary"])
def test_the_pytorch_gpt_is_jaxtrains_gpt_and_its_step_trains(torch_python, tmp_path, rotary):
    """Learned positions, and rotary ones (PyTorch's turn written again in experiments/bench_torch.py)."""
    import jax

    from experiments import bench_variants
    from jaxtrain import models

    model = models.get("gpt", input_shape=(16,), num_classes=100, size="tiny", rotary=rotary)  # 100: padded to 128
    params, state = model.init(jax.random.key(0))
    batch = model.example_batch(4)
    np.savez(tmp_path / "params.npz", **{f"{a}/{b}": np.asarray(v) for a, d in params.items() for b, v in d.items()})
    np.save(tmp_path / "tokens.npy", batch["tokens"])

    def loss(p):
        return model.loss_fn(p, state, batch, None)[0]

    value, grads = jax.value_and_grad(loss)(params)
    after = loss(jax.tree.map(lambda p, g: p - 0.2 * g, params, grads))
    shape = bench_variants.torch_shape(model)
    assert shape == (100, 16, 2, 2, 64, *((1,) if rotary else ()))
    done = subprocess.run([torch_python, "-c", TORCH_SIDE, str(tmp_path), ",".join(map(str, shape))], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    torch_side = json.loads(done.stdout.strip().splitlines()[-1])
    assert torch_side["loss"] == pytest.approx(float(value), rel=1e-5)
    assert torch_side["after"] == pytest.approx(float(after), rel=1e-4)  # the same gradients
    assert float(after) < float(value)
    steps = torch_side["steps"]
    assert steps[0] == pytest.approx(np.log(100), rel=0.05) and steps[-1] < steps[0] - 0.05, steps
