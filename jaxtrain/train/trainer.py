"""make_train_step / make_eval_step: the step of ``step.py``, compiled for a mesh, its state placed by a ``Plan``."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.core import accumulate, precision as prec, step as step_lib
from jaxtrain.core.state import TrainState
from jaxtrain.core.step import EvalFn, LossFn
from jaxtrain.errors import ConfigError
from jaxtrain.parallel import call_checks, rules, sharding, strategies
from jaxtrain.parallel.devices import make_mesh, typed
from jaxtrain.parallel.placement import Plan

log = logging.getLogger(__name__)


class Trainer:
    """A compiled train step: ``state, metrics = trainer(state, batch)``; the state placed by ``param_sharding``.

    ``trainer.batch_plan``: the plan's batch half (known now); ``trainer.plan(state)``: the whole plan for a state
    (arrays or shapes), made once per state structure."""

    pipeline_layout: dict | None = None  # how a pipelined trainer stores its layers (checkpoints must match)

    def __init__(self, loss_fn: LossFn, tx: optax.GradientTransformation, mesh: Mesh, strategy: str,
                 precision: str | prec.Precision = "fp32", accum_steps: int = 1, accum: str = "scan",
                 param_sharding="replicated", min_size: int = rules.MIN_SIZE, micro_batches: int | None = None,
                 model_axes: str = "auto"):
        strategies.check_strategy(strategy, model_axes)
        mesh = typed(mesh, explicit=strategy == "explicit")
        self.accum = accumulate.check(accum_steps, accum)
        self.policy = prec.get_policy(precision)
        self.loss_fn = loss_fn
        self.mesh, self.strategy, self.accum_steps, self.model_axes = mesh, strategy, accum_steps, model_axes
        self.param_sharding = rules.ParamSharding.of(param_sharding, min_size)  # malformed: an error now
        self.tx = accumulate.wrap_optimizer(tx, accum_steps, self.accum)
        self.scan_steps = accumulate.scan_steps(accum_steps, self.accum)
        calls = accum_steps // self.scan_steps
        self.batch_plan = Plan(mesh, micro_batches or self.scan_steps, calls)
        self.steps_plan = self.batch_plan.with_steps_axis()  # batches of K steps per call (``steps``)
        self._plans, self._steps = {}, {}  # state tree structure -> Plan; (structure, K, unroll) -> compiled
        self._last_batch = {}  # steps_axis -> the signature of the last batch a checked call ran (untraceable)
        self._labels = call_checks.PendingLabels()  # each call's labels, checked as check_labels says
        self._axes_said = False  # the warning about mesh axes nothing uses: once

    @property
    def num_devices(self) -> int:
        return self.batch_plan.num_devices

    def check_batch_size(self, size: int) -> None:
        self.batch_plan.check_batch_size(size)

    def shard(self, batch: Mapping) -> dict:
        """A global batch (numpy or jax arrays), checked and placed on the mesh."""
        return self.batch_plan.shard(batch)

    def plan(self, state, say: bool = True) -> Plan:
        """Where ``state`` (arrays or shapes) lives and the strategy that runs it; a ConfigError, before anything
        compiles, if a rule does not fit these parameters or the strategy cannot run the sharding. ``say``: warn
        of a mesh axis nothing uses (once; not for a step made only to check the settings)."""
        key = jax.tree.structure(state)
        if key not in self._plans:
            self._plans[key] = self.batch_plan.for_state(state, strategy=self.strategy, tx=self.tx,
                                                         param_sharding=self.param_sharding, model_axes=self.model_axes)
            if say:
                self._say_idle_axes(self._plans[key])
        return self._plans[key]

    def _say_idle_axes(self, plan: Plan) -> None:
        """One warning line, once, for a mesh axis of 2+ devices that splits neither the batch nor any state
        array: its devices compute the same thing (a model traced with ``model_axes="explicit"`` may shard over
        it itself: no warning then)."""
        idle = plan.idle_axes()
        if idle and not self._axes_said and self.model_axes != "explicit" and jax.process_index() == 0:
            self._axes_said = True
            axis, size = idle[0], self.mesh.shape[idle[0]]
            log.warning(f"mesh axis {axis!r} ({size} devices) is used by no parameter rule: those devices compute "
                        f"the same thing; give them to 'data' (mesh data=N) or use a param_sharding that splits over "
                        f"{axis!r}")

    def layout(self, params, say: bool = True) -> dict:
        """Where each parameter goes (``params``: arrays or shapes):
        ``{"sharded": {name: spec}, "replicated": [...]}``; ``say``: as ``plan``'s."""
        return self.plan(jax.eval_shape(self._fresh, params, None, jax.random.key(0)), say).describe()

    def _fresh(self, params, model_state, rng) -> TrainState:
        params = prec.cast_floats(params, self.policy.param_dtype)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                          model_state={} if model_state is None else model_state, rng=rng,
                          loss_scale=prec.init_loss_scale(self.policy))

    def _maker(self, params, model_state, init_fn):
        """``rng -> TrainState`` for ``init`` / ``abstract_state`` (a pipeline stores its layers its own way)."""
        if (params is None) == (init_fn is None):
            raise ConfigError("trainer.init and abstract_state take params (and model_state) or init_fn=f with "
                              "f(rng) -> (params, model_state): one of the two")
        if init_fn is not None:
            return lambda r: self._fresh(*init_fn(r), r)
        return lambda r: self._fresh(params, model_state, r)

    def init(self, params=None, model_state=None, rng: jax.Array | None = None, *, init_fn=None) -> TrainState:
        """A TrainState on the mesh (fp32 params, fresh optimizer state), each leaf with its sharding.

        ``init_fn(rng) -> (params, model_state)`` instead of ``params``: run
        compiled with the state's shardings, so the whole state never exists
        on one device (``init(init_fn=f, rng=k)`` equals ``init(*jax.jit(f)(k), rng=k)``).
        """
        make = self._maker(params, model_state, init_fn)
        rng = jax.random.key(0) if rng is None else rng
        plan = self.plan(jax.eval_shape(make, rng))
        if init_fn is None:
            return sharding.place(make(rng), plan.state)
        return jax.jit(make, out_shardings=plan.state)(sharding.place(rng, plan.replicated))

    def abstract_state(self, params=None, model_state=None, rng: jax.Array | None = None, *,
                       init_fn=None) -> TrainState:
        """The TrainState ``init`` would make, as ``jax.ShapeDtypeStruct``s carrying their shardings: nothing is
        computed or placed (``params`` may be shapes; ``init_fn`` is only traced). ``trainer.lower(state,
        batch_shapes).compile()`` then compiles for the mesh's devices, e.g. the compile-only GPUs of
        ``jaxtrain.gpu.mesh_for``."""

        def make(p, m, r):  # shapes are arguments: never closed over
            return self._maker(p, m, init_fn)(r)

        shapes = jax.eval_shape(make, params, model_state, jax.random.key(0) if rng is None else rng)
        return sharding.abstract(shapes, self.plan(shapes).state)

    def _compiled(self, state, steps: int | None = None, unroll: bool | None = False) -> strategies.Compiled:
        """The step for this state's structure; ``steps=K``: K of them in one program (``step.scanned``)."""
        key = (jax.tree.structure(state), steps, unroll)
        if key not in self._steps:
            call_checks.structure(state, lambda: jax.eval_shape(self._fresh, state.params, state.model_state,
                                                                state.rng))
            plan = self.plan(state)
            reduction = plan.strategy.reduction(plan.specs, per_device=self.scan_steps > 1)
            step = step_lib.make_step(self.loss_fn, self.tx, self.policy, self.scan_steps, reduction)
            if steps is not None:
                step, plan = step_lib.scanned(plan.strategy.carried(step, plan), unroll), plan.with_steps_axis()
            self._steps[key] = plan.strategy.compile(step, plan)
        return self._steps[key]

    def __call__(self, state: TrainState, batch: Mapping) -> tuple[TrainState, dict]:
        """One step on a global batch (numpy or jax arrays): the state (its tree, its placement) and the batch
        checked and the batch sharded first; a step that cannot be traced for the batch is one line naming its
        arrays; labels outside the classes are checked as ``check_labels`` says (``jaxtrain.parallel.call_checks``)."""
        return self._checked(state, batch, self.batch_plan)

    def steps(self, state: TrainState, batches: Mapping, *, unroll: bool | None = False) -> tuple[TrainState, dict]:
        """K steps in one compiled call: ``batches`` holds K global batches, every array stacked on a leading
        axis of K (``[K, batch, ...]``, numpy or jax arrays); returns the state after the K steps and each
        metric stacked ``[K]``, step by step. Checked and placed as ``trainer(state, batch)`` (the examples
        sharded over "data", the K axis not); one program in flight for K steps (XLA:CPU's all-reduce can
        deadlock with many calls sent without waiting). Compiled once per state structure, K and ``unroll``.

        The K steps equal K calls of ``trainer(state, batch)``, bit for bit where XLA compiles the loop's body
        as it compiles one step (LeNet with oneDNN's fp32 convolutions); XLA's convolutions (bf16, fp16,
        ``conv="xla"``) sum in another order inside a loop: ``unroll=True`` lays the K steps out straight, bit
        for bit again, its compile time growing with K. ``unroll=None``: laid out straight where compiled
        for a CPU, a loop elsewhere; ``False`` (default): a loop everywhere, as the runs call it (laid out
        straight, the ring strategy's sums would round another way than its single steps'). Other fusions may
        round an ulp apart, looped or unrolled (``step.scanned``; docs/train-step.md, "Many steps per call")."""
        return self._checked(state, batches, self.steps_plan, unroll)

    def _checked(self, state, batch, batch_plan: Plan, unroll: bool | None = False) -> tuple[TrainState, dict]:
        """``__call__`` (``batch_plan``: the trainer's) or ``steps`` (``steps_plan``), with every check."""
        call_checks.not_donated(state)
        steps = batch_plan.steps_of(batch) if batch_plan.steps_axis else None
        compiled = self._compiled(state, steps, unroll)
        self.plan(state).check_placed(state)
        batch = batch_plan.shard(batch)
        self._labels.read()
        try:
            out = compiled(state, batch)
        except call_checks.TRACE_ERRORS as e:
            if isinstance(e, (ConfigError, jax.errors.JAXTypeError)):  # already said, or about the code
                raise
            raise call_checks.untraceable(e, batch, self._last_batch.get(batch_plan.steps_axis)) from e
        self._last_batch[batch_plan.steps_axis] = call_checks.signature(batch)
        return self._labels.held(out, state, batch)

    def step(self, state: TrainState, batch: Mapping) -> tuple[TrainState, dict]:
        """One step on a batch ALREADY on the mesh (what ``prefetch_to_device`` yields).

        No checks and no copies but the labels' (``check_labels``: a poll per call, a wait on the first step
        only): the hot-loop entry. Under ``jax.transfer_guard("disallow")`` a host array here is an error.
        """
        compiled = self._compiled(state)
        self._labels.read()
        return self._labels.held(compiled(state, batch), state, batch)

    def placed_steps(self, state: TrainState, batches: Mapping, *,
                     unroll: bool | None = False) -> tuple[TrainState, dict]:
        """``steps`` on batches ALREADY on the mesh (``shard_steps``), without its checks and copies (but the
        labels'): the hot-loop entry for K steps per call, as ``step`` is for one."""
        compiled = self._compiled(state, self.steps_plan.steps_of(batches), unroll)
        self._labels.read()
        return self._labels.held(compiled(state, batches), state, batches)

    def shard_steps(self, batches: Mapping) -> dict:
        """K global batches stacked ``[K, batch, ...]`` (numpy or jax arrays), checked and placed on the mesh:
        the examples sharded over "data", the K axis not (what ``placed_steps`` takes)."""
        return self.steps_plan.shard(batches)

    def check_labels(self) -> None:
        """Wait for every call whose labels were not checked yet and check them, in order: a ConfigError for the
        first whose batch had labels outside the model's classes (the share a loss reports as the metric
        ``labels_out_of_range``; a loss without it is not checked).

        Each call (``trainer(state, batch)`` and ``trainer.step``) checks, before its step takes its state: the
        labels of every earlier call whose step is done (never waiting for one), and those of the call before
        the previous one in any case (at most one step in flight: its step is all but done). So a bad batch
        raises at most two calls later, the state given to the raising call still usable; the first call checks
        its own batch when its step is done (the first step waits once). The last calls of a loop have no later
        call: call this after a loop of your own (``loop.fit`` does at each epoch's end)."""
        self._labels.read(wait=True)

    def lower(self, state: TrainState, batch: Mapping, platforms: tuple[str, ...] | None = None):
        """The lowered (not yet compiled) step; ``.compile()`` it.

        ``state`` and ``batch``: arrays, or shapes (``abstract_state``; ``jax.ShapeDtypeStruct`` per batch
        array, the GLOBAL batch): a mesh of compile-only devices needs shapes. ``platforms``: lower for these
        instead of the mesh's devices, e.g. ``("cuda",)`` to see on a CPU host what a GPU would compile.
        """
        return self._compiled(state).lower(state, self.batch_plan.lowered(batch), platforms)

    def lower_steps(self, state: TrainState, batches: Mapping, platforms: tuple[str, ...] | None = None, *,
                    unroll: bool | None = False):
        """The lowered K-step call of ``steps``, as ``lower`` (arrays or shapes, ``[K, batch, ...]``)."""
        steps = self.steps_plan.steps_of(batches)
        return self._compiled(state, steps, unroll).lower(state, self.steps_plan.lowered(batches), platforms)


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    mesh: Mesh | int | None = None,
    strategy: str = "jit",
    precision: str | prec.Precision = "fp32",
    accum_steps: int = 1,
    accum: str | accumulate.Accum = "scan",
    param_sharding="replicated",
    min_size: int = rules.MIN_SIZE,
    model_axes: str = "auto",
) -> Trainer:
    """Build a (data-parallel, optionally sharded-state) train step.

    ``loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))``
    computes the mean loss over the examples it is given; ``metrics`` are
    scalar means. The trainer takes the GLOBAL batch (numpy or jax arrays);
    ``metrics["loss"]`` is the mean over the global batch.

    ``precision``: "fp32" | "bf16" | "fp16" (dynamic loss scale) or a
    ``jt.Precision``. ``accum_steps=k`` with ``accum="scan"``: each call splits
    every device's share into k micro-batches, one update per call;
    ``accum="multisteps"``: ``optax.MultiSteps``, one micro-batch per call and
    an update every k calls.

    ``param_sharding``: "replicated" (data parallelism), "fsdp" (every
    parameter of at least ``min_size`` elements, and its optimizer state,
    sharded over "data" along its largest dimension that divides: ZeRO-3),
    "zero1" (parameters replicated, their optimizer state sharded as fsdp's:
    gradients are reduce-scattered, the update runs on each device's shard and
    the new parameters are all-gathered: ZeRO-1/2), or rules
    ``[(regex, PartitionSpec | "fsdp" | jt.FSDP(spec) | "replicated"), ...]``
    on the "/"-joined parameter path (first match wins; unmatched =
    replicated): tensor parallelism and FSDP x TP on a 2-D mesh (``jit``, ``explicit``).

    ``strategy="explicit"`` types the mesh's axes Explicit and runs the step under ``jax.set_mesh``;
    ``model_axes``: how the loss_fn is traced there: ``"auto"`` (a model that knows no mesh, under
    ``jax.sharding.auto_axes``) or ``"explicit"`` (the typed arrays, for a model whose layers ``reshard``).
    """
    return Trainer(loss_fn, tx, make_mesh(mesh), strategy, precision, accum_steps, accum, param_sharding, min_size,
                   model_axes=model_axes)


def _specs_of(tree):
    """The PartitionSpec each leaf is placed with (P() for what is not on a named mesh)."""
    return jax.tree.map(lambda x: x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding) else P(),
                        tree)


class Evaluator:
    """A compiled eval step: ``sums = evaluator(state, batch)``.

    Returns the SUM of each per-example metric over the unmasked examples and
    ``count``, the number of them; divide to get means. A batch may carry a
    ``"mask"`` (1 = real example, 0 = padding) so that every example of a
    test set counts exactly once. With a ``trainer``, the state is placed
    as the trainer's plan says (its strategy runs the sums); without one, it
    may be sharded any way the strategy supports (its placement is read from
    the state).
    """

    def __init__(self, eval_fn: EvalFn, mesh: Mesh, strategy: str, model_axes: str = "auto",
                 trainer: Trainer | None = None):
        strategies.check_strategy(strategy, model_axes)
        self.mesh, self.strategy, self.model_axes = typed(mesh, explicit=strategy == "explicit"), strategy, model_axes
        self.trainer = trainer
        self.batch_plan = Plan(self.mesh)
        self._sums = step_lib.eval_sums(eval_fn)
        self._steps = {}  # (tree structure, param specs) -> compiled

    def _compiled(self, state):
        if self.trainer is not None:  # the trainer's plan: one placement for both steps
            plan = self.trainer.plan(state)
            key = jax.tree.structure(state)
            if key not in self._steps:
                self._steps[key] = plan.strategy.evaluate(self._sums, self.batch_plan, plan.specs.model_state)
            return self._steps[key]
        pspecs, mspecs = _specs_of(state.params), _specs_of(state.model_state)
        key = (jax.tree.structure(state), tuple(jax.tree.leaves((pspecs, mspecs), is_leaf=sharding.is_spec)))
        if key not in self._steps:
            strategy = strategies.make_strategy(self.strategy, self.mesh, pspecs, model_axes=self.model_axes)
            self._steps[key] = strategy.evaluate(self._sums, self.batch_plan, mspecs)
        return self._steps[key]

    def __call__(self, state: TrainState, batch: Mapping) -> dict:
        call_checks.not_donated(state)
        return self._compiled(state)(state, self.batch_plan.shard(batch))

    def step(self, state: TrainState, batch: Mapping) -> dict:
        """The eval step on a batch already on the mesh (no checks, no copies)."""
        return self._compiled(state)(state, batch)

    def lower(self, state: TrainState, batch: Mapping, platforms: tuple[str, ...] | None = None):
        """The lowered eval step, as ``Trainer.lower`` (arrays or shapes)."""
        return self._compiled(state).lower(state, self.batch_plan.lowered(batch), platforms)


def make_eval_step(eval_fn: EvalFn, *, mesh: Mesh | int | None = None, strategy: str = "jit",
                   model_axes: str = "auto", trainer: Trainer | None = None) -> Evaluator:
    """Build an eval step from ``eval_fn(params, model_state, batch) -> {name: [B] values}`` (``model_axes``: as
    ``make_train_step``'s). ``trainer``: evaluate its states as its plan places them (its mesh and strategy)."""
    if trainer is not None:
        return Evaluator(eval_fn, trainer.mesh, trainer.strategy, trainer.model_axes, trainer)
    return Evaluator(eval_fn, make_mesh(mesh), strategy, model_axes)
