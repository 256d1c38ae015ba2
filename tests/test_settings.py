"""jaxtrain.settings: every JAXTRAIN_* variable read once, checked, and the same for a step traced later."""

import jax
import jax.numpy as jnp
import pytest

from jaxtrain import settings
from jaxtrain.core import remat
from jaxtrain.errors import ConfigError


def test_unset_or_empty_variables_keep_their_defaults():
    assert settings.read({}) == settings.Settings()
    assert settings.read({name: "" for name in settings.VARIABLES.values()}) == settings.Settings()


def test_values_are_parsed_into_their_fields():
    got = settings.read({"JAXTRAIN_XLA_DEFAULTS": "1", "JAXTRAIN_NO_MATERIALIZE": "yes", "JAXTRAIN_MALLOC": "DEFAULT",
                         "JAXTRAIN_JOIN_TIMEOUT": "4.5", "JAXTRAIN_PROCESS_ID": "0", "JAXTRAIN_NUM_PROCESSES": "2",
                         "JAXTRAIN_ONEDNN_CACHE": "/tmp/c", "JAXTRAIN_ONEDNN_THREADS": "1"})
    assert (got.xla_defaults, got.no_materialize, got.malloc, got.join_timeout) == (True, True, "default", 4.5)
    assert (got.process_id, got.num_processes, str(got.onednn_cache), got.onednn_threads) == (0, 2, "/tmp/c", 1)


@pytest.mark.parametrize("name, value, fragment", [
    ("JAXTRAIN_XLA_DEFAULTS", "2", "use 1 (on) or 0 (off), or unset it"),
    ("JAXTRAIN_ONEDNN_BLOCKED", "on", "use 1 (on) or 0 (off), or unset it"),
    ("JAXTRAIN_JOIN_TIMEOUT", "0", "must be a number of seconds above 0"),
    ("JAXTRAIN_JOIN_TIMEOUT", "soon", "must be a number of seconds above 0"),
    ("JAXTRAIN_NUM_PROCESSES", "-1", "must be a whole number from 1 or more"),
    ("JAXTRAIN_PROCESS_ID", "x", "must be a whole number from 0 or more"),
])
def test_a_bad_value_is_one_line_naming_the_variable(name, value, fragment):
    with pytest.raises(ConfigError) as e:
        settings.read({name: value})
    assert str(e.value).startswith(f"{name}={value}: ") and fragment in str(e.value) and "\n" not in str(e.value)


def test_command_buffers_are_a_choice_recorded_with_the_program():
    assert settings.read({"JAXTRAIN_COMMAND_BUFFERS": "loops"}).command_buffers == "loops"
    with pytest.raises(ConfigError, match="^JAXTRAIN_COMMAND_BUFFERS='graphs': use xla, off or loops$"):
        settings.read({"JAXTRAIN_COMMAND_BUFFERS": "graphs"})
    with settings.override(command_buffers="off"):
        assert settings.program()["JAXTRAIN_COMMAND_BUFFERS"] == "off"  # a resume under another says so


def test_override_changes_them_for_a_block_only():
    before = settings.current()
    with settings.override(pallas_gpu="triton") as inside:
        assert settings.current() is inside and inside.pallas_gpu == "triton"
    assert settings.current() is before


def materialized(x):
    return "rng_bit_generator" in jax.jit(lambda x: remat.materialize(x)).lower(x).as_text()  # a fresh trace


def test_a_variable_set_after_the_first_read_changes_nothing(monkeypatch):
    """A step traced later sees the values the process started with: remat.materialize's conditional stays;
    the setting itself does take it away."""
    settings.current()
    monkeypatch.setenv("JAXTRAIN_NO_MATERIALIZE", "1")
    assert settings.current().no_materialize is False and materialized(jnp.ones(3))
    with settings.override(no_materialize=True):
        assert not materialized(jnp.ones(3))
