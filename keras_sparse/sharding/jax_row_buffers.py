"""JAX: the row exchange's buffers: their size, slot packing, overflow check.

`row_capacity` sizes the ``[D, C]`` send buffers of the row-sharded lookup
(`jax_row_lookup`); `distinct_slots` packs each device's distinct ids into
them (`exchange_buckets.DEDUP_EXCHANGE`); `check_capacity` raises
`ExchangeOverflowError` on every device when a bucket overflows.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from keras_sparse.sharding import exchange_buckets as buckets
from keras_sparse.sharding.exchange_buckets import ExchangeOverflowError
from keras_sparse.sharding.exchange_buckets import overflow_message


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


def _raise_overflow(count, capacity, me, ids):
    if int(count) <= int(capacity):  # pragma: no cover - only called on overflow
        return np.zeros((), np.int32)
    raise ExchangeOverflowError(overflow_message(count, capacity, me, ids=ids))


def check_capacity(axis, local_worst, capacity):
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


# Up to this many ids per device, `distinct_slots` compares all pairs
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


def distinct_slots(ids, valid, d, shard_rows):
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
