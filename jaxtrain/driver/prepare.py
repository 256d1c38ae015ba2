"""A run made ready, in phases before its first step: devices and mesh, every setting checked before the data is
read, checkpoints opened (ours, locked), the data, the model and steps built for it, and the state (fresh, or the
newest checkpoint's). ``runner`` trains what they make.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import jax

from jaxtrain import models, pretrained
from jaxtrain.core import optim, remat
from jaxtrain.choices import FOLDER_PREFIX, lr_groups
from jaxtrain.data import classes, folder, sources
from jaxtrain.errors import ConfigError
from jaxtrain.io.dirlock import DirLock
from jaxtrain.parallel import devices as devices_lib
from jaxtrain.parallel import hosts
from jaxtrain.parallel import preflight
from jaxtrain.settings import program
from jaxtrain.driver import assemble, distill
from jaxtrain.driver.config import FIXED_SETTINGS, FREE_SETTINGS, OPTIONAL_SETTINGS, RunConfig
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


@dataclasses.dataclass
class Setup:
    """What the phases build and pass on."""

    config: RunConfig
    devices: list[jax.Device]
    mesh: jax.sharding.Mesh
    say: Callable = say  # a progress line, said by process 0
    model: models.Model | None = None
    trainer: Trainer | None = None  # a PipelineTrainer where the mesh has a "stage" axis
    evaluator: Evaluator | None = None
    layout: dict | None = None  # where each parameter lives (trainer.layout)
    call_batch: int = 0
    checkpointer: Checkpointer | None = None
    teacher: tuple | None = None  # --teacher: (model, params, model_state)
    last: dict = dataclasses.field(default_factory=dict)  # the last step's metrics
    out_lock: DirLock | None = None  # held on --out while the run writes there
    requeue_job: dict | None = None  # --requeue-on-signal: the SLURM job to requeue after a signal's checkpoint


def setup_devices(c: RunConfig) -> Setup:
    devices = devices_lib.setup_devices(c.devices, devices_per_process=c.devices_per_process,
                                        coordinator=c.coordinator, num_processes=c.num_processes,
                                        process_id=c.process_id)

    if note := remat.offload_note(c.remat, devices[0].platform):  # a bad name fails here, before the data is read
        say(note)
    if jax.process_count() > 1:
        say(preflight.run(devices))
    return Setup(c, devices, devices_lib.make_mesh(devices, axes=c.mesh))


def validate(s: Setup) -> None:
    """Everything that can fail before the data is read (which may take minutes), checked on the dataset's
    usual image shape: the model, the teacher, the pipeline's settings, where the state goes, the batch size.
    Nothing is kept but the teacher (read once): ``build`` makes each part once, for the data."""
    c = s.config
    s.teacher = distill.teacher_from_run(c.teacher) if c.teacher else None
    shape = sources.shape_of(c.dataset, image_size=c.image_size)
    if s.teacher and c.dataset.startswith(FOLDER_PREFIX):  # a folder's classes are unknown until its index is read
        shape["num_classes"] = s.teacher[0].num_classes
    model = assemble.model(c, shape, s.teacher)
    if c.init_from and not c.resume:  # the file read and fitted now (a resumed run may never need it)
        pretrained.load(c.init_from, into=model)
    if c.freeze or c.lr_groups or c.linear_probe:
        params = jax.eval_shape(model.init, jax.random.key(0))[0]
        if problems := optim.check_groups(params, assemble.frozen(c, model), lr_groups(c.lr_groups)):
            raise ConfigError(problems[0])
    assemble.placed(c, model, assemble.steps(c, s.mesh, model, updates=0)[0])


def build(s: Setup, train) -> None:
    """The model, optimizer and train / eval steps, sized by the ``train`` split (image shape, classes, updates)."""
    c = s.config
    s.model = assemble.model(c, sources.shape_of(c.dataset, train), s.teacher)
    s.trainer, s.evaluator = assemble.steps(c, s.mesh, s.model, c.epochs * (len(train) // c.batch_size))
    s.layout, s.call_batch = assemble.placed(c, s.model, s.trainer)


def open_checkpoints(s: Setup) -> None:
    """Writable and ours (locked) before the data is read; refuses to mix with another run's checkpoints."""
    c = s.config
    if (c.resume or c.checkpoint_every) and not c.checkpoint_dir:
        raise ConfigError("resume=True and checkpoint_every= need checkpoint_dir=")
    if not c.checkpoint_dir:
        return
    s.checkpointer = Checkpointer(c.checkpoint_dir, c.keep_checkpoints, fixed=FIXED_SETTINGS)
    if not c.resume and (newest := s.checkpointer.latest()) is not None:
        raise ConfigError(f"{s.checkpointer.directory} already holds checkpoints (newest: step {newest}): pass "
                          "resume=True to continue that run, or another checkpoint_dir= to start afresh")


def load_data(s: Setup) -> tuple[dict, str]:
    """The splits (subsets applied) and the digest of the whole dataset (a folder's: of its index)."""
    c = s.config
    if c.dataset.startswith(FOLDER_PREFIX):  # streamed from disk: only the index is read now
        data = folder.load(c.dataset[len(FOLDER_PREFIX):], c.image_size, val_fraction=c.val_fraction,
                           on_bad=c.on_bad_image, crop_fraction=0.875 if c.augment == "rrc+flip" else 1.0,
                           warn=warn)
        digest = folder.digest(*data.values())
    else:
        data = {k: sources.load_split(c.dataset, k, data_dir=c.data_dir, tfds_dir=c.tfds_dir,
                                      progress=False if c.no_progress else None) for k in ("train", "test")}
        digest = sources.split_digest(*data.values())
    hosts.agree(digest, "data", "every process must read the same dataset (a folder copied whole to each node, or "
                "one shared folder)")
    data = classes.restricted(c.dataset, data, c.classes)
    return {"train": data["train"].head(c.train_subset), "test": data["test"].head(c.test_subset)}, digest


def run_settings(s: Setup, data_sha256: str, class_names: tuple[str, ...] | None = None) -> dict:
    """What a checkpoint records of the run (and ``--resume`` compares): its config's settings, and what else
    changes the program it compiles (``settings.program``: the variables read at trace time, ``$XLA_FLAGS``); an
    image folder's class names too."""
    c = s.config
    settings = {**{k: getattr(c, k) for k in (*FIXED_SETTINGS, *FREE_SETTINGS)  # mesh: the flag
                   if hasattr(c, k) and (k not in OPTIONAL_SETTINGS or getattr(c, k))},
                **models.revision_settings(c.model), **program(),
                "data_sha256": data_sha256, "experiment": c.model, "devices": len(s.devices),
                "processes": jax.process_count(), "pipeline_layout": s.trainer.pipeline_layout,
                **({"class_names": list(class_names)} if class_names else {})}
    if s.checkpointer is not None:
        s.checkpointer.settings = settings
    return settings


def initial_state(s: Setup, settings: dict):
    """(state, position): fresh, or the newest checkpoint's; position None when fresh; raises Finished."""
    c = s.config
    init = s.model.init
    if c.init_from and not (c.resume and s.checkpointer.latest() is not None):
        loaded = pretrained.load(c.init_from, into=s.model, seed=c.seed)
        s.say(loaded.summary(c.init_from))
        init = lambda rng: loaded.variables  # noqa: E731 - every device takes its shards of the file's weights
    state = s.trainer.init(init_fn=init, rng=jax.random.key(c.seed))  # each device makes its shards
    if not c.resume:
        return state, None
    restored = s.checkpointer.restore(state)
    if restored is None:
        s.say(f"no checkpoint in {c.checkpoint_dir} yet: starting from scratch")
        return state, None
    position = restored.position
    steps, r = position.total_steps, position.result
    if r and (position.epoch > c.epochs or c.max_steps is not None and steps >= c.max_steps):
        s.say(f"already finished at step {steps} (checkpoint in {c.checkpoint_dir}): test acc {r['test_acc']:.3f}, "
              f"test loss {r['test_loss']:.4f}; nothing to do (raise epochs= or max_steps= to train on)")
        s.checkpointer.close()
        raise Finished({"already_finished": True, "steps": steps, "test_acc": r["test_acc"]}, restored.state)
    changed = [f"{k} {restored.settings.get(k)!r} -> {settings[k]!r}" for k in (*FREE_SETTINGS, *program())
               if k in restored.settings and restored.settings[k] != settings[k]]  # a newer setting: not a change
    s.say(f"resuming from step {position.total_steps} (epoch {position.epoch}, batch {position.batch})"
          + (f"; changed since: {', '.join(changed)}" if changed else ""))
    return restored.state, position


class Finished(Exception):
    """A resumed run that had already finished: ``args[0]``, its summary, says where."""
