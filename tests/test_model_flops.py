"""Model FLOPs (jaxtrain.models.flops): counted from the layers' shapes, held to numbers worked out by hand and to
XLA's own count; MFU beside HFU in a run's summary, and remat raises the HFU alone."""

import json

import jax
import jax.numpy as jnp
import pytest
from conftest import needs_fashion_mnist, run_cli

from jaxtrain import models
from jaxtrain.models import flops


def test_lenet_by_hand():
    """Layer by layer (jaxtrain's LeNet: conv 3x3 to 20, pool, conv 5x5 to 50, pool, dense 800 -> 128 -> 10), each
    convolution 2 x outputs x (kernel taps x input channels), each dense layer 2 x inputs x outputs."""
    conv1 = 2 * (26 * 26 * 20) * (3 * 3 * 1)
    conv2 = 2 * (9 * 9 * 50) * (5 * 5 * 20)
    dense = 2 * 800 * 128 + 2 * 128 * 10
    assert flops.forward("lenet", (28, 28, 1), 10) == conv1 + conv2 + dense == 4_500_720


def test_resnet50_is_the_published_4_1_gmacs_and_agrees_with_xla():
    """torchvision's and the literature's ResNet-50 at 224x224: 4.1 G multiply-adds (8.2 GFLOP). XLA's count of the
    same forward (before optimisation) leaves out the taps that fall on padding and adds the elementwise work: a
    few percent apart."""
    mine = flops.forward("resnet50", (224, 224, 3), 1000)
    assert 8.1e9 < mine < 8.3e9, mine
    m = models.get("resnet50", input_shape=(224, 224, 3), num_classes=1000, conv="xla")
    params, state = jax.eval_shape(m.init, jax.random.key(0))
    cost = jax.jit(m.logits).lower(params, state, jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32)).cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"] / 2
    assert abs(xla / mine - 1) < 0.05, (xla, mine)


def test_a_scanned_layer_counts_once_per_iteration_and_a_cond_its_costlier_branch():
    """XLA's cost analysis counts a loop's body once (the ViT's scanned blocks: 1/depth of their FLOPs); here each
    iteration counts."""
    w = jnp.ones((16, 16))

    def body(x, _):
        return x @ w, None

    one = flops.count(jax.make_jaxpr(lambda x: x @ w)(jnp.ones((4, 16))))
    assert one == 2 * 4 * 16 * 16
    assert flops.count(jax.make_jaxpr(lambda x: jax.lax.scan(body, x, length=7)[0])(jnp.ones((4, 16)))) == 7 * one
    branches = jax.make_jaxpr(lambda p, x: jax.lax.cond(p, lambda x: x @ w @ w, lambda x: x, x))(
        True, jnp.ones((4, 16)))
    assert flops.count(branches) == 2 * one
    vit = flops.forward("vit", (28, 28, 1), 10)
    assert vit > 5 * flops.count(jax.make_jaxpr(lambda x: x @ w)(jnp.ones((1, 16))))  # many layers, counted each


def test_utilisation_is_model_flops_and_compiled_flops_over_the_peak():
    use = flops.utilisation(1e9, 4e12, examples=256, seconds=0.1, peak=1e14)
    assert use == pytest.approx({"mfu": 3 * 1e9 * 256 / 0.1 / 1e14, "hfu": 4e12 / 0.1 / 1e14})
    assert flops.utilisation(1e9, 4e12, 256, 0.1, None) == {"mfu": None, "hfu": None}


@needs_fashion_mnist
@pytest.mark.slow  # two runs end to end
def test_remat_full_raises_the_hfu_and_not_the_mfu(tmp_path):
    """The same ViT, recomputing its blocks in the backward pass (--remat full): the compiled program does more
    FLOPs per example than without, the model's FLOPs stay. Compared as FLOPs per example (HFU/MFU x 3 x the
    model's FLOPs), which the clock does not enter. (Not LeNet: XLA:CPU's optimiser drops the recomputation of
    its conv2, so the program it runs is within 2% of the remat-free one.)"""
    runs = {}
    for remat in ("none", "full"):
        out = run_cli("-m", "experiments.vit", "--devices", "1", "--max-steps", "3", "--remat", remat,
                      "--measure-peak", "--no-progress", "--out", str(tmp_path / remat))
        assert out.returncode == 0, out.stderr[-2000:]
        assert "MFU" in out.stdout and "HFU" in out.stdout, out.stdout[-500:]
        runs[remat] = s = json.loads((tmp_path / remat / "summary.json").read_text())
        assert s["model_flops_per_example"] == flops.forward("vit", (28, 28, 1), 10)
        assert s["mfu"] == pytest.approx(3 * s["model_flops_per_example"] * s["examples_per_sec"]
                                         / s["peak_flops_per_sec"], rel=1e-6)
    compiled = {k: s["hfu"] / s["mfu"] * 3 * s["model_flops_per_example"] for k, s in runs.items()}
    assert compiled["full"] > 1.1 * compiled["none"], compiled
    assert runs["full"]["model_flops_per_example"] == runs["none"]["model_flops_per_example"]


@pytest.mark.parametrize("name, shape, classes, size", [("gpt", (32,), 256, "tiny"), ("vit", (28, 28, 1), 10, None)])
def test_the_compiled_step_counts_every_trip_of_its_scan_over_the_blocks(name, shape, classes, size):
    """XLA's cost analysis counts a while loop's body once (a scan over 2 GPT or 8 ViT blocks: one block);
    ``diagnostics.program_flops`` adds the later trips' matmuls, so a step's FLOPs are at least the model's
    3 x forward and not far above them (elementwise work, the ViT's head)."""
    import optax

    import jaxtrain as jt
    from jaxtrain.analysis import diagnostics, hlo

    model = models.get(name, input_shape=shape, num_classes=classes, size=size, conv="xla")
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=1)
    state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
    compiled = trainer.lower(state, model.example_batch(8)).compile()
    text = compiled.as_text()
    once, every = hlo.matmul_flops(text, trips=False), hlo.matmul_flops(text)
    assert every > 1.5 * once  # the blocks are most of the model's matmuls
    want = flops.TRAIN_FACTOR * flops.forward(name, shape, classes, size) * 8
    assert want <= diagnostics.program_flops(compiled) <= 1.15 * want
