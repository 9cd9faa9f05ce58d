"""A table sharded over a JAX device mesh axis (`TablePlacement` on JAX).

Made per call by `routing.route` from the active
``ModelParallel`` distribution (a distribution may be set after a layer is
built: the variables are global arrays whose layout changes, not their
shape). Lookups run the ``shard_map`` primitives of `jax_sharded_lookup`.
"""

import dataclasses
import functools
from typing import Any

from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState


def lookup_strategy(strategy):
    """The lookup primitive of a strategy: a key-sharded layer's rows are
    global rows of a row-sharded table."""
    return "row" if strategy == "key" else strategy


def lookup_slack(strategy, slack):
    """Exchange slack of the row lookup. Key sharding's slack sizes its key
    exchange (distinct keys, spread by hash); its row lookup uses that
    exchange's buffers (`lookup_capacity`) or else full-size ones (a hot
    key's positions all go to one owner)."""
    return None if strategy == "key" else slack


def lookup_capacity(strategy, slack, num_ids, devices, exchange_slot):
    """Row slots per destination of a key-sharded layer's row lookup, or
    None (the slack's). Its key exchange (`jax_key_mapping.map_keys`) gave
    each device's distinct keys of an owner at most `key_capacity` slots
    and each position its key's ``exchange_slot``; a key's row lives on the
    key's owner, so the row exchange sends each distinct row once in the
    same slots (repeated keys share one, their gradients summed on the
    sender)."""
    if strategy != "key" or exchange_slot is None:
        return None
    from keras_sparse.sharding.jax_key_mapping import key_capacity

    return key_capacity(int(num_ids) // devices, devices, slack)


@dataclasses.dataclass(frozen=True)
class JaxMeshPlacement:
    """``strategy`` ("row", "column", "key") over ``axis`` of ``mesh`` (a
    ``jax.sharding.Mesh``); ``slack`` sizes compact row-exchange buffers
    (None: full size, see `keras_sparse.sharding.distribution`)."""

    strategy: str
    mesh: Any
    axis: str
    slack: Any = None

    @property
    def devices(self):
        return int(self.mesh.shape[self.axis])

    def lookup(self, state: TableState, batch: LookupBatch):
        """A drop-in for ``ops.jax.lookup.lookup`` (``blocks`` and
        ``segments`` are not used: no stack or input stage reaches a
        sharded table's update)."""
        from keras_sparse.ops.jax import lookup as jax_lookup
        from keras_sparse.sharding import jax_sharded_lookup

        # ``state.anchor_var`` is not used: the table carries the update on JAX.
        table_var, slot_vars = state.table_var, state.slot_vars
        strategy = lookup_strategy(self.strategy)
        table = table_var.value
        slots = {name: var.value for name, var in slot_vars.items()}
        if batch.reset is not None:
            table, slots = self._reset(state, table, slots, batch)
        rows, table, slots = jax_sharded_lookup.sharded_lookup_with_sparse_update(
            strategy,
            self.mesh,
            self.axis,
            table,
            slots,
            state.optimizer,
            batch.ids,
            batch.valid,
            batch.iterations,
            state.constraint,
            apply_update=batch.apply_update,
            slack=lookup_slack(self.strategy, self.slack),
            exchange_slot=batch.exchange_slot,
            with_state=True,
            stochastic=state.stochastic_rounding,
            capacity=self._capacity(batch),
        )
        jax_lookup.pass_on(table_var, table, slot_vars, slots)
        return rows

    def _reset(self, state, table, slots, batch):
        """Applies ``batch.reset=(mask, values)`` to the sharded table and
        slots.

        Mirrors ``ops.jax.lookup.lookup``: done functionally (identity
        backward) so the sharded lookup's update lands on the reset table;
        outside a trace the reset is also assigned to the variables.
        """
        import jax

        from keras_sparse.sharding import jax_sharded_reset

        mask, values = batch.reset
        specs = state.optimizer.slot_specs()
        slot_inits = {spec.name: spec.initial_value for spec in specs}
        reset = jax_sharded_reset.sharded_reset(
            lookup_strategy(self.strategy),
            self.mesh,
            self.axis,
            {"table": table, **slots},
            batch.ids,
            mask,
            values,
            slot_inits,
            # Key sharding: fresh rows travel in its exchange's slots.
            exchange_slot=batch.exchange_slot if self.strategy == "key" else None,
            capacity=self._capacity(batch),
        )
        table = reset.pop("table")
        if not isinstance(table, jax.core.Tracer):
            state.table_var.assign(table)
            for name, var in state.slot_vars.items():
                var.assign(reset[name])
        return table, reset

    def map_keys(self, layer, keys, use, insert, draw=None):
        """The `KeyMapper` of a key-sharded hash layer: `MappedKeys`
        ``(rows, fresh, init)`` of its traced flat ``keys`` (see
        `jax_key_mapping.map_keys`)."""
        from keras_sparse.layers import jax_key_queue
        from keras_sparse.layers.hash.jax_step_mapping import step_failures
        from keras_sparse.sharding import jax_key_mapping

        routing = jax_key_mapping.KeyRouting(
            layer.table,
            functools.partial(jax_key_queue.restore_part, layer),
            self.mesh,
            self.axis,
            self.slack,
            layer.name,
            step_failures(layer),
            getattr(layer, "row_tier", None),
        )
        return jax_key_mapping.map_keys(routing, keys, use, insert, draw)

    def gather(self, table_var, batch: LookupBatch):
        from keras_sparse.sharding import jax_sharded_lookup

        return jax_sharded_lookup.sharded_gather(
            lookup_strategy(self.strategy),
            self.mesh,
            self.axis,
            table_var.value,
            batch.ids,
            batch.valid,
            lookup_slack(self.strategy, self.slack),
            batch.exchange_slot,
            self._capacity(batch),
        )

    def _capacity(self, batch):
        return lookup_capacity(
            self.strategy, self.slack, batch.ids.shape[0], self.devices,
            batch.exchange_slot,
        )  # fmt: skip
