"""JAX: the row-sharded lookup (``P(axis, None)`` table), forward and backward.

The ids travel to their owners in one ``all_to_all``, the rows come back in
the mirror one; in the backward pass the row gradients travel the same way
and each owner applies the sparse optimizer to its shard (see
`jax_sharded_lookup` for the whole scheme). Buffer sizes, slot packing and
the overflow check are in `jax_row_buffers`.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from keras_sparse.ops.jax.lookup import chained_state
from keras_sparse.ops.jax.lookup import instantiate
from keras_sparse.ops.jax.lookup import primal_values
from keras_sparse.ops.row_rounding import to_compute
from keras_sparse.sharding import exchange_buckets as buckets
from keras_sparse.sharding.jax_row_buffers import check_capacity
from keras_sparse.sharding.jax_row_buffers import distinct_slots
from keras_sparse.sharding.jax_row_buffers import row_capacity
from keras_sparse.sharding.jax_shard_common import check_divisible
from keras_sparse.sharding.jax_shard_common import smap
from keras_sparse.sharding.jax_shard_common import update_owned_rows


def _row_exchange_ids(axis, d, shard_rows, ids, valid, capacity, given_slot=None):
    """Local half: [n] ids -> (owner [n], slot [n], received ids [D, C]).

    ``given_slot``: the packing computed ahead of the step (and checked for
    overflow there), or None to compute it here.
    """
    n = ids.shape[0]
    owner = jnp.where(valid, ids // shard_rows, -1)
    if capacity >= n:
        # A slot per local position: nothing can overflow or collide.
        slot = jnp.arange(n, dtype=owner.dtype)
        guard = None
        dest = jnp.arange(d, dtype=owner.dtype)[:, None]
        send = jnp.where(owner[None, :] == dest, ids[None, :], -1)  # [D, n]
    elif given_slot is not None:
        slot = jnp.where(valid, given_slot.astype(owner.dtype), 0)
        guard = None
    elif buckets.DEDUP_EXCHANGE:
        # One slot per distinct id: repeats write the same id into it.
        slot, fill = distinct_slots(ids, valid, d, shard_rows)
        slot = slot.astype(owner.dtype)
        guard = check_capacity(axis, jnp.max(fill), capacity)
    else:
        # Pack each destination's ids (in local order) into its C slots.
        hit = (owner[None, :] == jnp.arange(d, dtype=owner.dtype)[:, None]).astype(
            jnp.int32
        )
        before = jnp.cumsum(hit, axis=1) - hit  # [D, n]
        slot = jnp.where(valid, before[jnp.clip(owner, 0, d - 1), jnp.arange(n)], 0)
        worst = jnp.max(jnp.where(valid, slot + 1, 0))
        guard = check_capacity(axis, worst, capacity)
    if capacity < n:
        target = jnp.where(valid & (slot < capacity), owner, d)  # d: dropped
        send = (
            jnp.full((d, capacity), -1, ids.dtype)
            .at[target, slot]
            .set(ids, mode="drop")
        )
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # recv[s] = ids from source s
    return owner, slot, recv, guard


def _row_forward_local(axis, d, table, ids, valid, capacity, given_slot=None):
    shard_rows = table.shape[0]
    owner, slot, recv, guard = _row_exchange_ids(
        axis, d, shard_rows, ids, valid, capacity, given_slot
    )
    me = jax.lax.axis_index(axis)
    recv_valid = recv >= 0
    local = jnp.where(recv_valid, recv - me * shard_rows, 0)
    vec = jnp.take(table, local, axis=0)  # [D, C, dim]
    vec = jnp.where(recv_valid[..., None], vec, jnp.zeros((), table.dtype))
    back = jax.lax.all_to_all(vec, axis, 0, 0)  # back[o] = answers of owner o
    rows = back[jnp.clip(owner, 0, d - 1), jnp.clip(slot, 0, back.shape[1] - 1)]
    rows = jnp.where((owner >= 0)[:, None], rows, jnp.zeros((), table.dtype))
    if guard is not None:
        rows = rows + guard.astype(rows.dtype)
    return to_compute(rows), owner, slot, recv


def _row_forward(
    mesh, axis, table, ids, valid, slack, given_slot, outputs, capacity=None
):
    """Runs `_row_forward_local` on every device; its first ``outputs`` results.
    ``capacity``: slots per destination instead of the slack's (with
    ``given_slot``, which must fit it)."""
    d = mesh.shape[axis]
    check_divisible("table rows", table.shape[0], d)
    check_divisible("number of ids", ids.shape[0], d)
    n = ids.shape[0] // d
    if capacity is None:
        capacity = row_capacity(n, d, slack)
    capacity = max(1, min(int(capacity), n))
    args, specs = (table, ids, valid), (P(axis, None), P(axis), P(axis))
    if given_slot is not None:
        args, specs = args + (given_slot,), specs + (P(axis),)

    def local(*args):
        return _row_forward_local(axis, d, *args[:3], capacity, *args[3:])[:outputs]

    return smap(local, mesh, specs, (P(axis),) * outputs)(*args)


def row_gather(
    mesh, axis, table, ids, valid, slack=None, exchange_slot=None, capacity=None
):
    """Row-sharded gather, differentiable by JAX (dense table gradient)."""
    return _row_forward(
        mesh, axis, table, ids, valid, slack, exchange_slot, 1, capacity
    )[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def row_lookup(cfg, table, slots, ids, valid, iterations, exchange_slot):
    """``(rows, table, slots)``; the state passed on as in `jax_lookup._lookup`."""
    rows = row_gather(
        cfg.mesh, cfg.axis, table, ids, valid, cfg.slack, exchange_slot, cfg.capacity
    )
    return rows, table, slots


def _row_fwd(cfg, table, slots, ids, valid, iterations, exchange_slot):
    table, slots, ids, valid, iterations, exchange_slot = primal_values(
        (table, slots, ids, valid, iterations, exchange_slot)
    )
    rows, owner, slot, recv = _row_forward(
        cfg.mesh, cfg.axis, table, ids, valid, cfg.slack, exchange_slot, 4,
        cfg.capacity,
    )  # fmt: skip
    return (rows, table, slots), (table, slots, owner, slot, recv, iterations)


def _row_bwd(cfg, residuals, cotangents):
    table, slots, owner, slot, recv, iterations = residuals
    grads, table_after, slots_after = cotangents
    table, slots, _ = chained_state(table, slots, table_after, slots_after)
    if not cfg.apply_update:  # inference under a gradient: state unchanged
        return table, dict(slots), None, None, None, None
    grads = instantiate(grads)
    axis, d = cfg.axis, cfg.num_shards
    slot_names = tuple(slots)

    def local(table, slot_vals, owner, slot, recv, grads, iterations):
        shard_rows = table.shape[0]
        n, capacity = owner.shape[0], recv.shape[1]
        if capacity < n:
            # Positions sharing a slot (one distinct id) are summed here, in
            # local order: one gradient row per distinct id leaves the device.
            target = jnp.where((owner >= 0) & (slot < capacity), owner, d)
            send = (
                jnp.zeros((d, capacity, grads.shape[-1]), grads.dtype)
                .at[target, slot]
                .add(grads, mode="drop")
            )
        else:
            dest = jnp.arange(d, dtype=owner.dtype)[:, None, None]
            send = jnp.where(owner[None, :, None] == dest, grads[None], 0)  # [D,n,dim]
        got = jax.lax.all_to_all(send, axis, 0, 0)  # got[s] = grads from s
        me = jax.lax.axis_index(axis)
        recv_valid = recv >= 0
        local_ids = jnp.where(recv_valid, recv - me * shard_rows, 0).reshape(-1)
        state = {"table": table, **dict(zip(slot_names, slot_vals))}
        new = update_owned_rows(
            cfg,
            state,
            local_ids,
            recv_valid.reshape(-1),
            got.reshape(-1, got.shape[-1]),
            iterations,
            shard_rows,
            me * shard_rows,
        )
        return new["table"], tuple(new[k] for k in slot_names)

    row_spec = P(axis, None)
    new_table, new_slots = smap(
        local,
        cfg.mesh,
        (
            row_spec,
            tuple(row_spec for _ in slot_names),
            P(axis),
            P(axis),
            P(axis),
            P(axis),
            P(),
        ),
        (row_spec, tuple(row_spec for _ in slot_names)),
    )(
        table,
        tuple(slots[k] for k in slot_names),
        owner,
        slot,
        recv,
        grads,
        iterations,
    )
    return new_table, dict(zip(slot_names, new_slots)), None, None, None, None


row_lookup.defvjp(_row_fwd, _row_bwd, symbolic_zeros=True)
