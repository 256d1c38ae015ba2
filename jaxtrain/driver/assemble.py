"""What a run trains, made from its config's sections: the model (``network``, ``compute``), the optimizer
(``optim``), the train and eval steps (``parallel``).

``jaxtrain.driver.build`` makes each once: the model for the shape the dataset is known to have (before the
data is read), the steps for the data read (the learning rate scheduled over its updates).
"""

from __future__ import annotations

import jax

from jaxtrain import models
from jaxtrain.choices import lr_groups
from jaxtrain.core import optim
from jaxtrain.errors import ConfigError, named
from jaxtrain.parallel import rules
from jaxtrain.driver import distill
from jaxtrain.driver.sections import Compute, Network, Optim, Parallel
from jaxtrain.train.pipeline import STAGE_AXIS, make_pipeline_step
from jaxtrain.train.trainer import Evaluator, Trainer, make_eval_step, make_train_step


def model(net: Network, compute: Compute, shape: dict, teacher: tuple | None = None, devices: tuple = ()
          ) -> models.Model:
    """The registry model for images (or text's windows) of ``shape``; with ``teacher`` ((model, params,
    model_state) of a finished run) a student that distils from it; ``devices``: the run's (a language model takes
    cuDNN's attention where they run it, and lays its blocks out where that is faster for so many of them)."""
    device = devices[0] if devices else None
    unroll = (models.registry.unrolled_where_faster(device, len(devices))
              if devices and net.model in models.LANGUAGE_MODELS else None)
    m = models.get(net.model, remat=net.remat, init=net.init, quantize=net.quantize, kernels=compute.kernels,
                   conv=compute.conv, size=net.model_size, device=device, unroll=unroll, rotary=net.rotary, **shape)
    if teacher is not None:  # the teacher's params and state join the model state, Frozen
        m = distill.distilled(m, *teacher, net.temperature, net.alpha, compute.kernels)
    if net.linear_probe:  # the model in evaluation mode under the loss; frozen() leaves only its classifier to train
        from jaxtrain.models import classify

        m = classify.linear_probe(m, classify.loss_head(compute.kernels))
    return m


def frozen(net: Network, opt: Optim, m: models.Model) -> str | None:
    """The regex of the parameters that never train: ``freeze=``'s, or a linear probe's all-but-the-classifier."""
    if net.linear_probe and not m.classifier:
        raise ConfigError(f"{named('linear_probe')}: model {m.name} names no classifier to train alone")
    return f"^(?!{m.classifier})" if net.linear_probe else opt.freeze


def steps(net: Network, opt: Optim, par: Parallel, mesh, m: models.Model, updates: int
          ) -> tuple[Trainer, Evaluator]:
    """The train and eval steps (nothing compiles yet), the learning rate scheduled over ``updates`` (0: a
    constant one); a "stage" axis in the mesh pipelines the model."""
    tx = optim.make_optimizer(opt.optimizer, opt.lr, schedule=opt.schedule if updates else "constant",
                              total_steps=updates, warmup_steps=round(opt.warmup_epochs * updates / opt.epochs),
                              weight_decay=opt.weight_decay, clip_grad_norm=opt.clip_grad_norm,
                              freeze=frozen(net, opt, m), lr_groups=lr_groups(opt.lr_groups))
    if STAGE_AXIS not in mesh.axis_names:
        param_rules = rules.ParamSharding.of(par.param_sharding, logical_axes=m.logical_axes)
        trainer = make_train_step(m.loss_fn, tx, mesh=mesh, strategy=par.strategy, precision=par.precision,
                                  accum_steps=par.accum_steps, accum=par.accum, param_sharding=param_rules)
        return trainer, make_eval_step(m.eval_fn, trainer=trainer)
    if not isinstance(m, models.Pipelinable):
        raise ConfigError(f"a mesh with a {STAGE_AXIS!r} axis: model {net.model} has no stack of identical layers to "
                          "pipeline: use experiments.vit, or a mesh without a 'stage' axis")
    if (par.strategy, par.param_sharding, par.accum_steps) != ("jit", "replicated", 1):
        raise ConfigError(f"pipelined runs use {named('strategy', 'jit')}, {named('param_sharding', 'replicated')} "
                          f"and {named('accum_steps', 1)} (micro-batches are the pipeline's: {named('microbatches')})")
    stack = m.stack
    trainer = make_pipeline_step(stack.embed_fn, stack.stage_fn, stack.head_loss_fn, tx, mesh=mesh,
                                 microbatches=par.microbatches, schedule=par.pipeline_schedule,
                                 repeats=par.repeats, precision=par.precision, remat=net.remat,
                                 head_reads_embed=stack.head_reads_embed)
    return trainer, make_eval_step(trainer.eval_fn(stack.head_eval_fn), mesh=mesh)


def placed(opt: Optim, m: models.Model, trainer: Trainer, say: bool = True) -> tuple[dict, int]:
    """(where each parameter goes, a call's global batch): a ConfigError if the sharding or the batch size does
    not fit. ``say``: its warnings (``Trainer.plan``); not for steps made only to check the settings."""
    layout = trainer.layout(jax.eval_shape(m.init, jax.random.key(opt.seed))[0], say)
    return layout, trainer.batch_plan.call_batch(opt.batch_size)  # multisteps: one call per micro-batch
