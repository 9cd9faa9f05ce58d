"""Normalizes every accepted id format to padded ids + weights + validity.

Accepted: integer arrays of any rank; on TensorFlow also tf.RaggedTensor and
tf.SparseTensor, on JAX a `jax.experimental.sparse.BCOO`; on every backend
the padded form ``(ids, weights)`` where a weight of 0 marks padding (see
`keras_sparse.ragged_to_padded`).
"""

import numpy as np
from keras import ops

from keras_sparse.backend_utils import is_jax_sparse
from keras_sparse.backend_utils import is_symbolic
from keras_sparse.backend_utils import is_tf_ragged_or_sparse


class LookupInputs:
    """Padded ids with per-position weights and a validity mask."""

    def __init__(self, ids, weights, present):
        self.ids = ids
        self.weights = weights
        self.present = present


def check_integer_dtype(layer_name, ids, argument="inputs"):
    dtype = str(getattr(ids, "dtype", "")).replace("tf.", "").replace("torch.", "")
    if "int" not in dtype:
        raise TypeError(
            f"Layer '{layer_name}': `{argument}` must hold integer ids; received "
            f"dtype {dtype or type(ids).__name__}. Cast ids to int32 or int64."
        )


def _densify_tf(x, weights):
    import tensorflow as tf

    if isinstance(x, tf.SparseTensor):
        present = tf.SparseTensor(
            x.indices, tf.ones_like(x.values, tf.bool), x.dense_shape
        )
        if weights is not None and isinstance(weights, tf.SparseTensor):
            weights = tf.sparse.to_dense(weights)
        return (
            tf.sparse.to_dense(x, default_value=tf.zeros((), x.dtype)),
            weights,
            tf.sparse.to_dense(present, default_value=False),
        )
    present = tf.ones_like(x, tf.bool).to_tensor(default_value=False)
    if weights is not None and isinstance(weights, tf.RaggedTensor):
        weights = weights.to_tensor(default_value=0.0)
    return x.to_tensor(default_value=tf.zeros((), x.dtype)), weights, present


def _densify_bcoo(x, weights):
    """A BCOO's dense ids and a mask of its stored entries (gaps: absent)."""
    from jax.experimental import sparse as jax_sparse

    # Counts, not bools: densifying sums duplicate entries.
    marks = jax_sparse.BCOO((ops.ones_like(x.data, "int32"), x.indices), shape=x.shape)
    if weights is not None and is_jax_sparse(weights):
        weights = weights.todense()
    return x.todense(), weights, marks.todense() > 0


def is_ragged_or_sparse(x):
    """True for the ragged/sparse forms `normalize` densifies."""
    return is_tf_ragged_or_sparse(x) or is_jax_sparse(x)


def normalize(layer_name, inputs, weights):
    """Returns `LookupInputs` for any accepted input format."""
    if is_tf_ragged_or_sparse(inputs):
        check_integer_dtype(layer_name, inputs)
        ids, weights, present = _densify_tf(inputs, weights)
    elif is_jax_sparse(inputs):
        check_integer_dtype(layer_name, inputs)
        ids, weights, present = _densify_bcoo(inputs, weights)
    else:
        if not hasattr(inputs, "dtype"):
            inputs = np.asarray(inputs)
        check_integer_dtype(layer_name, inputs)
        ids = ops.convert_to_tensor(inputs)
        present = None
    if weights is not None:
        weights = ops.convert_to_tensor(weights)
        if "float" not in str(weights.dtype):
            weights = ops.cast(weights, "float32")
        if tuple(weights.shape) != tuple(ids.shape) and None not in weights.shape:
            raise ValueError(
                f"Layer '{layer_name}': `weights` must have the shape of the ids "
                f"{tuple(ids.shape)}; received {tuple(weights.shape)}."
            )
    return LookupInputs(ids, weights, present)


def check_host_ids(layer_name, ids, high):
    """Range check of NumPy ids as passed, before Keras converts them.

    JAX without x64 wraps int64 ids to their low 32 bits on conversion:
    ``2**32 + 5`` would read (and train) row 5, and a later range error
    would print the wrapped id.
    """
    if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu":
        return
    check_range_eagerly(layer_name, ids, None, 0, high)


def check_range_eagerly(layer_name, ids, present, low, high):
    """Raises ValueError on the first id outside ``[low, high)`` (eager only);
    True where it checked (every id in range), False where symbolic."""
    if not isinstance(ids, np.ndarray) and is_symbolic(ids):
        return False
    values = ops.convert_to_numpy(ids)
    bad = (values < low) | (values >= high)
    if present is not None:
        bad &= ops.convert_to_numpy(present)
    if bad.any():
        first = values[bad].reshape(-1)[0]
        raise ValueError(
            f"Layer '{layer_name}': id {int(first)} is out of range; valid ids "
            f"are in [{low}, {high}) (input_dim={high}). "
            f"{int(bad.sum())} id(s) out of range in this batch."
        )
    return True


def cast_float_ids(layer_name, ids):
    """Float ids as int32, as `keras.layers.Embedding` casts them.

    A functional model whose Input is float32 (``keras.Sequential`` without
    an Input, for one) hands the layer float ids. Eagerly, a non-integral
    id raises instead of being truncated.
    """
    dtype = str(getattr(ids, "dtype", ""))
    if "float" not in dtype or is_ragged_or_sparse(ids):
        return ids
    if not is_symbolic(ids):
        values = ops.convert_to_numpy(ids)
        bad = values != np.trunc(values)
        if bad.any():
            raise ValueError(
                f"Layer '{layer_name}': id {values[bad].reshape(-1)[0]!r} is not "
                "an integer; float ids are cast to int32 only when integral. "
                f"{int(bad.sum())} such id(s) in this batch."
            )
    return ops.cast(ids, "int32")


def fixed_vocabulary_ids(
    layer_name,
    inputs,
    weights,
    input_dim,
    combiner,
    mask_zero=False,
    cast=False,
    in_range=True,
):
    """``(ids, weights, valid)`` of a fixed-vocabulary lookup of any input form.

    With a combiner, rank-1 ids become bags of one. Invalid positions:
    out-of-range ids (raising `check_range_eagerly` in eager calls), ragged
    or sparse gaps, weight 0 and, with a combiner and ``mask_zero``, id 0.
    ``cast``: integral float ids are accepted (`cast_float_ids`).
    ``in_range=False`` leaves out-of-range ids valid, for a caller that
    raises on them inside the step (a table cached over a row store).
    """
    if cast:
        inputs = cast_float_ids(layer_name, inputs)
    form = normalize(layer_name, inputs, weights)
    ids, weights, present = form.ids, form.weights, form.present
    if combiner is not None and len(ids.shape) == 1:
        ids = ops.expand_dims(ids, -1)
        weights = None if weights is None else ops.expand_dims(weights, -1)
        present = None if present is None else ops.expand_dims(present, -1)
    checked = check_range_eagerly(layer_name, ids, present, 0, input_dim)
    if not in_range or (checked and present is None):
        # Every id was just found in range (or counts as valid): one op
        # instead of two comparisons and their `and`, per table and step.
        valid = ops.ones_like(ids, dtype="bool")
    else:
        valid = ops.logical_and(ids >= 0, ids < input_dim)
    if present is not None:
        valid = ops.logical_and(valid, present)
    if combiner is not None and mask_zero:
        valid = ops.logical_and(valid, ops.not_equal(ids, 0))
    if weights is not None:
        valid = ops.logical_and(valid, ops.not_equal(weights, 0))
    return ids, weights, valid


def ragged_to_padded(values, row_lengths, max_length=None, pad_id=0):
    """Turns a ragged batch (flat values + row lengths) into the padded form.

    Returns ``(ids, weights)`` NumPy arrays of shape ``[batch, max_length]``;
    padding positions hold ``pad_id`` with weight 0, which every keras_sparse
    layer excludes from pooling and from updates.

    Example:

    >>> ids, w = ragged_to_padded([3, 1, 4, 1, 5], [2, 0, 3])
    >>> ids.tolist()
    [[3, 1, 0], [0, 0, 0], [4, 1, 5]]
    >>> w.tolist()
    [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    """
    values = np.asarray(values)
    lengths = np.asarray(row_lengths, dtype=np.int64)
    if lengths.ndim != 1 or (lengths < 0).any():
        raise ValueError("ragged_to_padded: `row_lengths` must be a 1-D array of >= 0.")
    if lengths.sum() != values.shape[0]:
        raise ValueError(
            f"ragged_to_padded: row_lengths sum to {int(lengths.sum())} but "
            f"{values.shape[0]} values were given."
        )
    width = int(lengths.max(initial=0)) if max_length is None else int(max_length)
    if (lengths > width).any():
        raise ValueError(
            f"ragged_to_padded: a row has {int(lengths.max())} ids, more than "
            f"max_length={width}."
        )
    positions = np.arange(width)[None, :]
    mask = positions < lengths[:, None]
    ids = np.full((lengths.shape[0], width), pad_id, dtype=values.dtype)
    ids[mask] = values
    return ids, mask.astype(np.float32)
