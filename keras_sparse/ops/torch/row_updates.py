"""PyTorch: the sparse row update as a handful of native in-place operations.

Eager PyTorch keeps no static shapes, so the update runs on exactly the
distinct rows of the batch: no size buckets, no padding, no sort. The
backend-neutral `keras_sparse.ops.row_updates` path (kept for JAX and
TensorFlow under XLA) costs ~400 small eager operations per table and step
on torch; this one costs about a dozen. On a CPU the dedup, the gradient
sum and the row writes run in the compiled helper
(`keras_sparse.ops.native_rows`) instead, with the same arithmetic in the
same order: the torch operations below are its fallback and its reference.

The torch route finds duplicates with a scratch array of one int32 per
table row: each position writes its own index at its id's entry (keeping
the largest), then reads the entry back, so every position learns one
representative position of its id (its last) in two O(n) passes instead
of an O(n log n) sort. Entries are always written before they are read, so
the scratch needs no clearing and its contents between steps do not
matter. The compiled helper finds the same representatives with a hash
sized by the batch, which stays in cache however large the table.
"""

import torch

from keras_sparse.ops import native_optimizers
from keras_sparse.ops import native_rows
from keras_sparse.ops.row_rounding import write_seed
from keras_sparse.ops.torch.row_writes import write_rows


def scratch_for(table_var, num_entries, device):
    """``table_var``'s dedup scratch of ``num_entries`` int32 (made once).

    Kept on the variable object, not as a Keras variable: never saved.
    """
    buffer = getattr(table_var, "_keras_sparse_dedup_scratch", None)
    if buffer is None or buffer.shape[0] != num_entries or buffer.device != device:
        buffer = torch.empty(num_entries, dtype=torch.int32, device=device)
        table_var._keras_sparse_dedup_scratch = buffer
    return buffer


def distinct_keys(keys, scratch):
    """``(unique, inverse)`` of ``keys`` (``[n]`` ints in ``[0, len(scratch))``).

    ``unique[inverse] == keys``; ``unique`` lists each key once, ordered by
    its last position (the compiled helper's order, `native_rows`).
    """
    n = keys.shape[0]
    position = torch.arange(n, dtype=torch.int32, device=keys.device)
    # The largest position, not index_put_'s last writer: torch writes big
    # batches from several threads, and the order must not depend on them.
    scratch.scatter_reduce_(0, keys, position, "amax", include_self=False)
    representative = scratch.index_select(0, keys)
    is_first = representative == position
    numbering = torch.cumsum(is_first, 0, dtype=torch.int32) - 1
    # index_add_ runs ~5x faster with int64 indices than with int32.
    inverse = numbering.index_select(0, representative).long()
    return keys.masked_select(is_first), inverse


def apply_row_updates(
    state,
    scratch,
    optimizer,
    ids,
    valid,
    grads,
    iterations,
    constraint,
    segments,
    bag=1,
    stochastic=True,
):
    """Sums the gradients of duplicate ids and updates their rows in place.

    Args:
        state: ``{"table": tensor, slot name: tensor}``, updated in place.
        scratch: int32 tensor of at least ``rows + 1`` entries (any values;
            see `scratch_for`), used only by the torch route's dedup (None
            where `compiled_route` is not None or with ``segments``).
        optimizer: a `keras_sparse.optimizers.SparseOptimizer`.
        ids, valid, grads: ``[n]`` int64 ids, ``[n]`` bool, ``[n // bag, dim]``
            (position ``p``'s gradient is row ``p // bag``: bags of ``bag``
            ids pooled by a sum share their bag's gradient).
        iterations: updates applied before this one.
        constraint: optional callable applied to the new rows.
        segments: optional ``[n]`` dense numbering of the distinct keys
            (``ids`` where valid, else the shared key ``num_rows``) from the
            input stage; replaces the dedup.
        stochastic: whether 16-bit arrays round stochastically
            (`keras_sparse.ops.row_rounding`).
    """
    table = state["table"]
    num_rows = table.shape[0]
    if ids.shape[0] == 0:
        return
    native = compiled_route(table, grads, segments)
    if native is not None:
        # One compiled pass: same distinct rows, same sums, to the bit.
        count, unique, summed = native.distinct_sum(
            ids.numpy(), valid.numpy(), grads.detach().numpy(), num_rows, bag=bag
        )
        if count == 0:
            return
        unique = torch.from_numpy(unique[:count])
        summed = torch.from_numpy(summed[:count])
    else:
        if bag > 1:
            grads = grads.repeat_interleave(bag, 0)
        unique, summed = _distinct_sum(ids, valid, grads, scratch, segments, num_rows)
        if unique is None:
            return
        # The input stage's segments replace the dedup, not the optimizer:
        # a batch trains the same with or without the stage.
        native = native_rows.library() if _usable(table, summed) else None
    if native is not None and native_optimizers.fused_update(
        native, optimizer, state, unique.numpy(), summed.numpy(), iterations,
        constraint, stochastic,
    ):  # fmt: skip
        return
    # The optimizer's math runs in float32 for 16-bit arrays too.
    slots = {name: _compute(t.index_select(0, unique)) for name, t in state.items()}
    rows = slots.pop("table")
    new_rows, new_slots = optimizer.update(rows, slots, summed, iterations)
    if constraint is not None:
        new_rows = constraint(new_rows)
    for name, values in {"table": new_rows, **new_slots}.items():
        seed = write_seed(iterations, name, stochastic)
        write_rows(state[name], unique, values, seed, native)


def _compute(values):
    if values.dtype in (torch.bfloat16, torch.float16):
        return values.float()
    return values


def compiled_route(table, grads, segments=None):
    """The compiled helpers where `apply_row_updates` uses them for this
    table (which then needs no table-sized scratch); else None."""
    if segments is None and _usable(table, grads):
        return native_rows.library()
    return None


def _usable(table, grads):
    """True where both are on the CPU, the gradients float32 and the table
    float32, bfloat16 or float16 (what the compiled helpers take)."""
    return (
        table.device.type == "cpu"
        and grads.device.type == "cpu"
        and table.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and grads.dtype == torch.float32
    )


def _distinct_sum(ids, valid, grads, scratch, segments, num_rows):
    """``(unique, summed)`` by torch operations; ``(None, None)`` if empty."""
    keys = torch.where(valid, ids, torch.full_like(ids, num_rows))
    if segments is None:
        unique, inverse = distinct_keys(keys, scratch[: num_rows + 1])
    else:
        inverse = segments.long()
        count = int(inverse.max()) + 1
        unique = torch.full((count,), num_rows, dtype=keys.dtype, device=keys.device)
        unique.scatter_(0, inverse, keys)
    summed = torch.zeros(
        (unique.shape[0], grads.shape[1]), dtype=grads.dtype, device=grads.device
    )
    summed.index_add_(0, inverse, grads.contiguous())
    real = unique < num_rows
    if not bool(real.all()):
        unique, summed = unique[real], summed[real]
        if unique.shape[0] == 0:
            return None, None
    return unique, summed
