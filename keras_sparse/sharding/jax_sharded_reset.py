"""Re-initializing rows of a sharded table on the devices holding them.

``sharded_reset`` re-initializes rows (a `DistributedHashEmbedding`'s fresh
rows) on their owners before a lookup, in global batch order like the
single-device ``jax_lookup.reset_rows``. Given a key-sharded layer's
exchange packing, each device sends only its fresh rows, to their owners,
in that packing's slots (see `sharded_reset`).
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from keras_sparse.ops.jax.row_writes import write_rows
from keras_sparse.sharding.jax_shard_common import check_divisible
from keras_sparse.sharding.jax_shard_common import smap


class ResetConfig:
    """Hashable static part of `sharded_reset`: where and what to reset."""

    def __init__(self, strategy, mesh, axis, slot_inits, capacity=None):
        self.strategy = strategy
        self.mesh = mesh
        self.axis = axis
        self.slot_inits = tuple(sorted(dict(slot_inits).items()))
        self.capacity = None if capacity is None else int(capacity)

    @property
    def num_shards(self):
        return self.mesh.shape[self.axis]

    def _key(self):
        return (
            self.strategy, id(self.mesh), self.axis, self.slot_inits, self.capacity
        )  # fmt: skip

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, ResetConfig) and self._key() == other._key()


def _scatter_reset(state, slot_inits, target, values):
    """Writes ``values`` (table) and the slots' initial values at ``target``.

    Positions are applied in global batch order, the order of the
    single-device ``jax_lookup.reset_rows``, so duplicate rows resolve alike.
    """
    out = {}
    for name, array in state.items():
        if name == "table":
            new = values
        else:
            new = jnp.full((target.shape[0], array.shape[1]), slot_inits[name])
        out[name] = write_rows(array, target, new)  # initial values
    return out


def _row_reset_local(cfg, state, ids, mask, values):
    axis = cfg.axis
    shard_rows = state["table"].shape[0]
    # Every device sees the whole batch's resets (global order) and keeps the
    # rows it owns.
    all_ids = jax.lax.all_gather(ids, axis, tiled=True)
    all_mask = jax.lax.all_gather(mask, axis, tiled=True)
    all_values = jax.lax.all_gather(values, axis, tiled=True)
    local = all_ids - jax.lax.axis_index(axis) * shard_rows
    mine = all_mask & (local >= 0) & (local < shard_rows)
    target = jnp.where(mine, local, shard_rows)  # out of range: dropped
    return _scatter_reset(state, dict(cfg.slot_inits), target, all_values)


def _compact_row_reset_local(cfg, state, ids, mask, values, slot):
    """Each device sends its fresh rows to their owners in ``[D, C]`` slots
    (``slot``: the key exchange's packing); no row is sent twice, so the
    writes need no order."""
    axis, d, c = cfg.axis, cfg.num_shards, cfg.capacity
    shard_rows = state["table"].shape[0]
    owner = ids // shard_rows
    send = mask & (ids >= 0) & (slot >= 0) & (slot < c)
    dest = jnp.where(send, owner, d)  # d: dropped
    local = jnp.where(send, ids - owner * shard_rows, -1)
    send_rows = jnp.full((d, c), -1, ids.dtype).at[dest, slot].set(local, mode="drop")
    send_values = (
        jnp.zeros((d, c, values.shape[1]), values.dtype)
        .at[dest, slot]
        .set(values, mode="drop")
    )
    rows = jax.lax.all_to_all(send_rows, axis, 0, 0).reshape(d * c)
    got = jax.lax.all_to_all(send_values, axis, 0, 0).reshape(d * c, -1)
    target = jnp.where(rows >= 0, rows, shard_rows)  # out of range: dropped
    return _scatter_reset(state, dict(cfg.slot_inits), target, got)


def _column_reset_local(cfg, state, ids, mask, values):
    axis, d = cfg.axis, cfg.num_shards
    num_rows, dc = state["table"].shape
    all_ids = jax.lax.all_gather(ids, axis, tiled=True)
    all_mask = jax.lax.all_gather(mask, axis, tiled=True)
    n = ids.shape[0]
    # My columns of every device's new rows: [D(source), n, dc] -> [D * n, dc].
    send = jnp.transpose(values.reshape(n, d, dc), (1, 0, 2))
    mine = jax.lax.all_to_all(send, axis, 0, 0).reshape(d * n, dc)
    target = jnp.where(all_mask, all_ids, num_rows)
    return _scatter_reset(state, dict(cfg.slot_inits), target, mine)


def _reset_impl(cfg, state, ids, mask, values, slot):
    d = cfg.mesh.shape[cfg.axis]
    check_divisible("number of ids", ids.shape[0], d)
    if cfg.capacity is not None:
        spec, local = P(cfg.axis, None), _compact_row_reset_local
    elif cfg.strategy == "row":
        spec, local = P(cfg.axis, None), _row_reset_local
    elif cfg.strategy == "column":
        spec, local = P(None, cfg.axis), _column_reset_local
    else:
        raise NotImplementedError(f"sharded reset for strategy {cfg.strategy!r}")
    state_spec = {name: spec for name in state}
    args = (dict(state), ids, mask, values)
    specs = (state_spec, P(cfg.axis), P(cfg.axis), P(cfg.axis, None))
    if cfg.capacity is not None:
        args, specs = args + (slot,), specs + (P(cfg.axis),)
    return smap(functools.partial(local, cfg), cfg.mesh, specs, state_spec)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sharded_reset(cfg, state, ids, mask, values, slot):
    return _reset_impl(cfg, state, ids, mask, values, slot)


def _sharded_reset_fwd(cfg, state, ids, mask, values, slot):
    return _reset_impl(cfg, state, ids, mask, values, slot), values


def _sharded_reset_bwd(cfg, values, grads):
    # Identity for the state: the lookup's backward hands back the whole
    # updated (already reset) table as the variable's new value, which must
    # reach the variable unchanged. See `jax_lookup.reset_rows`.
    return grads, None, None, jnp.zeros_like(values), None


_sharded_reset.defvjp(_sharded_reset_fwd, _sharded_reset_bwd)


def compact_reset_capacity(strategy, ids_per_device, exchange_slot, capacity):
    """Slots per destination of the compact reset, or None (the gathered
    one): row lookups given an exchange packing whose ``capacity`` is below
    the ids per device (else the gather moves no more)."""
    if strategy != "row" or exchange_slot is None or capacity is None:
        return None
    return int(capacity) if int(capacity) < int(ids_per_device) else None


def sharded_reset(
    strategy,
    mesh,
    axis,
    state,
    ids,
    mask,
    values,
    slot_inits,
    exchange_slot=None,
    capacity=None,
):
    """Re-initializes rows of a sharded table and its optimizer slots.

    The sharded twin of ``jax_lookup.reset_rows``: ``state`` maps "table" and
    each slot name to its sharded array; the rows ``ids[mask]`` get
    ``values[mask]`` (``[N, dim]``, batch-sharded like ``ids``) in the table
    and ``slot_inits[name]`` in every slot, each on the device(s) holding the
    row. The backward is the identity for ``state``. Row sharding all-gathers
    the batch's (id, flag, value) triples; column sharding all-gathers
    (id, flag) and sends each device its columns of the values.

    ``exchange_slot`` and ``capacity`` (row sharding, a key-sharded layer's
    key exchange, `jax_placement.lookup_capacity`): each masked position's
    slot among its device's distinct rows of the row's owner, below
    ``capacity``. Then each device sends only its masked rows, in ``[D,
    capacity]`` buffers by all-to-all (when ``capacity`` is below the ids
    per device: `compact_reset_capacity`). Exact where each row is masked
    at most once in the whole batch, as a key-sharded mapping's fresh
    flags are (a key's row is fresh at its first entry only): the writes
    then need no order.
    """
    d = mesh.shape[axis]
    n = int(ids.shape[0]) // d
    compact = compact_reset_capacity(strategy, n, exchange_slot, capacity)
    cfg = ResetConfig(strategy, mesh, axis, slot_inits, compact)
    slot = None
    if compact is not None:
        slot = jnp.asarray(exchange_slot, jnp.int32)
    return _sharded_reset(
        cfg,
        dict(state),
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(mask, bool),
        jnp.asarray(values),
        slot,
    )
