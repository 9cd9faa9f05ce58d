"""Combiners: pool the vectors of a bag into one (sum, mean, sqrtn)."""

import keras
from keras import ops

COMBINERS = (None, "sum", "mean", "sqrtn")


def check_combiner(layer_name, combiner):
    if combiner not in COMBINERS:
        raise ValueError(
            f"Layer '{layer_name}': unknown `combiner`={combiner!r}. Valid choices "
            "are None, 'sum', 'mean', 'sqrtn'."
        )


def pool(vectors, weights, combiner):
    """Pools ``[..., bag, dim]`` vectors with ``[..., bag]`` weights.

    Padding carries weight 0; an empty bag pools to zeros. ``weights=None``:
    every weight 1.
    """
    if weights is None:
        return scale_sum(ops.sum(vectors, axis=-2), ops.shape(vectors)[-2], combiner)
    weights = ops.cast(weights, vectors.dtype)
    total = ops.sum(vectors * ops.expand_dims(weights, -1), axis=-2)
    if combiner == "sum":
        return total
    if combiner == "mean":
        denom = ops.sum(weights, axis=-1, keepdims=True)
    else:
        denom = ops.sqrt(ops.sum(ops.square(weights), axis=-1, keepdims=True))
    return _divide(total, denom)


def scale_sum(total, bag, combiner):
    """Pools from the sum ``total`` of bags of ``bag`` vectors, all weight 1."""
    if combiner == "sum" or bag == 0:
        return total  # empty bags pool to zeros
    bag = ops.cast(bag, total.dtype)
    return total / (bag if combiner == "mean" else ops.sqrt(bag))


def pool_unweighted(vectors, valid, combiner):
    """`pool` with weight 1 where ``valid`` and 0 elsewhere.

    Under XLA (JAX, TensorFlow) a select fuses into the sum, while a
    multiply by a float mask materializes a ``[..., bag, dim]`` mask for
    the backward pass; eager PyTorch runs a broadcast multiply ~4x faster
    than a broadcast select.
    """
    if keras.backend.backend() == "torch":
        if valid.device.type == "cpu" and bool(valid.all()):
            # Nothing to mask (a free host check on the CPU): a plain sum,
            # whose backward is a broadcast, not a multiply.
            return pool(vectors, None, combiner)
        return pool(vectors, valid, combiner)
    mask = ops.expand_dims(valid, -1)
    total = ops.sum(ops.where(mask, vectors, ops.zeros((), vectors.dtype)), axis=-2)
    if combiner == "sum":
        return total
    count = ops.sum(ops.cast(valid, vectors.dtype), axis=-1, keepdims=True)
    return _divide(total, count if combiner == "mean" else ops.sqrt(count))


def _divide(total, denom):
    safe = ops.where(denom == 0, ops.ones_like(denom), denom)
    return ops.where(denom == 0, ops.zeros_like(total), total / safe)
