"""Initial values of fresh rows drawn per key (key-sharded hash layers, JAX).

`fresh_rows.fresh_row_values` gives the ``k``-th fresh position of a batch
the ``k``-th drawn row, so a key's first vector depends on where the batch
put it. Under key sharding the same batch is split over ``D`` devices and
each owner assigns its own rows, so values must not depend on positions:
here a fresh key's vector is the initializer drawn with the step's seed
folded with the key's two 32-bit words. A key admitted in the same step gets
the same vector on 1 or 8 devices, in one or several processes.

The draw is sized to the fresh count as in `fresh_rows` (on CPUs): the fresh
positions are compacted, drawn, and spread back by rank.
"""

from keras import ops

from keras_sparse.layers.fresh_rows import draw
from keras_sparse.layers.fresh_rows import draw_sizes
from keras_sparse.layers.fresh_rows import sized_draws
from keras_sparse.ops import count_buckets
from keras_sparse.ops import take_rows


def has_seed(initializer):
    """Whether ``initializer`` draws random values (takes a seed)."""
    return "seed" in initializer.get_config()


def keyed_fresh_values(initializer, fresh, words, dim, dtype, seed, fans):
    """``[n, dim]`` values; the rows at ``fresh`` positions are drawn from
    ``(seed, key)`` alone. ``words``: int32 ``[n, 2]`` (high, low word of
    each position's key); ``seed``: the step's seed (a drawn seed tensor,
    see ``keras.random.SeedGenerator.next``), unused by initializers
    without one. Runs per device inside ``shard_map`` (no collectives)."""
    import jax

    n = int(fresh.shape[0])
    if not has_seed(initializer):
        return initializer((n, dim), dtype=dtype)
    fresh_int = ops.cast(fresh, "int32")
    rank = ops.cumsum(fresh_int) - 1
    count = ops.sum(fresh_int)
    # Fresh positions first, in batch order.
    order = jax.numpy.argsort(1 - fresh_int, stable=True)

    def one(word_pair):
        key_seed = jax.random.fold_in(
            jax.random.fold_in(seed, word_pair[0]), word_pair[1]
        )
        return draw(initializer, (dim,), dtype, key_seed, fans)

    def branch(size):
        def values():
            picked = take_rows(words, order[:size])
            drawn = jax.vmap(one)(picked)
            return take_rows(drawn, ops.clip(rank, 0, size - 1))

        return values

    return count_buckets.switch_on_count(count, draw_sizes(n), branch, sized_draws())
