"""The models' accuracy (``classify.ranked_first``) is argmax's answer, computed without argmax's reduction."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models import classify


def test_the_label_ranked_first_is_argmaxs_answer_ties_and_labels_outside_the_classes_included():
    rng = np.random.default_rng(0)
    for _ in range(300):  # few distinct values: ties of the largest logit are common, labels often outside
        rows, classes = rng.integers(1, 9, size=2)
        logits = rng.integers(-2, 3, size=(rows, classes)).astype(np.float32)
        labels = rng.integers(-2, classes + 2, size=rows).astype(np.int32)
        got = np.asarray(classify.ranked_first(jnp.asarray(logits), jnp.asarray(labels)))
        np.testing.assert_array_equal(got, logits.argmax(-1) == labels, err_msg=f"{logits}\n{labels}")


def test_a_row_holding_a_nan_ranks_no_label_first_and_jit_gives_the_same():
    logits = jnp.array([[0.0, jnp.nan, 1.0], [2.0, 1.0, 2.0], [0.5, 3.0, 3.0]])
    labels = jnp.array([1, 0, 2])
    want = np.array([False, True, False])  # the NaN's column (argmax's answer); the first of a tie; the second
    np.testing.assert_array_equal(classify.ranked_first(logits, labels), want)
    np.testing.assert_array_equal(jax.jit(classify.ranked_first)(logits, labels), want)
    big = jax.random.normal(jax.random.key(0), (64, 4096))
    first = jnp.argmax(big, -1)
    np.testing.assert_array_equal(jax.jit(classify.ranked_first)(big, first), np.ones(64, bool))
    np.testing.assert_array_equal(jax.jit(classify.ranked_first)(big, (first + 1) % 4096), np.zeros(64, bool))


def test_narrow_label_dtypes_count_every_column():
    """uint8 labels over 300 classes: a column past 255 is counted as itself (an iota in the labels' dtype would
    wrap 258 to 2, a tie "before" label 10)."""
    logits = jnp.zeros((1, 300)).at[0, 10].set(1.0).at[0, 258].set(1.0)  # the two largest: 10 comes first
    np.testing.assert_array_equal(classify.ranked_first(logits, jnp.array([10], jnp.uint8)), [True])
    np.testing.assert_array_equal(classify.ranked_first(logits, jnp.array([10], jnp.int32)), [True])
    np.testing.assert_array_equal(classify.outside(logits, jnp.array([100, 255], jnp.uint8)), [False, False])
