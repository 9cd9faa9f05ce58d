"""JAX: pieces shared by the sharded lookups of `jax_sharded_lookup`.

The ``shard_map`` wrapper, the static `ShardConfig` of a lookup, the
divisibility check of its shapes and the sparse optimizer step an owning
shard applies to its rows (`jax_row_lookup`, `jax_column_lookup`).
"""

import jax
import jax.numpy as jnp

from keras_sparse.ops.jax.row_writes import write_rows
from keras_sparse.ops.row_rounding import write_seed
from keras_sparse.ops.row_updates import compute_row_updates
from keras_sparse.sharding import exchange_buckets as buckets

try:  # jax >= 0.6
    _shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map


def smap(fn, mesh, in_specs, out_specs):
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


def check_divisible(what, size, d):
    if size % d:
        raise ValueError(
            f"Sharded lookup: {what} ({size}) must be divisible by the number "
            f"of shards ({d})."
        )


def update_owned_rows(cfg, state, ids, valid, grads, iterations, num_rows, first_row=0):
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
