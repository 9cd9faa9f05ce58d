"""Bucketing a row-sharded table's ids by owner shard, on the host.

A row-sharded lookup with compact exchange buffers (a
``row_exchange_slack``, see `jax_row_buffers.row_capacity`) sends each
device's distinct ids to their owners in a ``[D, C]`` buffer: the id at
local position ``i`` with owner ``o = id // shard_rows`` goes to slot ``s_i``
of row ``o``, where ``s_i`` is the number of the device's distinct ids of
owner ``o`` smaller than it (positions with equal ids share the slot). With
``dedup=False`` (the earlier exchange, `DEDUP_EXCHANGE` off) ``s_i`` is
the number of earlier local ids with the same owner. Inside the step that
numbering is a sort (or a ``[D, n]`` one-hot cumulative sum), and an
overflowing bucket is caught by an all-reduce of the worst fill and a host
callback.

`exchange_slots` computes the same numbering from the batch alone, so an
input stage (`keras_sparse.data.prefetch`) can do it in its worker threads:
the step then takes the slots as an input, and a bucket that would overflow
raises `ExchangeOverflowError` in the worker, before the step runs, naming
the layer and the device. The slots are exactly those the step computes,
so results do not change.

Example:

>>> import numpy as np
>>> rows = np.array([5, 0, 6, -1, 1, 7, 2, 3])  # 2 devices, 4 rows per shard
>>> rows = np.array([5, 0, 5, -1, 1, 7, 1, 3])  # 2 devices, 4 rows per shard
>>> exchange_slots(rows, devices=2, shard_rows=4, capacity=2).tolist()
[0, 0, 0, 0, 0, 0, 0, 1]
>>> exchange_slots(rows, 2, 4, capacity=3, dedup=False).tolist()
[0, 0, 1, 0, 0, 0, 1, 2]
"""

import numpy as np

__all__ = [
    "ExchangeOverflowError",
    "bucket_fill",
    "exchange_slots",
    "overflow_message",
]


# Compact row buffers carry each device's distinct ids once (True), or one
# slot per local position (False: the earlier exchange, kept to compare bytes
# and times). The step reads it when traced, the host packing when called.
# The same setting makes the TF and PyTorch sharded lookups exchange each
# replica's / process's distinct ids and JAX key-sharded row lookups reuse
# the key exchange's packing (read at each call / trace).
DEDUP_EXCHANGE = True


class ExchangeOverflowError(RuntimeError):
    """A row-exchange bucket got more ids than its capacity."""


def overflow_message(
    count, capacity, device, where="row sharding", what="step", ids="distinct ids"
):
    return (
        f"keras_sparse {where}: device {int(device)} had {int(count)} {ids} for "
        f"one owner shard, more than the {int(capacity)} exchange slots per "
        "destination (capacity = ceil(ids_per_device / devices * slack)). No "
        f"id was dropped: the {what} was aborted. Raise `row_exchange_slack` in "
        "keras_sparse.sharding.distribution(...) or set it to None (full-size "
        "buffers, never overflow)."
    )


def exchange_slots(
    rows, devices, shard_rows, capacity, name="row sharding", dedup=None
):
    """int32 exchange slot of every id of ``rows``, in the shape of ``rows``.

    Args:
        rows: int array of the global batch's ids (any shape whose flat,
            row-major order is the lookup's); ``< 0`` marks positions without
            a row (slot 0, not sent). Device ``p`` holds flat positions
            ``[p * n, (p + 1) * n)``.
        devices: ``D``, the devices the batch and the table are split over.
        shard_rows: rows per device (the padded table's rows / ``D``).
        capacity: slots per destination; the fullest bucket must fit.
        name: how errors name the lookup (e.g. the layer).
        dedup: number distinct ids (repeats share a slot); None: the
            step's setting, `DEDUP_EXCHANGE`.

    Raises:
        ValueError: the ids do not split evenly over ``devices``.
        ExchangeOverflowError: some device has more than ``capacity`` ids for
            one owner.
    """
    rows = np.asarray(rows)
    if rows.size % devices:
        raise ValueError(
            f"{name}: {rows.size} ids do not split evenly over {devices} devices."
        )
    local = rows.reshape(devices, -1)
    valid = local >= 0
    if dedup is None:
        dedup = DEDUP_EXCHANGE
    if dedup:
        slots = _distinct_slots(local, valid, devices, shard_rows, capacity, name)
        return slots.reshape(rows.shape)
    # Invalid positions form an extra group ``devices`` that is never sent.
    owner = np.where(valid, local // shard_rows, devices)
    groups = devices + 1
    key = owner + groups * np.arange(devices)[:, None]
    # Group keys fit in 16 bits for up to 180 devices, where NumPy's stable
    # sort is a radix sort (linear time).
    key_dtype = np.uint16 if devices * groups <= np.iinfo(np.uint16).max else np.int64
    key = key.astype(key_dtype).reshape(-1)
    order = np.argsort(key, kind="stable")
    counts = np.bincount(key, minlength=devices * groups)
    starts = np.cumsum(counts) - counts
    rank = np.empty(key.size, np.int32)
    rank[order] = np.arange(key.size, dtype=np.int32) - starts[key[order]]
    fill = counts.reshape(devices, groups)[:, :devices]
    worst = int(fill.max()) if fill.size else 0
    if worst > capacity:
        device = int(np.argmax(fill.max(axis=1)))
        raise ExchangeOverflowError(
            overflow_message(
                worst, capacity, device, name, "batch, before its step,", "ids"
            )
        )
    return np.where(valid.reshape(-1), rank, 0).astype(np.int32).reshape(rows.shape)


def bucket_fill(rows, devices, shard_rows, dedup=None):
    """``[D, D]`` int array: the ids device ``p`` sends to owner ``o`` (its
    distinct ids with ``dedup``; None: `DEDUP_EXCHANGE`).
    Its maximum is the smallest capacity that fits the batch."""
    if dedup is None:
        dedup = DEDUP_EXCHANGE
    local = np.asarray(rows).reshape(devices, -1)
    valid = local >= 0
    key = _device_keys(local, valid, devices, shard_rows)[valid]
    if dedup:
        key = np.unique(key)
    span = devices * shard_rows
    group = key // span * devices + key % span // shard_rows
    return np.bincount(group, minlength=devices * devices).reshape(devices, devices)


def _device_keys(local, valid, devices, shard_rows):
    # (device, id) as one int64, ascending in both.
    dev = np.arange(devices, dtype=np.int64)[:, None]
    return np.where(valid, local, 0).astype(np.int64) + dev * (devices * shard_rows)


def _distinct_slots(local, valid, devices, shard_rows, capacity, name):
    key = _device_keys(local, valid, devices, shard_rows)
    distinct, inverse = np.unique(key[valid], return_inverse=True)
    span = devices * shard_rows
    group = distinct // span * devices + distinct % span // shard_rows
    counts = np.bincount(group, minlength=devices * devices)
    # Sorted keys: each (device, owner) group is contiguous, in group order.
    starts = np.cumsum(counts) - counts
    rank = (np.arange(distinct.size) - starts[group]).astype(np.int32)
    worst = int(counts.max()) if counts.size else 0
    if worst > capacity:
        device = int(np.argmax(counts.reshape(devices, devices).max(axis=1)))
        raise ExchangeOverflowError(
            overflow_message(worst, capacity, device, name, "batch, before its step,")
        )
    slots = np.zeros(local.shape, np.int32)
    slots[valid] = rank[inverse.reshape(-1)]
    return slots.reshape(-1)
