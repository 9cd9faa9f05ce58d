"""Initial values of a hash layer's fresh rows, drawn per key.

A key's first vector is a function of (layer seed, key) only: the same on
every backend, training route, device count and process count, whichever
step admits the key and wherever the batch puts it. Element ``j`` of key
``k``'s vector is a uniform number hashed from (seed, ``k``, ``j``)
(`keras_sparse.ops.key_hash`) pushed through the initializer's inverse CDF:

- ``RandomUniform``: ``minval + u (maxval - minval)``;
- ``RandomNormal``: ``mean + stddev sqrt(2) erfinv(2u - 1)``;
- ``TruncatedNormal``: the normal's inverse CDF restricted to two standard
  deviations, which is the distribution Keras draws (it redraws outliers);
- ``VarianceScaling`` and its subclasses (Glorot, He, Lecun): the same with
  the fans of the whole ``[capacity, output_dim]`` table.

Initializers without a seed (zeros, ones, constants) are called as they
are. Any other seeded initializer (e.g. ``Orthogonal``) has no per-element
form: its draw stays by rank (`keras_sparse.layers.hash.fresh_rows`), so there a
key's first vector depends on the step and its position.

The draw is sized to the fresh count as in `fresh_rows` (on CPUs): the
fresh positions' words are compacted, hashed, and spread back by rank.
"""

import math

import keras
from keras import ops

from keras_sparse.layers.hash import fresh_rows
from keras_sparse.ops import count_buckets
from keras_sparse.ops import take_rows
from keras_sparse.ops.key_hash import key_uniforms

_SQRT2 = math.sqrt(2.0)
# erf(2 / sqrt(2)): the mass of a standard normal within two deviations.
_ERF_2SD = math.erf(math.sqrt(2.0))
_INITS = keras.initializers


def has_seed(initializer):
    """Whether ``initializer`` draws random values (takes a seed)."""
    return "seed" in initializer.get_config()


def _calls(initializer, cls):
    """Whether ``initializer`` draws exactly as ``cls`` does (a subclass
    that only sets arguments, such as GlorotUniform for VarianceScaling)."""
    return isinstance(initializer, cls) and type(initializer).__call__ is cls.__call__


def per_key(initializer):
    """Whether fresh rows of ``initializer`` are drawn per key (else: called
    as is, without a seed, or by rank)."""
    return has_seed(initializer) and any(
        _calls(initializer, cls)
        for cls in (
            _INITS.RandomUniform,
            _INITS.RandomNormal,
            _INITS.TruncatedNormal,
            _INITS.VarianceScaling,
        )
    )


def _normal(u, mean, stddev, truncated):
    t = 2.0 * u - 1.0  # exact in float32 (see key_uniforms)
    if truncated:
        t = t * _ERF_2SD
    return mean + stddev * _SQRT2 * ops.erfinv(t)


def _distribution(initializer, fans):
    """``(kind, a, b)``: uniform on ``(a, b)``, or a normal of mean ``a`` and
    standard deviation ``b`` ("normal", "truncated")."""
    if _calls(initializer, _INITS.RandomUniform):
        return "uniform", float(initializer.minval), float(initializer.maxval)
    if _calls(initializer, _INITS.RandomNormal):
        return "normal", float(initializer.mean), float(initializer.stddev)
    if _calls(initializer, _INITS.TruncatedNormal):
        return "truncated", float(initializer.mean), float(initializer.stddev)
    fan_in, fan_out = (float(f) for f in fans)
    mode = initializer.mode
    fan = {"fan_in": fan_in, "fan_out": fan_out}.get(mode, (fan_in + fan_out) / 2.0)
    scale = initializer.scale / max(1.0, fan)
    if initializer.distribution == "truncated_normal":
        # As Keras: the deviation before truncation, corrected for it.
        return "truncated", 0.0, math.sqrt(scale) / 0.87962566103423978
    if initializer.distribution == "untruncated_normal":
        return "normal", 0.0, math.sqrt(scale)
    limit = math.sqrt(3.0 * scale)
    return "uniform", -limit, limit


def key_values(initializer, words, dim, dtype, seed, fans):
    """``[m, dim]`` first vectors of the keys ``words`` (int32 ``[m, 2]``)
    for a `per_key` ``initializer`` with the layer's integer ``seed``."""
    u = key_uniforms(words, seed, dim)
    kind, a, b = _distribution(initializer, fans)
    if kind == "uniform":
        values = a + u * (b - a)
    else:
        values = _normal(u, a, b, kind == "truncated")
    return ops.cast(values, dtype)


def keyed_fresh_values(initializer, fresh, words, dim, dtype, seed, fans):
    """``[n, dim]`` values; the rows at ``fresh`` positions are the first
    vectors of their keys (``words``: int32 ``[n, 2]``, high and low word of
    each position's key; ``seed``: the layer's integer seed). Rows at other
    positions are arbitrary. ``initializer`` must be `per_key`."""
    n = fresh.shape[0]
    n = ops.shape(fresh)[0] if n is None else int(n)
    fresh_int = ops.cast(fresh, "int32")
    ends = ops.cumsum(fresh_int)
    count = ops.sum(fresh_int)
    sizes = fresh_rows.draw_sizes(n)
    sized = fresh_rows.sized_draws()

    def branch(size):
        def values():
            if not sized:  # every position, no branch: no compaction
                return key_values(initializer, words, dim, dtype, seed, fans)
            # The k-th fresh position is the first where `ends` reaches k + 1.
            wanted = ops.arange(1, size + 1, dtype="int32")
            at = ops.searchsorted(ends, wanted, side="left")
            at = ops.clip(ops.cast(at, "int32"), 0, n - 1)
            drawn = key_values(
                initializer, take_rows(words, at), dim, dtype, seed, fans
            )
            return take_rows(drawn, ops.clip(ends - 1, 0, size - 1))

        return values

    return count_buckets.switch_on_count(count, sizes, branch, sized)


def folded_fresh_values(initializer, fresh, words, dim, dtype, seed, fans):
    """Key-sharded JAX layers with a seeded initializer that is not
    `per_key`: each fresh key draws ``initializer`` at ``(dim,)`` with the
    step's ``seed`` folded with its two words (a function of the step and
    the key, not of the device count). Runs per device inside ``shard_map``."""
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
        return fresh_rows.draw(initializer, (dim,), dtype, key_seed, fans)

    def branch(size):
        def values():
            picked = take_rows(words, order[:size])
            drawn = jax.vmap(one)(picked)
            return take_rows(drawn, ops.clip(rank, 0, size - 1))

        return values

    sizes = fresh_rows.draw_sizes(n)
    return count_buckets.switch_on_count(count, sizes, branch, fresh_rows.sized_draws())
