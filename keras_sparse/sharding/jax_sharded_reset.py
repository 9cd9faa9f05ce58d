"""Re-initializing rows of a sharded table on the devices holding them.

``sharded_reset`` re-initializes rows (a `DistributedHashEmbedding`'s fresh
rows) on their owners before a lookup, in global batch order like the
single-device ``jax_lookup.reset_rows``.
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

    def __init__(self, strategy, mesh, axis, slot_inits):
        self.strategy = strategy
        self.mesh = mesh
        self.axis = axis
        self.slot_inits = tuple(sorted(dict(slot_inits).items()))

    @property
    def num_shards(self):
        return self.mesh.shape[self.axis]

    def _key(self):
        return (self.strategy, id(self.mesh), self.axis, self.slot_inits)

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


def _reset_impl(cfg, state, ids, mask, values):
    d = cfg.mesh.shape[cfg.axis]
    check_divisible("number of ids", ids.shape[0], d)
    if cfg.strategy == "row":
        spec, local = P(cfg.axis, None), _row_reset_local
    elif cfg.strategy == "column":
        spec, local = P(None, cfg.axis), _column_reset_local
    else:
        raise NotImplementedError(f"sharded reset for strategy {cfg.strategy!r}")
    state_spec = {name: spec for name in state}
    return smap(
        functools.partial(local, cfg),
        cfg.mesh,
        (state_spec, P(cfg.axis), P(cfg.axis), P(cfg.axis, None)),
        state_spec,
    )(dict(state), ids, mask, values)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sharded_reset(cfg, state, ids, mask, values):
    return _reset_impl(cfg, state, ids, mask, values)


def _sharded_reset_fwd(cfg, state, ids, mask, values):
    return _reset_impl(cfg, state, ids, mask, values), values


def _sharded_reset_bwd(cfg, values, grads):
    # Identity for the state: the lookup's backward hands back the whole
    # updated (already reset) table as the variable's new value, which must
    # reach the variable unchanged. See `jax_lookup.reset_rows`.
    return grads, None, None, jnp.zeros_like(values)


_sharded_reset.defvjp(_sharded_reset_fwd, _sharded_reset_bwd)


def sharded_reset(strategy, mesh, axis, state, ids, mask, values, slot_inits):
    """Re-initializes rows of a sharded table and its optimizer slots.

    The sharded twin of ``jax_lookup.reset_rows``: ``state`` maps "table" and
    each slot name to its sharded array; the rows ``ids[mask]`` get
    ``values[mask]`` (``[N, dim]``, batch-sharded like ``ids``) in the table
    and ``slot_inits[name]`` in every slot, each on the device(s) holding the
    row. The backward is the identity for ``state``. Row sharding all-gathers
    the batch's (id, flag, value) triples; column sharding all-gathers
    (id, flag) and sends each device its columns of the values.
    """
    cfg = ResetConfig(strategy, mesh, axis, slot_inits)
    return _sharded_reset(
        cfg,
        dict(state),
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(mask, bool),
        jnp.asarray(values),
    )
