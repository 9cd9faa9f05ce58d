"""Combiners: pool the vectors of a bag into one (sum, mean, sqrtn)."""

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

    Padding carries weight 0; an empty bag pools to zeros.
    """
    weights = ops.cast(weights, vectors.dtype)
    total = ops.sum(vectors * ops.expand_dims(weights, -1), axis=-2)
    if combiner == "sum":
        return total
    if combiner == "mean":
        denom = ops.sum(weights, axis=-1, keepdims=True)
    else:
        denom = ops.sqrt(ops.sum(ops.square(weights), axis=-1, keepdims=True))
    safe = ops.where(denom == 0, ops.ones_like(denom), denom)
    return ops.where(denom == 0, ops.zeros_like(total), total / safe)
