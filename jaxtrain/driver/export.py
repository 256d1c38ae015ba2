"""A finished run's model on disk: ``RUN_DIR/model/`` (orbax: params and model state) and ``RUN_DIR/model.json``.

Every experiment run writes both when it finishes, so a run can be
evaluated, quantised or used as a teacher later without its checkpoints
(``load(run_dir)``). ``model.json`` says what the arrays are: the model's
registry name, init, input shape and class count, the dataset and the run's
settings, the test accuracy and a digest of the params. It is written after
the arrays (orbax renames a finished save into place), so a run killed
while saving has no ``model.json`` and is not taken for a finished one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np

from jaxtrain.errors import ConfigError, named
from jaxtrain.io.files import atomic_write, drop_late_read_reports, out_of_space, params_digest

ARRAYS, INFO = "model", "model.json"
TOKENIZER = "tokenizer.json"  # a language model's (jaxtrain.data.text): its tokens' text
LAYER_ORDER = "pipelined_layers_in_order"  # model.json of a pipelined run whose blocks were saved in layer order


def _host(tree):
    """Whole arrays as numpy on every process (gathering sharded arrays is collective: every process calls it)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


def save(out_dir: Path | None, params, model_state, info: dict) -> None:
    """Write the model into ``out_dir`` (process 0; the others pass None but must call this too)."""
    import orbax.checkpoint as ocp

    tree = _host({"params": params, "model_state": model_state})
    if out_dir is None:
        return
    me = jax.process_index()
    writer = ocp.StandardCheckpointer(  # this process alone: the others hold the same numbers
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}))
    path = Path(out_dir).absolute()
    (path / INFO).unlink(missing_ok=True)
    try:
        writer.save(path / ARRAYS, tree, force=True)
        writer.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - orbax wraps the OS error; a full disk becomes one line
        if not out_of_space(e):
            raise
        for tmp in path.glob(f"{ARRAYS}*tmp*"):
            shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"writing the model to {path / ARRAYS} failed (the disk is full): make room, then run "
                          f"again with {named('resume', True)} (a checkpointed run writes its model then)") from None
    finally:
        writer.close()
    atomic_write(path / INFO, json.dumps({**info, "params_digest": params_digest(tree["params"])}, indent=1) + "\n")


def saved(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a whole saved model (model.json is written last)."""
    return (Path(run_dir) / INFO).is_file() and (Path(run_dir) / ARRAYS).is_dir()


def info(run_dir: str | Path, expect: str | tuple[str, ...] | None = None, param: str = "run_dir") -> dict:
    """``model.json`` of a finished run; one-line errors for a missing directory, no saved model, another model
    (``param``: the parameter the caller gave the run as, named in them)."""
    path, who = Path(run_dir), named(param, run_dir)
    if not path.is_dir():
        raise ConfigError(f"{who}: no such directory; pass the {named('out')} directory of a finished run")
    if not (path / INFO).is_file() or not (path / ARRAYS).is_dir():
        raise ConfigError(f"{who}: holds no saved model ({INFO} and {ARRAYS}/ are written when a run "
                          "finishes); train one to its end first, e.g. jaxtrain lenet --out DIR (jaxtrain gpt "
                          "for a language model)")
    try:
        meta = json.loads((path / INFO).read_text())
        shape, classes = meta["input_shape"], meta["num_classes"]
        if not (isinstance(meta["model"], str) and isinstance(shape, list) and len(shape) in (1, 3)
                and all(type(d) is int and d > 0 for d in shape) and type(classes) is int and classes >= 2):
            raise TypeError(f"model {meta['model']!r}, input_shape {shape!r}, num_classes {classes!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{who}: {INFO} is unreadable ({type(e).__name__}: {e}): the run's files are "
                          "damaged or were edited; train it again") from None
    wanted = (expect,) if isinstance(expect, str) else expect
    if wanted and meta["model"] not in wanted:
        raise ConfigError(f"{who}: holds a {meta['model']} model, not {' or '.join(wanted)}")
    if (meta.get("settings") or {}).get("pipeline_layout") and not meta.get(LAYER_ORDER):
        raise ConfigError(f"{who}: a pipelined run saved before its layers were put back in order (they "
                          "are stored per stage); train it again, or use an unpipelined run")
    return meta


def model_of(meta: dict):
    """The registry Model a saved run's ``info`` describes (its name, init, image shape and classes; a language
    model's window, vocabulary, size and positions)."""
    from jaxtrain import models

    settings = meta.get("settings") or {}
    models.check_revision(meta["model"], settings, "this run's model")
    return models.get(meta["model"], init=meta.get("init"), input_shape=tuple(meta["input_shape"]),
                      num_classes=meta["num_classes"], size=settings.get("model_size"),
                      rotary=settings.get("rotary", False))


def load(run_dir: str | Path, expect: str | tuple[str, ...] | None = None, param: str = "run_dir"):
    """(info, params, model_state) of a finished run, as numpy arrays, checked against ``info``'s digest."""
    who = named(param, run_dir)
    import orbax.checkpoint as ocp

    meta = info(run_dir, expect, param)
    shapes = jax.eval_shape(model_of(meta).init, jax.random.key(0))
    target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), {"params": shapes[0], "model_state": shapes[1]})
    drop_late_read_reports()
    try:
        with ocp.StandardCheckpointer() as reader:
            tree = reader.restore(Path(run_dir).absolute() / ARRAYS, target)
    except Exception as e:  # orbax raises many types for damaged files
        raise ConfigError(f"{who}: its saved model cannot be read "
                          f"({str(e).splitlines()[0][:120] or type(e).__name__}); train it again") from None
    tree = jax.tree.map(np.asarray, tree)
    differ = [f"{jax.tree_util.keystr(path)} {got.shape} vs {want.shape}" for (path, got), want in
              zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(target)) if got.shape != want.shape]
    if differ:
        raise ConfigError(f"{who}: its saved arrays do not have the shapes {INFO} describes ({differ[0]}"
                          f"{f' and {len(differ) - 1} more' if len(differ) > 1 else ''}): was {INFO} edited? Train "
                          "it again")
    if params_digest(tree["params"]) != meta.get("params_digest"):
        raise ConfigError(f"{who}: the saved params do not match the digest in {INFO}: the files are "
                          "damaged; train it again")
    return meta, tree["params"], tree["model_state"]


def save_pretrained(run_dir: str | Path, path: str | Path, names: str | None = None) -> Path:
    """A finished run's model (``RUN_DIR/model``) as a file torchvision, timm or transformers load
    (``jaxtrain.pretrained.save``: ``.safetensors``, or PyTorch's ``.pth``; ``names``: ``"hf"`` for a ViT in
    Hugging Face's names; a GPT: ``GPT2LMHeadModel``'s safetensors)."""
    from jaxtrain import models, pretrained

    meta, params, model_state = load(run_dir)
    model = model_of(meta)
    if isinstance(model, models.LanguageModel):  # GPT2LMHeadModel's names (transformers)
        from jaxtrain.pretrained import gpt2

        if names not in (None, "hf"):  # never silently another's: the file is GPT-2's whatever was asked
            raise ConfigError(f"{named('names', names)}: a {meta['model']} is written in Hugging Face's GPT-2 names: "
                              f"give {named('names', 'hf')} or leave it out")
        return gpt2.save(params, model.config, path)
    return pretrained.save(meta["model"], (params, model_state), path, names=names)
