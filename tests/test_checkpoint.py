"""Checkpoint restore: damage on disk is moved aside; anything else, or nothing left, stops the run."""

import jax
import numpy as np
import optax
import pytest

import jaxtrain as jt
from jaxtrain.models import lenet
from jaxtrain.train.checkpoint import Checkpointer, UNREADABLE
from jaxtrain.train.loop import Position


@pytest.fixture
def saved(tmp_path):
    """A directory with checkpoints at steps 5 and 10 (different states), and a state to restore like."""
    trainer = jt.make_train_step(lenet.loss_fn, optax.adam(1e-3), mesh=1)
    like = trainer.init(lenet.init_params(jax.random.key(0)))
    ck = Checkpointer(tmp_path / "ck", keep=3)
    for step in (5, 10):
        state = trainer.init(lenet.init_params(jax.random.key(step)))
        ck.save(state, Position(total_steps=step), wait=True)
    ck.close()
    return tmp_path / "ck", like


def zero_biggest_file(step_dir):
    f = max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    f.write_bytes(b"\0" * f.stat().st_size)


def restore(directory, like):
    ck = Checkpointer(directory, keep=3)
    try:
        return ck.restore(like)
    finally:
        ck.close()


def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_previous_one_restored(saved, caplog):
    directory, like = saved
    zero_biggest_file(directory / "10")
    got = restore(directory, like)
    assert got.step == 5
    expected = lenet.init_params(jax.random.key(5))
    np.testing.assert_array_equal(got.state.params["dense1"]["w"], expected["dense1"]["w"])
    assert [p.name.split("-")[0] for p in (directory / UNREADABLE).iterdir()] == ["10"]
    said = [r for r in caplog.records if r.name == "jaxtrain.train.checkpoint"]
    assert len(said) == 1 and said[0].levelname == "WARNING", said
    assert said[0].getMessage().startswith(f"checkpoint at step 10 in {directory}"), said


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(saved):
    directory, like = saved
    for step in ("5", "10"):
        zero_biggest_file(directory / step)
    with pytest.raises(jt.ConfigError, match=r"none of the checkpoints .* could be restored \(steps 10, 5 are "
                                              r"damaged.*cannot be resumed") as e:
        restore(directory, like)
    assert "\n" not in str(e.value)
    assert len(list((directory / UNREADABLE).iterdir())) == 2  # kept, not deleted


def test_an_error_that_is_not_damage_moves_nothing_and_stops(saved, monkeypatch):
    """E.g. an API change in a dependency: every checkpoint would have been 'unreadable' and moved aside."""
    directory, like = saved
    import orbax.checkpoint as ocp

    def broken(self, *args, **kwargs):
        raise TypeError("restore() got an unexpected keyword argument 'args'")

    monkeypatch.setattr(ocp.CheckpointManager, "restore", broken)
    with pytest.raises(jt.ConfigError, match=r"step 10 .* failed \(TypeError: restore\(\) got an unexpected.*"
                                              r"not damage on disk, so nothing was moved") as e:
        restore(directory, like)
    assert "\n" not in str(e.value)
    assert not (directory / UNREADABLE).exists()
    assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["10", "5"]
