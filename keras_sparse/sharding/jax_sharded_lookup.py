"""JAX: sharded embedding lookups with the sparse update in the backward pass.

All functions take global (jit-level) arrays and run their communication
inside ``jax.shard_map`` over one mesh axis of size ``D``:

``row``    table laid out ``P(axis, None)``: device ``k`` owns rows
           ``[k * R, (k + 1) * R)`` with ``R = rows / D``. Forward: each device
           buckets its ``n`` local ids by owner (``id // R``) into a static
           ``[D, C]`` send buffer (``C`` slots per destination, -1 = empty),
           one ``all_to_all`` delivers them, owners gather from their shard,
           the mirror ``all_to_all`` returns ``[D, C, dim]`` vectors and each id
           picks its answer. ``C`` is `row_capacity`: ``n`` by default (a
           slot per local position: can never overflow), or
           ``ceil(n / D * slack)`` with an ``exchange slack`` (compact: about
           ``slack / D`` of the bytes). Compact buffers carry each device's
           DISTINCT ids once (`exchange_buckets.DEDUP_EXCHANGE`): an id's
           slot is the rank of its value among the device's distinct ids of
           that owner, so repeated positions share a slot and read the same
           answer, and the fill that must fit is the distinct count (skewed
           batches overflow far less). A bucket overflow raises an error
           when the step runs (never silently drops an id). Full-size
           buffers move the same bytes either way and keep a slot per
           position (no sort). An input stage may compute that packing on
           the host ahead of the step and pass it as ``exchange_slot``
           (`exchange_buckets.exchange_slots`, which also checks the fill
           there); the step then skips the packing and the overflow check.
           Backward: the row gradients travel the same way to the owners
           (compact buffers: each device first sums its positions'
           gradients per slot, in local order, one row per distinct id),
           which dedup + sum them over source devices and apply the sparse
           optimizer to their shard
           (``compute_row_updates``); the updated table and slot shards come
           back as the variables' "gradients" (the variables are
           ``overwrite_with_gradient``). An id's gradient is the sum over the
           global batch in batch order (source device major), as on one
           device; with compact buffers grouped by source device, so float
           rounding may differ from one device's in the last bits.
``column`` table laid out ``P(None, axis)``: every device holds ``dim / D``
           columns of every row. Forward: ``all_gather`` of the ids, local
           gather of the column slice for all ids, ``all_to_all`` returns each
           device its ids' slices. Backward: the mirror ``all_to_all`` of the
           gradient slices, then every device applies the (element-wise)
           optimizer to its columns. Row-wise slots / constraints need whole
           rows and are rejected.
``data``   replicated table: no routing needed; the single-device primitive
           runs under jit and XLA's partitioner combines the row gradients.

Row counts that do not divide by ``D`` are padded by the Keras side (the
variables get ``ceil(rows / D) * D`` rows), so here ``rows % D == 0`` always.
Fresh rows are re-initialized on their owners by `jax_sharded_reset`; the
bytes each exchange moves are in `jax_exchange_bytes`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from keras_sparse.ops.jax.lookup import chained_state
from keras_sparse.ops.jax.lookup import instantiate
from keras_sparse.ops.jax.lookup import primal_values
from keras_sparse.ops.jax.row_writes import write_rows
from keras_sparse.ops.row_rounding import to_compute
from keras_sparse.ops.row_rounding import write_seed
from keras_sparse.ops.row_updates import compute_row_updates
from keras_sparse.sharding import exchange_buckets as buckets
from keras_sparse.sharding.exchange_buckets import ExchangeOverflowError
from keras_sparse.sharding.exchange_buckets import overflow_message

try:  # jax >= 0.6
    _shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map


def _smap(fn, mesh, in_specs, out_specs):
    return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


class ShardConfig:
    """Hashable, identity-compared static part of a sharded lookup."""

    def __init__(
        self,
        mesh,
        axis,
        optimizer=None,
        constraint=None,
        apply_update=True,
        slack=None,
        stochastic=True,
        capacity=None,
    ):
        self.stochastic = bool(stochastic)
        self.capacity = None if capacity is None else int(capacity)
        self.dedup = buckets.DEDUP_EXCHANGE  # traces differ with the setting
        self.apply_update = bool(apply_update)
        self.slack = None if slack is None else float(slack)
        self.mesh = mesh
        self.axis = axis
        self.optimizer = optimizer
        self.constraint = constraint

    @property
    def num_shards(self):
        return self.mesh.shape[self.axis]

    def _key(self):
        return (
            id(self.mesh),
            self.axis,
            id(self.optimizer),
            id(self.constraint),
            self.apply_update,
            self.slack,
            self.stochastic,
            self.dedup,
            self.capacity,
        )

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, ShardConfig) and (
            self.mesh is other.mesh
            and self.axis == other.axis
            and self.optimizer is other.optimizer
            and self.constraint is other.constraint
            and self.apply_update == other.apply_update
            and self.slack == other.slack
            and self.stochastic == other.stochastic
            and self.dedup == other.dedup
            and self.capacity == other.capacity
        )


def _check_divisible(what, size, d):
    if size % d:
        raise ValueError(
            f"Sharded lookup: {what} ({size}) must be divisible by the number "
            f"of shards ({d})."
        )


def _apply_update(cfg, state, ids, valid, grads, iterations, num_rows, first_row=0):
    """Dedup + optimizer on the local shard; returns the updated arrays.
    ``first_row``: the shard's first global row (its rounding bits)."""
    slot_names = tuple(k for k in state if k != "table")
    unique_ids, is_real, new_values = compute_row_updates(
        cfg.optimizer,
        lambda name, rows: jnp.take(state[name], rows, axis=0),
        slot_names,
        ids,
        valid,
        grads,
        iterations,
        num_rows,
        cfg.constraint,
    )
    target = jnp.where(is_real, unique_ids, num_rows)  # out of range: dropped
    return {
        name: write_rows(
            state[name], target, new_values[name],
            write_seed(iterations, name, cfg.stochastic), first_row,
        )
        for name in state
    }  # fmt: skip


# ------------------------------------------------------------------- row-wise
def row_capacity(ids_per_device, num_devices, slack=None):
    """Slots per destination in the row exchange buffers.

    ``slack=None``: ``ids_per_device`` (the full, overflow-free bound);
    otherwise ``ceil(ids_per_device / num_devices * slack)``, at most
    ``ids_per_device``.
    """
    n = int(ids_per_device)
    if slack is None:
        return n
    if slack <= 0:
        raise ValueError(f"exchange slack must be > 0; got {slack}.")
    return max(1, min(n, math.ceil(n / num_devices * slack)))


__all__ = ["ExchangeOverflowError"]  # re-exported: raised by the step


def _raise_overflow(count, capacity, me, ids):
    if int(count) <= int(capacity):  # pragma: no cover - only called on overflow
        return np.zeros((), np.int32)
    raise ExchangeOverflowError(overflow_message(count, capacity, me, ids=ids))


def _check_capacity(axis, local_worst, capacity):
    # The worst bucket over all devices (one 4-byte all-reduce), so that every
    # device raises together: a device left alone at the next collective
    # would wait for the others forever.
    worst = jax.lax.pmax(local_worst, axis)
    zero = jax.ShapeDtypeStruct((), jnp.int32)

    ids = "distinct ids" if buckets.DEDUP_EXCHANGE else "ids"  # what was counted

    def fail():
        return jax.pure_callback(
            functools.partial(_raise_overflow, ids=ids),
            zero,
            worst,
            capacity,
            jax.lax.axis_index(axis),
        )

    # Always 0; the looked-up rows depend on it, so the error surfaces with the
    # step's outputs (the loss) instead of only with the updated state.
    return jax.lax.cond(worst > capacity, fail, lambda: jnp.zeros((), jnp.int32))


# Up to this many ids per device, `_distinct_slots` compares all pairs
# (n^2 booleans) instead of sorting: XLA:CPU sorts cost milliseconds even
# for a few dozen ids.
_PAIRWISE_IDS = 512


def _distinct_slots_pairwise(key, valid, d, shard_rows):
    n = key.shape[0]
    same = key[:, None] == key[None, :]  # [n, n]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # j < i
    first = valid & ~jnp.any(same & earlier, axis=1)
    owner = key // shard_rows
    # Distinct ids of my owner smaller than mine.
    smaller = first[None, :] & (owner[None, :] == owner[:, None])
    slot = jnp.sum(smaller & (key[None, :] < key[:, None]), axis=1)
    slot = jnp.where(valid, slot, 0).astype(jnp.int32)
    group = jnp.where(first, owner, d)
    fill = jax.ops.segment_sum(first.astype(jnp.int32), group, num_segments=d + 1)
    return slot, fill[:d]


def _distinct_slots(ids, valid, d, shard_rows):
    """``(slot [n], fill [D])``: each position's slot is the rank of its id
    among this device's distinct ids of the same owner (ascending ids);
    ``fill`` counts the distinct ids per owner. Invalid positions: slot 0."""
    n = ids.shape[0]
    end = d * shard_rows  # sorts after every real id
    key = jnp.where(valid, ids, end)
    if n <= _PAIRWISE_IDS:
        return _distinct_slots_pairwise(key, valid, d, shard_rows)
    bits = max(1, (n - 1).bit_length())
    if (end + 1) << bits <= 1 << 32:
        # One single-operand sort of ``id << bits | position`` (XLA:CPU runs
        # a comparator per comparison: one operand is the cheaper sort).
        packed = (key.astype(jnp.uint32) << bits) | jnp.arange(n, dtype=jnp.uint32)
        packed = jnp.sort(packed)
        order = (packed & ((1 << bits) - 1)).astype(jnp.int32)
        srt = (packed >> bits).astype(key.dtype)
    else:
        order = jnp.argsort(key, stable=True)
        srt = key[order]
    real = srt < end
    first = jnp.concatenate([jnp.ones((1,), bool), srt[1:] != srt[:-1]]) & real
    rank = jnp.cumsum(first.astype(jnp.int32)) - 1  # among distinct ids
    group = jnp.where(real, srt // shard_rows, d)
    fill = jax.ops.segment_sum(first.astype(jnp.int32), group, num_segments=d + 1)
    fill = fill[:d]
    # Sorted ids: an owner's distinct ids are contiguous, after the lower ones.
    starts = jnp.cumsum(fill) - fill
    slot_sorted = jnp.where(real, rank - starts[jnp.clip(group, 0, d - 1)], 0)
    slot = jnp.zeros((n,), jnp.int32).at[order].set(slot_sorted.astype(jnp.int32))
    return slot, fill


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
        slot, fill = _distinct_slots(ids, valid, d, shard_rows)
        slot = slot.astype(owner.dtype)
        guard = _check_capacity(axis, jnp.max(fill), capacity)
    else:
        # Pack each destination's ids (in local order) into its C slots.
        hit = (owner[None, :] == jnp.arange(d, dtype=owner.dtype)[:, None]).astype(
            jnp.int32
        )
        before = jnp.cumsum(hit, axis=1) - hit  # [D, n]
        slot = jnp.where(valid, before[jnp.clip(owner, 0, d - 1), jnp.arange(n)], 0)
        worst = jnp.max(jnp.where(valid, slot + 1, 0))
        guard = _check_capacity(axis, worst, capacity)
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
    _check_divisible("table rows", table.shape[0], d)
    _check_divisible("number of ids", ids.shape[0], d)
    n = ids.shape[0] // d
    if capacity is None:
        capacity = row_capacity(n, d, slack)
    capacity = max(1, min(int(capacity), n))
    args, specs = (table, ids, valid), (P(axis, None), P(axis), P(axis))
    if given_slot is not None:
        args, specs = args + (given_slot,), specs + (P(axis),)

    def local(*args):
        return _row_forward_local(axis, d, *args[:3], capacity, *args[3:])[:outputs]

    return _smap(local, mesh, specs, (P(axis),) * outputs)(*args)


def row_gather(
    mesh, axis, table, ids, valid, slack=None, exchange_slot=None, capacity=None
):
    """Row-sharded gather, differentiable by JAX (dense table gradient)."""
    return _row_forward(
        mesh, axis, table, ids, valid, slack, exchange_slot, 1, capacity
    )[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _row_lookup(cfg, table, slots, ids, valid, iterations, exchange_slot):
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
        new = _apply_update(
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
    new_table, new_slots = _smap(
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


_row_lookup.defvjp(_row_fwd, _row_bwd, symbolic_zeros=True)


# ---------------------------------------------------------------- column-wise
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
    _check_divisible("embedding dim", table.shape[1], d)
    _check_divisible("number of ids", ids.shape[0], d)

    def local(table, ids, valid):
        return _column_forward_local(axis, d, table, ids, valid)[0]

    return _smap(local, mesh, (P(None, axis), P(axis), P(axis)), P(axis))(
        table, ids, valid
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _column_lookup(cfg, table, slots, ids, valid, iterations):
    """``(rows, table, slots)``; the state passed on as in `jax_lookup._lookup`."""
    return column_gather(cfg.mesh, cfg.axis, table, ids, valid), table, slots


def _column_fwd(cfg, table, slots, ids, valid, iterations):
    table, slots, ids, valid, iterations = primal_values(
        (table, slots, ids, valid, iterations)
    )
    d, axis = cfg.num_shards, cfg.axis
    _check_divisible("embedding dim", table.shape[1], d)
    _check_divisible("number of ids", ids.shape[0], d)

    def local(table, ids, valid):
        rows, all_ids, all_valid = _column_forward_local(axis, d, table, ids, valid)
        # Every device holds the same gathered ids; keep one copy per device.
        return rows, all_ids[None], all_valid[None]

    rows, all_ids, all_valid = _smap(
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
        new = _apply_update(
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
    new_table, new_slots = _smap(
        local,
        cfg.mesh,
        (col_spec, tuple(col_spec for _ in slot_names), P(axis), P(axis), P(axis), P()),
        (col_spec, tuple(col_spec for _ in slot_names)),
    )(table, tuple(slots[k] for k in slot_names), all_ids, all_valid, grads, iterations)
    return new_table, dict(zip(slot_names, new_slots)), None, None, None


_column_lookup.defvjp(_column_fwd, _column_bwd, symbolic_zeros=True)


# ----------------------------------------------------------------- public API
ROUTED_STRATEGIES = ("row", "column")


def sharded_lookup_with_sparse_update(
    strategy,
    mesh,
    axis,
    table,
    slots,
    optimizer,
    ids,
    valid,
    iterations,
    constraint=None,
    apply_update=True,
    slack=None,
    exchange_slot=None,
    with_state=False,
    stochastic=True,
    capacity=None,
):
    """Lookup whose backward applies the sparse optimizer on the owning shards.

    Returns ``[N, dim]`` rows; the "gradients" of ``table`` and ``slots`` are
    their updated values (for ``overwrite_with_gradient`` variables).
    ``with_state``: returns ``(rows, table, slots)``, the state passed on
    for a later call of the layer in the step (`jax_lookup.pass_on`).
    ``slack`` sizes the row exchange buffers (`row_capacity`);
    ``exchange_slot`` (row only, with a slack): each id's slot in its
    owner's buffer, from `exchange_buckets.exchange_slots`. ``capacity``:
    the row buffers' slots per destination instead of the slack's (with an
    ``exchange_slot`` that fits them: a key-sharded layer's key exchange,
    `jax_key_mapping.map_keys`).
    """
    cfg = ShardConfig(
        mesh, axis, optimizer, constraint, apply_update, slack, stochastic,
        capacity,
    )  # fmt: skip
    args = (
        table,
        dict(slots),
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(valid, bool),
        jnp.asarray(iterations, jnp.int32),
    )
    if strategy == "row":
        out = _row_lookup(cfg, *args, _slot_or_none(exchange_slot))
        return out if with_state else out[0]
    if strategy == "column":
        if constraint is not None:
            raise ValueError(
                "column sharding cannot apply an embeddings_constraint (it "
                "needs whole rows); use row sharding."
            )
        if any(v.shape[1] == 1 and table.shape[1] != 1 for v in slots.values()):
            raise ValueError(
                "column sharding needs an element-wise optimizer; row-wise "
                "slots (e.g. rowwise_adagrad) need whole rows. Use row sharding."
            )
        out = _column_lookup(cfg, *args)
        return out if with_state else out[0]
    raise NotImplementedError(f"sharded lookup for strategy {strategy!r}")


def _slot_or_none(exchange_slot):
    return None if exchange_slot is None else jnp.asarray(exchange_slot, jnp.int32)


def sharded_gather(
    strategy, mesh, axis, table, ids, valid, slack=None, exchange_slot=None,
    capacity=None,
):  # fmt: skip
    """Forward-only / dense-gradient sharded gather."""
    ids = jnp.asarray(ids, jnp.int32)
    valid = jnp.asarray(valid, bool)
    if strategy == "row":
        slot = _slot_or_none(exchange_slot)
        return row_gather(mesh, axis, table, ids, valid, slack, slot, capacity)
    if strategy == "column":
        return column_gather(mesh, axis, table, ids, valid)
    raise NotImplementedError(f"sharded gather for strategy {strategy!r}")
