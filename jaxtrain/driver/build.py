"""``build(config) -> Run``: a run made ready, once, before its first step.

    devices, mesh -> the model, checked (on the shape the dataset is known to have) -> checkpoints opened
    -> the data -> the steps for it -> Run

What can fail fails before the data is read (which may take minutes: a conversion, a large folder's index):
the model is made for the shape the dataset is known to have, its weights and groups checked with
``jax.eval_shape``, and the steps' settings (the batch's split, where the state goes, a pipeline's layers) are
checked on it. The Run's steps are made after the data, since the learning rate is scheduled over the run's
updates (the data's size); a local dataset's model is the one made before, a folder's or a TFDS dataset's is
made again once their classes and images are known. ``runner`` trains the Run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import jax

from jaxtrain import models, pretrained
from jaxtrain.core import optim, remat
from jaxtrain.choices import lr_groups
from jaxtrain.data import datasets, loader
from jaxtrain.data.tokenizer import Tokenizer
from jaxtrain.errors import ConfigError, named
from jaxtrain.io.files import params_digest
from jaxtrain.parallel import devices as devices_lib
from jaxtrain.parallel import hosts
from jaxtrain.parallel import preflight
from jaxtrain.settings import program
from jaxtrain.driver import assemble, distill, outputs
from jaxtrain.driver.config import FIXED_SETTINGS, FREE_SETTINGS, OPTIONAL_SETTINGS, RunConfig
from jaxtrain.driver.sections import Checkpoints
from jaxtrain.train.checkpoint import Checkpointer
from jaxtrain.train.trainer import Evaluator, Trainer

log = logging.getLogger(__name__)


def say(text: str) -> None:
    """A line of the run's progress, logged by process 0 (every process trains; one speaks)."""
    if jax.process_index() == 0:
        log.info(text)


def warn(text: str) -> None:
    """A warning about the run as a whole (not this process's own), logged by process 0."""
    if jax.process_index() == 0:
        log.warning(text)


@dataclasses.dataclass(frozen=True)
class Run:
    """A run ready to train, made once from its config by ``build``: nothing in it changes as it trains."""

    config: RunConfig
    devices: tuple[jax.Device, ...]
    mesh: jax.sharding.Mesh
    model: models.Model
    trainer: Trainer  # a PipelineTrainer where the mesh has a "stage" axis
    evaluator: Evaluator
    layout: dict  # where each parameter lives (trainer.layout)
    call_batch: int  # one call's global batch (multisteps: a micro-batch)
    data: dict  # "train", "test": the splits, classes and subsets applied
    loaders: dict  # "train", "test": their batches (``jaxtrain.data.loader``; workers start when read)
    settings: dict  # what its checkpoints and model.json record, and a resume compares (``run_settings``)
    checkpointer: Checkpointer | None
    tokenizer: Tokenizer | None = None  # a language model's (dataset=text:PATH): its tokens' text


def build(config: RunConfig, on_devices: Callable | None = None) -> Run:
    """The run ``config`` describes, made once; ``on_devices(devices)``: called as soon as the devices are up
    (the command's signal handling joins them before the data is read)."""
    c = config
    par, cluster = c.parallel, c.cluster
    devices = devices_lib.setup_devices(par.devices, devices_per_process=cluster.devices_per_process,
                                        coordinator=cluster.coordinator, num_processes=cluster.num_processes,
                                        process_id=cluster.process_id)  # first: nothing has started JAX's backend
    if note := remat.offload_note(c.remat, devices[0].platform):  # a bad name fails here, before the data is read
        say(note)
    if jax.process_count() > 1:
        say(preflight.run(devices))
    mesh = devices_lib.make_mesh(devices, axes=par.mesh)
    if on_devices is not None:
        on_devices(devices)
    teacher = distill.teacher_from_run(c.teacher) if c.teacher else None
    shape = datasets.known_shape(c.data, teacher[0].num_classes if teacher else None)
    model = assemble.model(c.network, c.compute, shape, teacher, devices)
    check_model(c, model)
    checked = assemble.steps(c.network, c.optim, c.parallel, mesh, model, updates=0)[0]  # nothing compiled
    assemble.placed(c.optim, model, checked, say=False)  # the steps' settings (warned of by the run's own steps)
    checkpointer = open_checkpoints(c.checkpoint)
    try:
        return _for_data(c, devices, mesh, teacher, shape, model, checkpointer)
    except BaseException:
        if checkpointer is not None:  # its lock: a run built again in this process may open it
            checkpointer.close()
        raise


def _for_data(c: RunConfig, devices, mesh, teacher, shape: dict, model, checkpointer) -> Run:
    """``build``'s second half: the data read, the model again where its shape was known only then (a folder's
    classes, a TFDS dataset's images), the steps for the data, the loaders."""
    whole = datasets.read(c.data, progress=False if c.no_progress else None, warn=warn)
    hosts.agree(whole.digest, "data", "every process must read the same dataset (a folder copied whole to each "
                "node, or one shared folder)")  # before the cut, which may fail on one node's copy alone
    read = datasets.cut(c.data, whole)
    data = read.splits
    for split, asked in (("train", c.train_subset), ("test", c.test_subset)):
        if asked is not None and asked > len(data[split]):  # all of them: said, not silently
            say(f"note: {named(f'{split}_subset', asked)} is over the {len(data[split])} "
                f"{'training' if split == 'train' else 'test'} examples: taking all of them")
    if (found := datasets.found(c.data, data["train"], shape)) != shape:
        model = assemble.model(c.network, c.compute, found, teacher, devices)
    updates = c.epochs * (len(data["train"]) // c.batch_size)
    trainer, evaluator = assemble.steps(c.network, c.optim, c.parallel, mesh, model, updates)
    layout, call_batch = assemble.placed(c.optim, model, trainer)
    settings = run_settings(c, read.digest, len(devices), trainer.pipeline_layout,
                            getattr(data["train"], "class_names", None))
    if checkpointer is not None:
        checkpointer.settings = settings  # what each checkpoint records, and a restore holds it to
    loaders = {"train": loader.Loader(data["train"], call_batch, train=True, seed=c.seed, workers=c.workers,
                                      augment=c.augment),
               "test": loader.Loader(data["test"], c.batch_size, train=False, workers=c.workers)}
    return Run(c, tuple(devices), mesh, model, trainer, evaluator, layout, call_batch, data, loaders, settings,
               checkpointer, read.tokenizer)


def check_model(c: RunConfig, model: models.Model) -> None:
    """What can fail of the model's weights before the data is read, from shapes alone: a pretrained file that
    does not fit, frozen parameters or learning-rate groups that name none."""
    if c.init_from and not c.resume:  # the file read and fitted now (a resumed run may never need it)
        pretrained.load(c.init_from, into=model)
    if c.freeze or c.lr_groups or c.linear_probe:
        params = jax.eval_shape(model.init, jax.random.key(0))[0]
        if problems := optim.check_groups(params, assemble.frozen(c.network, c.optim, model),
                                          lr_groups(c.lr_groups)):
            raise ConfigError(problems[0])


def open_checkpoints(c: Checkpoints) -> Checkpointer | None:
    """Writable and ours (locked) before the data is read; refuses to mix with another run's checkpoints."""
    if (c.resume or c.checkpoint_every) and not c.checkpoint_dir:
        raise ConfigError(f"{named('resume', True)} and {named('checkpoint_every')} need {named('checkpoint_dir')}")
    if not c.checkpoint_dir:
        return None
    if outputs.holds_results(Path(c.checkpoint_dir).expanduser()):  # a run's --out: its model beside our steps
        raise ConfigError(f"{named('checkpoint_dir', c.checkpoint_dir)} holds a run's results (it is a run's "
                          f"{named('out')}): give the checkpoints a directory of their own, e.g. "
                          f"{named('checkpoint_dir', Path(c.checkpoint_dir) / 'checkpoints')}")
    checkpointer = Checkpointer(c.checkpoint_dir, c.keep_checkpoints, fixed=FIXED_SETTINGS)
    if not c.resume and (newest := checkpointer.latest()) is not None:
        raise ConfigError(f"{checkpointer.directory} already holds checkpoints (newest: step {newest}): pass "
                          f"{named('resume', True)} to continue that run, or another {named('checkpoint_dir')} to "
                          "start afresh")
    return checkpointer


def run_settings(c: RunConfig, data_sha256: str, devices: int, pipeline_layout,
                 class_names: tuple[str, ...] | None = None) -> dict:
    """What a checkpoint records of the run (and ``--resume`` compares): its config's settings, and what else
    changes the program it compiles (``settings.program``: the variables read at trace time, ``$XLA_FLAGS``); an
    image folder's class names too."""
    return {**{k: getattr(c, k) for k in (*FIXED_SETTINGS, *FREE_SETTINGS)  # mesh: the flag
               if hasattr(c, k) and (k not in OPTIONAL_SETTINGS or getattr(c, k))},
            **models.revision_settings(c.model), **program(),
            "data_sha256": data_sha256, "experiment": c.model, "devices": devices,
            "processes": jax.process_count(), "pipeline_layout": pipeline_layout,
            **({"class_names": list(class_names)} if class_names else {})}


def initial_state(run: Run):
    """(state, position): fresh, or the newest checkpoint's; position None when fresh; raises Finished."""
    c, checkpointer = run.config, run.checkpointer
    init = run.model.init
    if c.init_from and not (c.resume and checkpointer.latest() is not None):
        loaded = pretrained.load(c.init_from, into=run.model, seed=c.seed)
        say(loaded.summary(c.init_from))
        init = lambda rng: loaded.variables  # noqa: E731 - every device takes its shards of the file's weights
    state = run.trainer.init(init_fn=init, rng=jax.random.key(c.seed))  # each device makes its shards
    if not c.resume:
        return state, None
    restored = checkpointer.restore(state)
    if restored is None:
        say(f"no checkpoint in {c.checkpoint_dir} yet: starting from scratch")
        return state, None
    position = restored.position
    steps, r = position.total_steps, position.result
    if r and (position.epoch > c.epochs or c.max_steps is not None and steps >= c.max_steps):
        say(f"already finished at step {steps} (checkpoint in {c.checkpoint_dir}): test acc {r['test_acc']:.3f}, "
            f"test loss {r['test_loss']:.4f}; nothing to do (raise {named('epochs')} or {named('max_steps')} to "
            "train on)")
        checkpointer.close()
        raise Finished({"already_finished": True, "steps": steps, "test_acc": r["test_acc"],
                        "test_loss": r["test_loss"], "params_digest": params_digest(restored.state.params)},
                       restored.state)
    last, given = c.epochs * len(run.loaders["train"]), named("epochs", c.epochs)
    if c.max_steps is not None and c.max_steps < last:
        last, given = c.max_steps, named("max_steps", c.max_steps)
    if steps > last:  # its training cannot be undone: the run would end on a model of another step count
        raise ConfigError(f"the checkpoint in {c.checkpoint_dir} is at step {steps}, past this run's last step {last} "
                          f"({given}): give {named('epochs')} or {named('max_steps')} that reach step {steps} or "
                          f"more to continue it, or another {named('checkpoint_dir')} to start afresh")
    changed = [f"{k} {restored.settings.get(k)!r} -> {run.settings[k]!r}" for k in (*FREE_SETTINGS, *program())
               if k in restored.settings and restored.settings[k] != run.settings[k]]  # a newer setting: no change
    say(f"resuming from step {position.total_steps} (epoch {position.epoch}, batch {position.batch})"
        + (f"; changed since: {', '.join(changed)}" if changed else ""))
    return restored.state, position


class Finished(Exception):
    """A resumed run that had already finished: ``args[0]``, its summary, says where."""
