"""JAX: sharded embedding lookups with the sparse update in the backward pass.

All functions take global (jit-level) arrays and run their communication
inside ``jax.shard_map`` over one mesh axis of size ``D``:

``row``    table laid out ``P(axis, None)``: device ``k`` owns rows
           ``[k * R, (k + 1) * R)`` with ``R = rows / D``. Forward: each device
           buckets its ``n`` local ids by owner (``id // R``) into a static
           ``[D, C]`` send buffer (``C`` slots per destination, -1 = empty),
           one ``all_to_all`` delivers them, owners gather from their shard,
           the mirror ``all_to_all`` returns ``[D, C, dim]`` vectors and each id
           picks its answer. ``C`` is `jax_row_buffers.row_capacity`: ``n``
           by default (a slot per local position: can never overflow), or
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

This module holds the public entry points; the row-wise lookup is in
`jax_row_lookup` (its buffer sizing, slot packing and overflow check in
`jax_row_buffers`), the column-wise one in `jax_column_lookup`, and what
both share (``shard_map``, `ShardConfig`, the owners' update) in
`jax_shard_common`.
"""

import jax.numpy as jnp

from keras_sparse.sharding.exchange_buckets import ExchangeOverflowError
from keras_sparse.sharding.jax_column_lookup import column_gather
from keras_sparse.sharding.jax_column_lookup import column_lookup
from keras_sparse.sharding.jax_row_lookup import row_gather
from keras_sparse.sharding.jax_row_lookup import row_lookup
from keras_sparse.sharding.jax_shard_common import ShardConfig

__all__ = ["ExchangeOverflowError"]  # re-exported: raised by the step

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
    ``slack`` sizes the row exchange buffers (`jax_row_buffers.row_capacity`);
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
        out = row_lookup(cfg, *args, _slot_or_none(exchange_slot))
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
        out = column_lookup(cfg, *args)
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
