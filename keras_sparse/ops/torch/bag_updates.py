"""PyTorch: the sparse update of a bag-sum backward pass in one sweep.

The backward pass of `keras_sparse.ops.torch.lookup.bag_sums_with_sparse_update`
(one table, or every table of a collection's stack) needs, per table, the
compiled dedup and the compiled optimizer pass over its rows. Going through
the general route (`apply_row_updates`, table by table, with its checks
and conversions per table) cost a 26-table step about as long as the
compiled code itself. Here the checks, the optimizer's scalars and the
NumPy views of the state are made once per backward pass and the tables
run as two C calls each (`NativeRows.update_tables`): the same calls, in
the same order, so the same bits.
"""

import torch

from keras_sparse.ops import native_optimizers
from keras_sparse.ops import native_rows
from keras_sparse.ops.optimizer_rules import rule_of
from keras_sparse.ops.optimizer_rules import rule_scalars


class BagUpdate:
    """The prepared update: `run` each part of `parts` (in any order, or
    side by side: their rows are disjoint), then `finish` once."""

    def __init__(self, native, rule, tensors, tables, scalars):
        self.native = native
        self.rule = rule
        self.tensors = tensors
        self.arrays = [t.detach().numpy() for t in tensors]
        self.tables = tables
        self.scalars = scalars

    def parts(self, workers):
        """The tables in at most ``workers`` runs of consecutive tables."""
        size = -(-len(self.tables) // max(1, workers))
        return [self.tables[i : i + size] for i in range(0, len(self.tables), size)]

    def run(self, tables):
        self.native.update_tables(self.rule, self.arrays, tables, self.scalars)

    def finish(self):
        for tensor in self.tensors:
            # Writes through NumPy bypass autograd's version counter; a
            # graph that saved the table must still see it changed.
            tensor[:0].zero_()


def prepare(context, bags, upstream):
    """A `BagUpdate` of ``bags`` (``[batch_t, bag_t]`` int64 ids of the
    stack, every one valid, table ``t``'s first row added) from
    ``upstream`` (``[sum of batch_t, dim]``), or None where the compiled
    update does not serve it exactly (no compiled helpers, a constraint, an
    optimizer without a compiled rule, 16-bit or non-CPU arrays): then the
    table-by-table route runs."""
    native = native_rows.library()
    found = rule_of(context["optimizer"])
    if (
        native is None
        or found is None
        or not native_optimizers.FUSED_OPTIMIZERS
        or context["constraint"] is not None
        or upstream.device.type != "cpu"
        or upstream.dtype != torch.float32
    ):
        return None
    rule, slot_names = found
    state = context["state"]
    if set(state) != {"table", *slot_names}:
        return None
    tensors = [state[name] for name in ("table", *slot_names)]
    if any(
        t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()
        for t in tensors
    ):
        return None
    scalars = [
        float(x)
        for x in rule_scalars(context["optimizer"], context["iterations"], "float32")
    ]
    grads = upstream.detach().numpy()
    ranges = context["row_ranges"] or [(0, tensors[0].shape[0])]
    tables, start = [], 0
    for bag, (first, end) in zip(bags, ranges):
        ids = bag.reshape(-1)
        ids = ids - first if first else ids
        rows = bag.shape[0]
        tables.append(
            (ids.numpy(), first, end, grads[start : start + rows], bag.shape[1])
        )
        start += rows
    return BagUpdate(native, rule, tensors, tables, scalars)
