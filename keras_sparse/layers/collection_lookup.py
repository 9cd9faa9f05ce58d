"""The lookups of an `EmbeddingCollection`'s stacks: one per stacked
variable, the ids of its tables offset and concatenated (batch-major where
the batch is shared, so each device's part of the flat ids is its own
batch rows), or the backend's fused gather-and-sum of their bags."""

import numpy as np
from keras import ops

from keras_sparse.layers import collection_quantization
from keras_sparse.layers import placement
from keras_sparse.layers.sparse_embedding_base import bag_sums_traced
from keras_sparse.layers.sparse_embedding_base import lookup_flat_rows
from keras_sparse.layers.sparse_embedding_base import table_state
from keras_sparse.ops import backend_module


def bag_sums(layer, stack, prepared, training, iterations):
    """``{name: [batch, dim] sums of its bags}`` for the tables of
    ``stack`` by the backend's fused gather-and-sum with the sparse update
    (see `SparseEmbeddingBase.bag_sums`), or None where that route does
    not apply: then `lookup_stack` and the combiners."""
    module = backend_module()
    names = list(stack.tables)
    if (
        iterations is None
        or not hasattr(module, "bag_sums_with_sparse_update")
        or not (layer.uses_sparse_update and layer.trainable and bool(training))
        or any(layer.tables[n].combiner is None for n in names)
        or any(prepared[n][1] is not None for n in names)  # weights
        or not all(
            bag_sums_traced(module, prepared[n][0], [layer.tables[n].combiner])
            for n in names
        )
        or placement.provider().route_stack(stack) is not None
    ):
        return None
    table = layer._stack_tables[stack.name]
    ids = [prepared[n][0] for n in names]
    if not module.bag_sums_apply(table, ids, [prepared[n][2] for n in names]):
        return None
    sums = module.bag_sums_with_sparse_update(
        table_state(layer, table, layer._stack_slots[stack.name]),
        [ops.cast(x, "int32") + stack.offsets[n] for x, n in zip(ids, names)],
        iterations,
        row_ranges=[
            (stack.offsets[n], stack.offsets[n] + layer.tables[n].input_dim)
            for n in names
        ],
        valids=[prepared[n][2] for n in names],
    )
    cuts = np.cumsum([x.shape[0] for x in ids])[:-1].tolist()
    return dict(zip(names, ops.split(sums, cuts) if cuts else [sums]))


def lookup_stack(layer, stack, prepared, training, iterations):
    """One lookup for all tables of ``stack``: ``{name: [..., dim] rows}``."""
    ids, valid, shapes = [], [], []
    for name in stack.tables:
        table_ids, _, table_valid = prepared[name]
        shapes.append(table_ids.shape)
        offset_ids = ops.cast(table_ids, "int32") + stack.offsets[name]
        ids.append(ops.where(table_valid, offset_ids, 0))
        valid.append(table_valid)
    routing = placement.provider().route_stack(stack)
    widths = batch_major_widths(shapes)
    known = all(isinstance(d, int) for s in shapes for d in s)
    if routing is None and known:  # not symbolic (jax.export) nor unknown
        # One device: table after table, so the update (and the gather)
        # walks one table's rows at a time, which the CPU caches hold.
        widths = None
    if widths is not None:
        # [batch, sum of widths]: each device's part of the flat ids is its
        # own batch rows of every table (no resharding before the lookup).
        flat_ids = ops.reshape(
            ops.concatenate([ops.reshape(x, (-1, w)) for x, w in zip(ids, widths)], 1),
            (-1,),
        )
        flat_valid = ops.reshape(
            ops.concatenate(
                [ops.reshape(x, (-1, w)) for x, w in zip(valid, widths)], 1
            ),
            (-1,),
        )
    else:
        if any(d is None for s in shapes for d in s):
            raise ValueError(
                f"Layer '{layer.name}': the ids of tables {list(stack.tables)} "
                f"have shapes {[tuple(s) for s in shapes]}; tables sharing "
                "a stack need ids with a common first (batch) dimension "
                "and known other dimensions."
            )
        sizes = [int(np.prod(s)) for s in shapes]
        flat_ids = ops.concatenate([ops.reshape(x, (-1,)) for x in ids], 0)
        flat_valid = ops.concatenate([ops.reshape(x, (-1,)) for x in valid], 0)
    row_ranges = [
        (stack.offsets[n], stack.offsets[n] + layer.tables[n].input_dim)
        for n in stack.tables
    ]
    if layer._stack_quantized:  # int8/int4 rows, read only
        rows = collection_quantization.gather(layer, stack, flat_ids, flat_valid)
    else:
        rows = lookup_flat_rows(
            layer,
            layer._stack_tables[stack.name],
            layer._stack_slots[stack.name],
            flat_ids,
            flat_valid,
            training,
            iterations,
            routing,
            blocks=(widths is not None, widths or sizes, row_ranges),
        )
    if widths is not None:
        rows = ops.reshape(rows, (-1, sum(widths), stack.dim))
        cuts, axis = np.cumsum(widths)[:-1].tolist(), 1
    else:
        cuts, axis = np.cumsum(sizes)[:-1].tolist(), 0
    # (torch rejects an empty list of split points)
    parts = ops.split(rows, cuts, axis=axis) if cuts else [rows]
    out = {}
    for name, part in zip(stack.tables, parts):
        shape = tuple(ops.shape(prepared[name][0])) + (stack.dim,)
        out[name] = ops.reshape(part, shape)
    return out


def batch_major_widths(shapes):
    """Per-table widths for the ``[batch, width]`` concatenation, or None.

    Needs rank >= 1, known non-batch dims and one batch size (equal, or
    unknown as in a traced step; a model feeds every table the same batch).
    """
    widths, batches = [], set()
    for shape in shapes:
        if len(shape) == 0 or any(d is None for d in shape[1:]):
            return None
        widths.append(int(np.prod(shape[1:], dtype=np.int64)))
        batches.add(shape[0])
    if len({b for b in batches if b is not None}) > 1:
        return None
    return widths
