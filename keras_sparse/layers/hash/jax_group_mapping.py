"""One callback for all hash fields of a compiled JAX step.

`keras_sparse.layers.hash.jax_step_mapping` gives each `DistributedHashEmbedding`
its own callback, so a model with 26 hash fields makes 26 table calls per
step. A `HashEmbeddingCollection` maps its fields' keys together instead:
their flat keys and masks are concatenated in the step, one callback
receives them, and on a GPU the tables run as one kernel launch (one block
per table, `keras_sparse.table.step_rows_together`). Each table still
sees exactly its own field's keys, so rows, fresh flags and counts equal
those of separate layers.

The route is chosen as for one layer (`jax_step_mapping.choose_route`), and
must be the same for every field; the owner (the collection) must be called
once per step, because in-place callbacks run unordered.
"""

from __future__ import annotations

import numpy as np

from keras_sparse.layers import jax_key_queue
from keras_sparse.layers.hash import jax_step_mapping
from keras_sparse.layers.hash.key_mapper import MappedKeys
from keras_sparse.ops.key_hash import step_words


def group_route(owner, layers):
    """The route shared by all ``layers`` (called inside ``owner``), or None
    when they differ (then each field is mapped by its own layer)."""
    routes = {jax_step_mapping.choose_route(layer) for layer in layers}
    if len(routes) != 1:
        return None
    route = routes.pop()
    if route != "io_callback" and not jax_step_mapping._called_once(owner):
        return "io_callback"  # ordered: two calls of the owner keep their order
    return route


def _bounds(sizes):
    ends = np.cumsum(sizes)
    return [(int(e - s), int(e)) for s, e in zip(sizes, ends)]


def _host_rows(layers, bounds, keys, use, insert, out):
    for layer, (a, b) in zip(layers, bounds):
        layer._map_step_keys(keys[a:b], use[a:b], insert, tuple(o[a:b] for o in out))


def _as_int64(keys, xp, copy=True):
    """Flat int64 keys (uint64 reinterpreted); a copy unless ``copy=False``
    and they are int64 already (then XLA's buffer: read only)."""
    if keys.dtype == xp.uint64:
        keys = keys.view(xp.int64)
        return keys.copy() if copy else keys
    return keys.astype(xp.int64, copy=copy)


def _restore_together(layers, bounds, keys, cp):
    """The step's flat ``keys`` (XLA's buffer on the device) as int64, with
    the full 64-bit keys of every field that has queued keys (JAX without
    x64).

    Restored keys exist only for int32 step keys; XLA's own buffer is never
    written. When each field's oldest queued batch is this step's (the usual
    order), all fields take one copy to the device and one host read of the
    check, instead of two syncs per field; otherwise each field finds its
    batch itself (`jax_key_queue.restore`, which skips batches queued ahead,
    e.g. for validation).
    """
    queued = [i for i, layer in enumerate(layers) if jax_key_queue.has_queued(layer)]
    if not queued:
        return _as_int64(keys, cp, copy=False)
    queues = [jax_key_queue.key_queue(layers[i]) for i in queued]
    heads = [q.head() for q in queues]
    spans = [bounds[i] for i in queued]
    every = len(queued) == len(layers)
    if keys.dtype in (cp.int32, cp.uint32) and all(
        h is not None and h.size == b - a for h, (a, b) in zip(heads, spans)
    ):
        full = cp.asarray(np.concatenate(heads))
        words = keys.view(cp.int32)  # uint64 keys reach the step as uint32
        low = words if every else cp.concatenate([words[a:b] for a, b in spans])
        # The low 32-bit words of the little-endian int64 keys, as a view.
        if bool((full.view(cp.int32)[::2] == low).all()):
            for q, h in zip(queues, heads):
                q.remove(h)
            if every:
                return full
            flat = _as_int64(keys, cp)
            at = 0
            for a, b in spans:
                flat[a:b] = full[at : at + b - a]
                at += b - a
            return flat
    flat = _as_int64(keys, cp)
    for i, (a, b) in zip(queued, spans):
        flat[a:b] = jax_key_queue.restore(layers[i], flat[a:b], cp)
    return flat


def _gpu_rows(layers, bounds, keys, use, insert, out):
    """Every field's rows on the current CuPy stream: one launch for the
    tables that can take part (`step_rows_together`), then one call per
    table for the others."""
    import cupy as cp

    from keras_sparse.table import step_rows_together

    flat = _restore_together(layers, bounds, cp.asarray(keys).reshape(-1), cp)
    use = cp.asarray(use).reshape(-1).astype(bool, copy=False)
    if len(out) == 3:  # the keys' high words
        out[2][...] = (flat.astype(cp.int64, copy=False) >> 32).astype(cp.int32)
        out = out[:2]
    left = range(len(layers))
    if insert:
        tables = [layer.table for layer in layers]
        left = step_rows_together(tables, flat, use, bounds, out)
    for i in left:
        (a, b), layer = bounds[i], layers[i]
        layer._table_rows(flat[a:b], use[a:b], insert, cp, (out[0][a:b], out[1][a:b]))


def map_group_in_step(owner, layers, keys, use, insert, route, words=False):
    """A `MappedKeys` (rows int32, fresh bool) per layer of traced flat
    ``keys`` / ``use`` (one array per layer, one dtype, static sizes), by
    one callback; with ``words``, each key's high and low word too (int32
    ``[n, 2]``, see `jax_step_mapping.rows_in_step`)."""
    import jax.numpy as jnp

    bounds = _bounds([int(k.shape[0]) for k in keys])
    n = bounds[-1][1]

    def host_rows(k, u, out):
        _host_rows(layers, bounds, k, u, insert, out)

    def gpu_rows(k, u, out):
        _gpu_rows(layers, bounds, k, u, insert, out)

    flat = jnp.concatenate(keys)
    mapped = jax_step_mapping.rows_in_step(
        owner,
        route,
        flat,
        jnp.concatenate([u.astype(bool) for u in use]),
        n,
        host_rows,
        gpu_rows,
        words,
    )
    if not words:
        return [MappedKeys(mapped[0][a:b], mapped[1][a:b]) for a, b in bounds]
    rows, fresh, high = mapped
    both = step_words(high, flat)
    return [MappedKeys(rows[a:b], fresh[a:b], both[a:b]) for a, b in bounds]
