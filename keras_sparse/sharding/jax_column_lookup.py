"""JAX: the column-sharded lookup (``P(None, axis)`` table), forward and backward.

Every device holds ``dim / D`` columns of every row: the forward pass
gathers all ids, looks up its column slice for each and returns every device
its ids' slices; the backward pass sends the gradient slices back and each
device applies the (element-wise) optimizer to its columns.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from keras_sparse.ops.jax.lookup import chained_state
from keras_sparse.ops.jax.lookup import instantiate
from keras_sparse.ops.jax.lookup import primal_values
from keras_sparse.ops.row_rounding import to_compute
from keras_sparse.sharding.jax_shard_common import check_divisible
from keras_sparse.sharding.jax_shard_common import smap
from keras_sparse.sharding.jax_shard_common import update_owned_rows


def _column_forward_local(axis, d, table, ids, valid):
    all_ids = jax.lax.all_gather(ids, axis, tiled=True)  # [D * n]
    all_valid = jax.lax.all_gather(valid, axis, tiled=True)
    vec = jnp.take(table, jnp.where(all_valid, all_ids, 0), axis=0)
    vec = jnp.where(all_valid[:, None], vec, jnp.zeros((), table.dtype))
    n, dc = ids.shape[0], table.shape[1]
    back = jax.lax.all_to_all(vec.reshape(d, n, dc), axis, 0, 0)  # [D(col), n, dc]
    rows = jnp.transpose(back, (1, 0, 2)).reshape(n, d * dc)
    return to_compute(rows), all_ids, all_valid


def column_gather(mesh, axis, table, ids, valid):
    """Column-sharded gather, differentiable by JAX (dense table gradient)."""
    d = mesh.shape[axis]
    check_divisible("embedding dim", table.shape[1], d)
    check_divisible("number of ids", ids.shape[0], d)

    def local(table, ids, valid):
        return _column_forward_local(axis, d, table, ids, valid)[0]

    return smap(local, mesh, (P(None, axis), P(axis), P(axis)), P(axis))(
        table, ids, valid
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def column_lookup(cfg, table, slots, ids, valid, iterations):
    """``(rows, table, slots)``; the state passed on as in `jax_lookup._lookup`."""
    return column_gather(cfg.mesh, cfg.axis, table, ids, valid), table, slots


def _column_fwd(cfg, table, slots, ids, valid, iterations):
    table, slots, ids, valid, iterations = primal_values(
        (table, slots, ids, valid, iterations)
    )
    d, axis = cfg.num_shards, cfg.axis
    check_divisible("embedding dim", table.shape[1], d)
    check_divisible("number of ids", ids.shape[0], d)

    def local(table, ids, valid):
        rows, all_ids, all_valid = _column_forward_local(axis, d, table, ids, valid)
        # Every device holds the same gathered ids; keep one copy per device.
        return rows, all_ids[None], all_valid[None]

    rows, all_ids, all_valid = smap(
        local,
        cfg.mesh,
        (P(None, axis), P(axis), P(axis)),
        (P(axis), P(axis), P(axis)),
    )(table, ids, valid)
    return (rows, table, slots), (table, slots, all_ids, all_valid, iterations)


def _column_bwd(cfg, residuals, cotangents):
    table, slots, all_ids, all_valid, iterations = residuals
    grads, table_after, slots_after = cotangents
    table, slots, _ = chained_state(table, slots, table_after, slots_after)
    if not cfg.apply_update:  # inference under a gradient: state unchanged
        return table, dict(slots), None, None, None
    grads = instantiate(grads)
    axis, d = cfg.axis, cfg.num_shards
    slot_names = tuple(slots)

    def local(table, slot_vals, all_ids, all_valid, grads, iterations):
        n, dc = grads.shape[0], table.shape[1]
        send = jnp.transpose(grads.reshape(n, d, dc), (1, 0, 2))  # [D(col), n, dc]
        got = jax.lax.all_to_all(send, axis, 0, 0)  # got[s] = my cols, s's ids
        state = {"table": table, **dict(zip(slot_names, slot_vals))}
        new = update_owned_rows(
            cfg,
            state,
            all_ids[0],
            all_valid[0],
            got.reshape(d * n, dc),
            iterations,
            table.shape[0],
        )
        return new["table"], tuple(new[k] for k in slot_names)

    col_spec = P(None, axis)
    new_table, new_slots = smap(
        local,
        cfg.mesh,
        (col_spec, tuple(col_spec for _ in slot_names), P(axis), P(axis), P(axis), P()),
        (col_spec, tuple(col_spec for _ in slot_names)),
    )(table, tuple(slots[k] for k in slot_names), all_ids, all_valid, grads, iterations)
    return new_table, dict(zip(slot_names, new_slots)), None, None, None


column_lookup.defvjp(_column_fwd, _column_bwd, symbolic_zeros=True)
