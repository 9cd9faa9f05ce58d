"""Key-sharded key->row mapping inside a compiled JAX step.

A key-sharded `DistributedHashEmbedding` keeps one `HashTable` shard per
device (`keras_sparse.table.ShardedHashTable`); device ``d`` owns the keys
with ``owner_of(key, D) == d`` and rows ``[d * B, (d + 1) * B)`` of the
row-sharded ``[D * B, dim]`` table. Inside ``shard_map`` every device runs:

```
local keys ─► route callback (host): full 64-bit keys, owner per key, the
              distinct keys per owner in first-occurrence order with their
              multiplicities ─► all_to_all(keys as two int32 words + counts)
          ─► table callback (host) on the owner: one lookup_or_insert of the
              received keys (source device major, each repeated by its count,
              so admission and LFU count every sighting) ─► local rows
          ─► all_to_all(global rows, fresh flags) back ─► row per position
```

Both callbacks run once per device with that device's shard, on the
process that holds the device (in-place buffer callbacks on CPU devices,
unordered ``io_callback``s elsewhere: `_host_call`), so nothing is gathered
to one place and each process touches only its own shards. The
rows then go through the row-sharded lookup (`jax_sharded_lookup`), which
re-initializes fresh rows on their owners and applies the sparse optimizer
there.

Exchange buffers hold ``C`` distinct keys per destination (`key_capacity`:
the mean share of a device's keys plus six standard deviations by default,
or ``ceil(n / D * slack)`` with a ``row_exchange_slack``). A device with more
distinct keys for one owner raises `ExchangeOverflowError` on every device
(the worst fill is all-reduced first) before any table changes. Fresh rows are
drawn on each device for its own positions (per key, see
`keras_sparse.layers.hash.keyed_fresh_rows`), so no collective gathers them. Any
error of a callback (a full shard with ``eviction=None``, keys that do not
match the queued full keys) is raised on every device of the step together
(see `jax_step_mapping.StepFailures`): shards that had already mapped their
keys keep them (each shard is atomic on its own), and the step's model state
is lost, as for any failed step: restore from a checkpoint.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

from keras_sparse.layers.hash.jax_step_mapping import buffer_callback_or_none
from keras_sparse.layers.hash.key_mapper import MappedKeys
from keras_sparse.layers.hash.key_mapper import UndoCollector
from keras_sparse.sharding import exchange_buckets as buckets
from keras_sparse.sharding.exchange_buckets import ExchangeOverflowError
from keras_sparse.sharding.jax_shard_common import smap
from keras_sparse.table.keys import to_host
from keras_sparse.table.sharded_table import key_words
from keras_sparse.table.sharded_table import keys_of_words
from keras_sparse.table.sharded_table import owner_of


def route_keys(full, use, num_shards, capacity):
    """Host half of the route step for one device's keys.

    Returns ``(send_words [D, C, 2], send_counts [D, C], slot [n], first
    [n], worst)``: the distinct used keys of each owner in first-occurrence
    order with their multiplicities, each position's slot ``owner * C + j``
    (-1 where unused), True at the first position of each distinct key, and
    the fullest destination's count (may exceed ``C``; then the buffers hold
    the first ``C``).
    """
    n = full.shape[0]
    d, c = num_shards, capacity
    send_words = np.zeros((d, c, 2), np.int32)
    send_counts = np.zeros((d, c), np.int32)
    slot = np.full(n, -1, np.int32)
    first = np.zeros(n, bool)
    at = np.flatnonzero(use)
    if not at.size:
        return send_words, send_counts, slot, first, np.int32(0)
    keys = full[at]
    uniq, first_at, inverse, counts = np.unique(
        keys, return_index=True, return_inverse=True, return_counts=True
    )
    arrival = np.argsort(first_at, kind="stable")  # distinct keys, batch order
    owner = owner_of(uniq[arrival], d)
    by_owner = np.argsort(owner, kind="stable")  # owner major, arrival minor
    fill = np.bincount(owner, minlength=d)
    start = np.cumsum(fill) - fill
    j = np.empty(len(uniq), np.int64)
    j[by_owner] = np.arange(len(uniq)) - start[owner[by_owner]]
    slot_of_arrival = owner.astype(np.int64) * c + j
    slot_of_uniq = np.empty(len(uniq), np.int64)
    slot_of_uniq[arrival] = slot_of_arrival
    fits = j < c
    words = key_words(uniq[arrival])
    send_words[owner[fits], j[fits]] = words[fits]
    send_counts[owner[fits], j[fits]] = counts[arrival][fits]
    fits_of_uniq = np.empty(len(uniq), bool)
    fits_of_uniq[arrival] = fits
    inverse = inverse.reshape(-1)
    slot[at] = np.where(fits_of_uniq[inverse], slot_of_uniq[inverse], -1)
    first[at[first_at]] = True
    return send_words, send_counts, slot, first, np.int32(fill.max())


def map_received(table, words, counts, insert, row_tier=None):
    """Owner half: one table call for the received ``[D, C]`` keys.

    Returns ``(rows [D, C] int32 local, fresh [D, C] bool)``: -1 / False for
    empty entries; fresh at the first entry (source device major) of each
    key that got a new row. ``row_tier``: the shard's
    `keras_sparse.layers.row_tier.RowTier`, which records a training
    call's row moves (its evicted keys go down to the shard's store).
    """
    shape = counts.shape
    counts = counts.reshape(-1)
    live = np.flatnonzero(counts > 0)
    rows = np.full(counts.shape, -1, np.int32)
    fresh = np.zeros(counts.shape, bool)
    keys = keys_of_words(words.reshape(-1, 2)[live])
    reps = counts[live]
    repeated = np.repeat(keys, reps)
    starts = np.cumsum(reps) - reps
    if insert:
        if row_tier is None:
            res, new = table.lookup_or_insert_fresh(repeated)
        else:
            undo = UndoCollector()
            res, new = table.lookup_or_insert_fresh(repeated, undo=undo)
        got, new = to_host(res.rows)[starts], to_host(new)[starts]
        # A key sent by several devices is fresh once: at its first entry.
        _, first = np.unique(keys, return_index=True)
        once = np.zeros(len(keys), bool)
        once[first] = True
        fresh[live] = new & once
        if row_tier is not None:
            row_tier.record(
                MappedKeys.of_table_call(keys, got, fresh[live], undo.record)
            )
    else:
        # A read (inference, a frozen layer): not counted in stats().
        got = to_host(table.lookup(repeated, count=False))[starts]
    rows[live] = got
    return rows.reshape(shape), fresh.reshape(shape)


class KeyRouting(NamedTuple):
    """Static description of a key-sharded layer's step mapping."""

    table: object  # the layer's `ShardedHashTable`
    restore: object  # (step keys, part, parts) -> full int64 keys (host)
    mesh: object  # the JAX mesh
    axis: str  # its axis (size D)
    slack: object  # exchange slack, or None (`key_capacity`)
    name: str  # how errors name the layer
    failures: object  # the layer's `jax_step_mapping.StepFailures`
    row_tier: object = None  # the layer's `ShardedRowTier`, if it has a store

    def part_of(self, position):
        """``(part, parts)``: which slice of this process's batch the device
        at mesh ``position`` holds (the batch is split over the process's
        mesh positions in mesh order)."""
        me = jax.process_index()
        devices = list(self.mesh.devices.flat)
        local = [i for i, dev in enumerate(devices) if dev.process_index == me]
        return local.index(int(position)), len(local)


def _guarded(failures, fn, fallback):
    """``fn`` returning ``outputs + (status,)``: status 1 and ``fallback()``
    instead of raising, and without running once a step failed."""

    def call(*args):
        if failures.first is not None:
            return fallback() + (np.int32(1),)
        try:
            return tuple(fn(*args)) + (np.int32(0),)
        except Exception as e:  # noqa: BLE001  (raised on every device below)
            return fallback() + (failures.record(e),)

    return call


def _host_call(fn, result_types, *args):
    """``fn(*numpy args)`` on the host, on each device of the ``shard_map``.

    On CPU devices an in-place ``buffer_callback`` (the host reads XLA's
    input buffers and writes its output buffers; about a fifth of an
    ``io_callback``'s fixed cost with 8 devices); elsewhere an unordered
    ``io_callback`` (operands copied to the host). Neither orders calls
    across steps: each step's outputs depend on its own calls.
    """
    buffer_callback = buffer_callback_or_none()
    if buffer_callback is None or jax.default_backend() != "cpu":
        return io_callback(fn, result_types, *args, ordered=False)

    def in_place(ctx, outputs, *inputs):
        results = fn(*(np.asarray(x) for x in inputs))
        for out, value in zip(outputs, results):
            np.asarray(out)[...] = value

    call = buffer_callback(in_place, result_types, has_side_effect=True)
    return call(*args)


def _raise_recorded(failures, axis, status):
    """0, or (on every device at once) the recorded error when any device's
    ``status`` is set."""
    status = jax.lax.pmax(status, axis)

    def fail():
        def raise_it(_):
            raise failures.error()

        zero = jax.ShapeDtypeStruct((), jnp.int32)
        return jax.pure_callback(raise_it, zero, status)

    return jax.lax.cond(status > 0, fail, lambda: jnp.zeros((), jnp.int32))


def key_capacity(keys_per_device, num_devices, slack=None):
    """Distinct keys per destination in the key exchange buffers.

    Owners are chosen by a hash, so a device's distinct keys (at most
    ``n = keys_per_device``) spread evenly over the ``D`` owners: about
    ``m = n / D`` each, binomially. ``slack=None`` sizes for that:
    ``ceil(m + 6 * sqrt(m)) + 8`` (six standard deviations above the
    mean; only key sets built to collide exceed it), at most ``n``;
    ``slack=s`` gives ``ceil(m * s)``. A fuller destination raises
    `ExchangeOverflowError` on every device before any table changes.
    Small buffers also keep the host callbacks' operands small.
    """
    n = int(keys_per_device)
    m = n / int(num_devices)
    if slack is None:
        c = math.ceil(m + 6 * math.sqrt(m)) + 8
    else:
        if slack <= 0:
            raise ValueError(f"exchange slack must be > 0; got {slack}.")
        c = math.ceil(m * slack)
    return max(1, min(n, c))


def map_keys(routing, keys, use, insert, draw=None):
    """`MappedKeys` ``(rows int32 [N], fresh bool [N], init)`` of the global,
    batch-sharded ``keys`` / ``use``: rows are global (-1 where absent or
    unused), fresh at one position per newly assigned row, and ``init`` the
    ``[N, dim]`` values of fresh rows when ``draw=(fn, seed)`` is given
    (``fn(fresh, words, seed)``, run on each device for its own positions),
    else None. With `exchange_buckets.DEDUP_EXCHANGE` also
    ``exchange_slot`` (int32 ``[N]``): each position's slot among its
    device's distinct keys of the key's owner (below `key_capacity`), the
    row lookup's packing (`jax_placement.lookup_capacity`)."""
    mesh, axis = routing.mesh, routing.axis
    d = mesh.shape[axis]
    total = keys.shape[0]
    if total % d:
        raise ValueError(
            f"Layer '{routing.name}': {total} keys do not split evenly over the "
            f"{d} devices of its key sharding; use a batch size divisible by {d}."
        )
    n = total // d
    c = key_capacity(n, d, routing.slack)
    shard_rows = routing.table.shard_rows
    failures = routing.failures

    def route(k, u, me):
        part, parts = routing.part_of(me)
        full = routing.restore(np.asarray(k), part, parts)
        return route_keys(full, np.asarray(u, bool), d, c)

    def empty_route():
        return (
            np.zeros((d, c, 2), np.int32),
            np.zeros((d, c), np.int32),
            np.full(n, -1, np.int32),
            np.zeros(n, bool),
            np.int32(0),
        )

    def owner_call(words, counts, worst, status, me):
        if int(status):  # a device failed to route: no table changes
            return empty_owner()
        if int(worst) > c:
            raise ExchangeOverflowError(
                f"keras_sparse key sharding of layer '{routing.name}': a "
                f"device had {int(worst)} distinct keys for one owner shard, "
                f"more than the {c} exchange slots per destination "
                "(`jax_key_mapping.key_capacity`). No key was dropped and no "
                "table changed: the step was aborted. Raise "
                "`row_exchange_slack` in keras_sparse.sharding.distribution"
                "(...), or leave it None (a bound that only key sets built "
                "to collide exceed)."
            )
        table = routing.table.shard(int(me))
        tier = routing.row_tier
        tier = None if tier is None else tier.shard(int(me))
        try:
            with routing.table.on_device(int(me)):
                return map_received(
                    table, np.asarray(words), np.asarray(counts), insert, tier
                )
        except (ValueError, RuntimeError) as e:  # TableFullError is one
            raise type(e)(
                f"Layer '{routing.name}': table shard {int(me)} of {d} "
                f"(capacity {table.capacity}, size {table.size}) refused "
                f"this step's keys; nothing of it changed. ({e})"
            ) from None

    def empty_owner():
        return np.full((d, c), -1, np.int32), np.zeros((d, c), bool)

    i32 = jnp.int32
    route_types = (
        jax.ShapeDtypeStruct((d, c, 2), i32),
        jax.ShapeDtypeStruct((d, c), i32),
        jax.ShapeDtypeStruct((n,), i32),
        jax.ShapeDtypeStruct((n,), jnp.bool_),
        jax.ShapeDtypeStruct((), i32),
        jax.ShapeDtypeStruct((), i32),
    )
    owner_types = (
        jax.ShapeDtypeStruct((d, c), i32),
        jax.ShapeDtypeStruct((d, c), jnp.bool_),
        jax.ShapeDtypeStruct((), i32),
    )

    def local(k, u, seed):
        me = jax.lax.axis_index(axis)
        words, counts, slot, first, fill, failed = _host_call(
            _guarded(failures, route, empty_route), route_types, k, u, me
        )
        recv_words = jax.lax.all_to_all(words, axis, 0, 0)
        recv_counts = jax.lax.all_to_all(counts, axis, 0, 0)
        worst, failed = jax.lax.pmax(jnp.stack([fill, failed]), axis)
        local_rows, fresh, owner_failed = _host_call(
            _guarded(failures, owner_call, empty_owner),
            owner_types,
            recv_words,
            recv_counts,
            worst,
            failed,
            me,
        )
        guard = _raise_recorded(failures, axis, jnp.maximum(failed, owner_failed))
        rows = jnp.where(local_rows >= 0, local_rows + me * shard_rows, -1)
        answer = jnp.stack([rows, fresh.astype(i32)], axis=-1)
        back = jax.lax.all_to_all(answer, axis, 0, 0).reshape(d * c, 2)
        at = back[jnp.clip(slot, 0, d * c - 1)]
        sent = slot >= 0
        # The rows depend on the guard, so an error surfaces with the step.
        pos_rows = jnp.where(sent, at[:, 0], -1) + guard
        pos_fresh = sent & first & (at[:, 1] == 1)
        # The slot among this device's distinct keys of the owner (``slot``
        # is ``owner * C + j``): the row exchange reuses the packing.
        out = (pos_rows, pos_fresh, jnp.where(sent, slot % c, 0))
        if draw is None:
            return out
        pos_words = words.reshape(d * c, 2)[jnp.clip(slot, 0, d * c - 1)]
        pos_words = jnp.where(sent[:, None], pos_words, 0)
        return out + (draw[0](pos_fresh, pos_words, seed),)

    seed = jnp.zeros((2,), jnp.uint32)
    if draw is not None and draw[1] is not None:
        seed = draw[1]
    outputs = (P(axis),) * (3 if draw is None else 4)
    mapped = smap(local, mesh, (P(axis), P(axis), P()), outputs)(keys, use, seed)
    return MappedKeys(
        mapped[0],
        mapped[1],
        init=mapped[3] if draw is not None else None,
        exchange_slot=mapped[2] if buckets.DEDUP_EXCHANGE else None,
    )
