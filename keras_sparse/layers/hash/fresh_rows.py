"""Initial values for the rows a dynamic-vocabulary layer assigns in a step.

A training step of `DistributedHashEmbedding` re-initializes the rows its
table assigned to new keys. Drawing the initializer for every position of
the batch (``[n, dim]``) costs more than the rest of the lookup on a CPU
(threefry bits for every id of every field), while a step rarely has more
than a few percent of fresh positions. So the draw is sized to the fresh
count: the smallest of ``n/32, n/8, n/2, n`` rows that holds them
(`keras.ops.switch`, static shapes in every branch), and the ``k``-th fresh
position of the batch gets drawn row ``k``. Every branch draws with the same
seed, taken from the layer's seed generator once per step (a generator's
state cannot advance inside a branch), so the generator advances exactly as
before and a step's values are a pure function of (seed, fresh mask).

On accelerators the full-size draw is cheap and a data-dependent branch
costs a device-to-host sync, so there the draw is always ``n`` rows (still
indexed by fresh rank).
"""

import math

import keras
from keras import ops

from keras_sparse.ops import count_buckets
from keras_sparse.ops import take_rows


class DrawnSeed(keras.random.SeedGenerator):
    """A seed already drawn from a generator; ``next()`` returns it as is.

    Lets an initializer (which accepts only ints and generators) draw with a
    seed tensor, so that the branches of a conditional share one draw of the
    layer's generator.
    """

    def __init__(self, seed):  # no state variable of its own
        self._seed = seed

    def next(self, ordered=True):
        return self._seed


def sized_draws():
    """Whether to size the draw to the fresh count (CPU) or draw ``n`` rows."""
    return count_buckets.sized_by_count()


def draw_sizes(n):
    """Ascending draw sizes for a batch of ``n`` positions (int or tensor)."""
    return count_buckets.bucket_sizes(n)


def draw(initializer, shape, dtype, seed, fans=None):
    """Seeded ``initializer`` drawn at ``shape`` with the seed tensor ``seed``.

    ``fans=(fan_in, fan_out)`` overrides a VarianceScaling initializer's
    fans (the table's, not the batch's).
    """
    config = initializer.get_config()
    seeded = DrawnSeed(seed)
    if fans is None or not isinstance(initializer, keras.initializers.VarianceScaling):
        return type(initializer).from_config({**config, "seed": seeded})(
            shape, dtype=dtype
        )
    fan_in, fan_out = (float(f) for f in fans)
    mode = initializer.mode
    fan = {"fan_in": fan_in, "fan_out": fan_out}.get(mode, (fan_in + fan_out) / 2.0)
    scale = initializer.scale / max(1.0, fan)
    distribution = initializer.distribution
    if distribution == "truncated_normal":
        stddev = math.sqrt(scale) / 0.87962566103423978
        return keras.random.truncated_normal(shape, 0.0, stddev, dtype, seeded)
    if distribution == "untruncated_normal":
        return keras.random.normal(shape, 0.0, math.sqrt(scale), dtype, seeded)
    limit = math.sqrt(3.0 * scale)
    return keras.random.uniform(shape, -limit, limit, dtype, seeded)


def fresh_row_values(initializer, fresh, dim, dtype, seed_generator, fans=None):
    """``[n, dim]`` values whose rows at the ``fresh`` positions are new draws.

    ``fresh``: bool ``[n]`` (``n`` may be unknown when tracing a TensorFlow
    graph; the draw sizes are then computed in the graph). Rows at other
    positions are arbitrary (the caller writes only the fresh ones).
    Advances ``seed_generator`` once.
    """
    n = fresh.shape[0]
    n = ops.shape(fresh)[0] if n is None else int(n)
    if "seed" not in initializer.get_config():
        return initializer((n, dim), dtype=dtype)
    seed = seed_generator.next()
    sizes = draw_sizes(n)
    fresh_int = ops.cast(fresh, "int32")
    rank = ops.cumsum(fresh_int) - 1  # k-th fresh position -> drawn row k
    count = ops.sum(fresh_int)

    def branch(size):
        def values():
            drawn = draw(initializer, (size, dim), dtype, seed, fans)
            return take_rows(drawn, ops.clip(rank, 0, size - 1))

        return values

    return count_buckets.switch_on_count(count, sizes, branch, sized_draws())
