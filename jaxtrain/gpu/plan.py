"""``plan(...)``: a run's train step compiled for N GPUs on this host, and what the GPUs would hold and execute.

    import jaxtrain.gpu as gpu
    p = gpu.plan(model="resnet18", precision="bf16", gpu="h100", gpus=8)
    print(p.format())            # memory and fit, largest batch, FLOPs, collectives, kernels, compile time

The settings are a run's (``RunConfig``: the same checks and one-line errors); the step is the one
``python -m experiments.<model>`` trains. Nothing is autotuned (no GPU to time on): memory and structure are
XLA's own, no figure here is a GPU time.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

from jaxtrain.gpu import analysis
from jaxtrain.gpu.targets import mesh_for, target

# JAX preallocates this fraction of a GPU's memory and never uses more (XLA_PYTHON_CLIENT_MEM_FRACTION).
JAX_MEMORY_FRACTION = 0.75
# The largest batch is searched to within this fraction (XLA's memory is not monotonic near a GPU's limit).
SEARCH_TOLERANCE = 0.02
SETTINGS = ("model", "batch_size", "dataset", "precision", "strategy", "param_sharding", "mesh", "accum_steps",
            "accum", "remat", "microbatches", "pipeline_schedule", "repeats", "kernels", "optimizer", "seed",
            "model_size", "seq_len", "tokenizer", "vocab_size", "rotary")  # the last five: a language model's


@dataclasses.dataclass
class GpuPlan:
    """One step compiled for ``gpus`` x ``hosts`` GPUs; every byte and FLOP figure is PER GPU."""

    gpu: str
    gpus: int
    hosts: int
    settings: dict  # the run's settings (RunConfig fields), the recipe's defaults filled in
    call_batch: int  # the global batch of one compiled call (a multisteps update takes accum_steps calls)
    per_gpu_batch: int  # examples of one call on one GPU (one data shard's, all its micro-batches)
    memory: dict  # bytes: params, optimizer_state, model_state, batch; arguments, outputs, aliased, temps, total
    budget_bytes: int
    memory_fraction: float
    flops: float | None  # per step, per GPU (XLA's cost analysis after SPMD partitioning, convolutions included)
    bytes_accessed: float | None  # per step, per GPU (XLA's cost analysis of the optimised program)
    collectives: list
    kernels: dict
    compile_seconds: float
    max_batch: int = 2**20  # where the search for the largest batch stops
    largest_batch: int | None = None  # the largest call batch (global) that fits the budget, found by compiling
    largest_batch_bytes: int | None = None
    search: list = dataclasses.field(default_factory=list)  # (call batch, bytes per GPU) of every compile
    estimate: dict | None = None  # the step time ESTIMATED from the program (jaxtrain.gpu.estimate: summary())

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.budget_bytes

    @property
    def donation_kept(self) -> bool:
        """The state's buffers are reused for the new state (aliased bytes cover the whole state)."""
        state = self.memory["params"] + self.memory["optimizer_state"] + self.memory["model_state"]
        return self.memory["aliased"] >= state

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "fits": self.fits, "donation_kept": self.donation_kept}

    def format(self) -> str:
        from jaxtrain.gpu.report import format_plan

        return format_plan(self)


def _state_bytes(state, batch) -> dict:
    from jaxtrain.parallel.sharding import device_bytes

    return {"params": device_bytes(state.params), "optimizer_state": device_bytes(state.opt_state),
            "model_state": device_bytes(state.model_state), "batch": device_bytes(batch),
            "other": device_bytes((state.step, state.rng, state.loss_scale))}


def plan(gpu: str = "h100", gpus: int = 8, hosts: int = 1, *, largest_batch: bool = True,
         memory_fraction: float = JAX_MEMORY_FRACTION, max_batch: int = 2**20, input_shape: tuple | None = None,
         num_classes: int | None = None, progress: Callable[[str], None] | None = None, **settings) -> GpuPlan:
    """Compile the step a run with ``settings`` (``RunConfig`` fields: ``model=``, ``batch_size=``,
    ``precision=``, ``strategy=``, ``param_sharding=``, ``mesh=``, ``accum_steps=``, ``remat=``, pipeline
    settings...) trains, for ``gpus`` x ``hosts`` GPUs of kind ``gpu``; ``largest_batch``: also search the
    largest call batch that fits ``memory_fraction`` of a GPU's memory (a few more compiles); ``input_shape``
    (H, W, C) and ``num_classes``: images other than the dataset's (ResNet-50 on ImageNet's 224x224x3, 1000)."""
    from jaxtrain.errors import ConfigError, named
    from jaxtrain.driver.sections import FIELDS

    check_settings(settings)
    if not 0 < memory_fraction <= 1:
        raise ConfigError(f"{named('memory_fraction', memory_fraction)}: expected a fraction in (0, 1]")
    say = progress or (lambda text: None)
    say(f"tracing the {settings.get('model', 'lenet')} step for {gpus * hosts} x {target(gpu).name}")
    s = lowered_step(gpu, gpus, hosts, input_shape, num_classes, **settings)
    c, t, model, trainer, call, state, batch = s.config, s.target, s.model, s.trainer, s.call, s.state, s.batch
    say(f"compiling the {c.model} step for {gpus * hosts} x {t.name} (call batch {call})")
    compiled, seconds, flops, bytes_accessed = analysis.compile_lowered(s.lowered)
    text = compiled.as_text()
    timing = s.estimate(text)
    budget = int(t.memory_bytes * memory_fraction)
    result = GpuPlan(
        gpu=t.key, gpus=gpus, hosts=hosts, settings={k: getattr(c, k) for k in SETTINGS if k in FIELDS},
        call_batch=call, per_gpu_batch=call // trainer.batch_plan.data_shards,
        memory={**_state_bytes(state, batch), **analysis.memory(compiled)}, budget_bytes=budget,
        memory_fraction=memory_fraction, flops=flops, bytes_accessed=bytes_accessed,
        collectives=analysis.collectives(text), kernels=analysis.kernels(text), compile_seconds=seconds,
        max_batch=max_batch, estimate=timing)
    if largest_batch:
        from jaxtrain.analysis.batch_size import find_batch_size

        def compiled_one(batch_size, need):
            say(f"  batch {batch_size:,}: {need / 2**30:,.2f} GiB per GPU "
                f"({'fits' if need <= budget else 'does not fit'} {budget / 2**30:,.1f} GiB)")

        def measure(batch_size):  # memory only: the autotuner off halves the compile, the same bytes (docs/gpu.md)
            lowered = trainer.lower(state, model.batch_shapes(batch_size))
            return analysis.memory(lowered.compile(compiler_options=analysis.AUTOTUNER_OFF))["total"]

        try:
            found = find_batch_size(trainer, state, model.batch_shapes, budget, max_batch=max_batch,
                                    progress=compiled_one, start=call, known={call: result.memory["total"]},
                                    tolerance=SEARCH_TOLERANCE, measure=measure)
        except ConfigError:  # not even the smallest batch fits: the report says DOES NOT FIT
            found = None
        if found is not None:
            result.largest_batch, result.largest_batch_bytes = found.batch_size, found.predicted_bytes
            result.search = found.table
    return result


@dataclasses.dataclass(frozen=True)
class LoweredStep:
    """A run's step lowered for compile-only GPUs (``lowered_step``): its config, target, model, trainer, call
    batch, abstract state and batch, and the lowered program."""

    config: object
    target: object
    gpus: int
    hosts: int
    shape: dict
    model: object
    trainer: object
    call: int
    state: object
    batch: object
    lowered: object

    def estimate(self, text: str) -> dict:
        """``Estimate.summary()`` of this step compiled to ``text`` (its optimised HLO)."""
        from jaxtrain.gpu.estimate import estimate
        from jaxtrain.models.flops import forward

        c, shape = self.config, self.shape
        model_flops = forward(c.model, shape["input_shape"], shape["num_classes"], c.model_size)  # the MFU's
        return estimate(text, self.target, self.gpus, self.hosts, self.call, model_flops).summary()


def lowered_step(gpu: str = "h100", gpus: int = 8, hosts: int = 1, input_shape: tuple | None = None,
                 num_classes: int | None = None, **settings) -> LoweredStep:
    """The step a run with ``settings`` (``plan``'s) trains, lowered for ``gpus`` x ``hosts`` GPUs of kind ``gpu``
    (nothing compiled)."""
    import jax

    from jaxtrain.driver.config import RunConfig

    check_settings(settings)
    t = target(gpu)
    c = RunConfig(devices=gpus * hosts, **settings)
    shape, model, trainer, call = run_step(c, mesh_for(t, gpus, hosts, c.mesh), input_shape, num_classes)
    state = trainer.abstract_state(init_fn=model.init, rng=jax.random.key(c.seed))
    batch = trainer.batch_plan.lowered(model.batch_shapes(call))
    return LoweredStep(c, t, gpus, hosts, shape, model, trainer, call, state, batch, trainer.lower(state, batch))


def check_settings(settings: dict) -> None:
    """A ConfigError naming the settings ``plan`` does not take."""
    from jaxtrain.errors import ConfigError

    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"plan() takes the settings {', '.join(SETTINGS)}; not {', '.join(unknown)}")


def estimated(folder=None, **where) -> tuple[dict, bool]:
    """``(Estimate.summary(), whether its program was read from folder)`` of the step ``lowered_step(**where)``
    lowers, compiled or read from ``folder`` (``analysis.compiled_text``): the estimate alone, no memory or
    FLOPs (``plan``'s)."""
    s = lowered_step(**where)
    text, kept = analysis.compiled_text(s.lowered, s.target, folder, f"{s.gpus} GPUs x {s.hosts} hosts")
    return s.estimate(text), kept


def run_step(c, mesh, input_shape: tuple | None = None, num_classes: int | None = None) -> tuple:
    """``(shape, model, trainer, call batch)``: the step a run ``c`` trains over ``mesh`` (nothing compiled), for
    images of ``input_shape`` and ``num_classes`` (default: the dataset's; a language model's ``num_classes``: its
    vocabulary); ``gpu.plan``'s and ``gpu.measure``'s."""
    from jaxtrain.data import datasets
    from jaxtrain.driver import assemble

    shape = datasets.known_shape(c.data)  # a language model's: windows of seq_len tokens, its vocabulary
    shape = {"input_shape": tuple(input_shape or shape["input_shape"]),
             "num_classes": num_classes or shape["num_classes"]}
    model = assemble.model(c.network, c.compute, shape, devices=tuple(mesh.devices.flat))
    trainer = assemble.steps(c.network, c.optim, c.parallel, mesh, model, updates=0)[0]
    return shape, model, trainer, trainer.batch_plan.call_batch(c.batch_size)


def save(p: GpuPlan, path: str) -> None:
    with open(path, "w") as f:
        json.dump(p.to_json(), f, indent=1)
