"""One host hop per training step for a table with ``cache_rows``.

On a one-device CPU step (`keras_sparse.layers.dense_cache.CacheRows._route`
"cpu_buffers") whose map runs compiled and whose store has row arrays
(`DenseMoves.in_place`), one in-place buffer callback takes the batch's ids
and the cache variables' buffers (aliased to its outputs, so XLA hands
over the variables' own memory) and, in one compiled call
(`DenseSlots.assign_and_move`), maps the ids to cache rows, writes the
victims' rows (values and optimizer slots, as the previous step left them)
to the store and copies the new ids' stored rows into their cache rows.
The step then looks up and updates the rows it returned as any table.

An eager PyTorch step on CPU does the same on the variables' memory
(`map_and_move_torch`).

Against the two hops of the general route (the mapping, then the moves
through gathered copies of the rows and a scatter of the fills back), this
saves a host hop, the ``[n, width]`` copies of every variable each way and
the scatter.
"""

import numpy as np

from keras_sparse.layers.hash import jax_step_mapping


def applies(cache, route):
    """Whether ``cache``'s training steps take the one hop (see the module):
    ``route`` "cpu_buffers" (JAX) or "torch_cpu"."""
    if route not in ("cpu_buffers", "torch_cpu"):
        return False
    if cache.slot_map.compiled() is None:
        return False
    if route == "torch_cpu" and any(
        var.value.device.type != "cpu" or not var.value.is_contiguous()
        for var in _variables(cache).values()
    ):
        return False
    shapes = {
        name: (np.dtype(str(var.dtype).split(".")[-1]), int(var.shape[1]))
        for name, var in _variables(cache).items()
    }
    return cache.row_tier.in_place(shapes)


def map_and_move(cache, flat, use, n):
    """Int32 ``[n]`` cache rows of the traced flat ids ``flat`` (where
    ``use``; -1 elsewhere), the cache variables assigned their rows after
    the step's moves (see the module)."""
    import jax

    variables = _variables(cache)
    names = list(variables)
    tier, slot_map = cache.row_tier, cache.slot_map

    def callback(ctx, outputs, ids, used, *tables):
        out = [np.asarray(o) for o in outputs]
        tier.assign_and_move(
            slot_map, np.asarray(ids), np.asarray(used), out[0],
            dict(zip(names, out[1:])),
        )  # fmt: skip

    shapes = [jax.ShapeDtypeStruct((n,), np.int32)]
    shapes += [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in variables.values()]
    # Declared free of side effects, as the mapping callback is
    # (`jax_step_mapping.rows_in_step`): the step consumes the rows and
    # tables it returns, so it runs once per step, in step order.
    hop = jax_step_mapping.buffer_callback_or_none()(
        jax_step_mapping.final_on_failure(cache, callback),
        shapes,
        has_side_effect=jax_step_mapping.rematerializing(),
        input_output_aliases={2 + i: 1 + i for i in range(len(names))},
    )
    slots, new = _moved(hop, [variables[k].value for k in names], flat, use)
    for name, value in zip(names, new):
        variables[name].assign(value)
    return slots


def map_and_move_torch(cache, flat, use):
    """`map_and_move` of an eager PyTorch step: the moves write the CPU
    variables' memory in place (outside autograd, before the lookup reads
    it, as the two-hop route's row writes do)."""
    import torch

    arrays = {
        name: var.value.detach().numpy() for name, var in _variables(cache).items()
    }
    ids = flat.detach().cpu().numpy()
    slots = np.empty(ids.shape[0], np.int32)
    cache.row_tier.assign_and_move(
        cache.slot_map, ids, use.detach().cpu().numpy(), slots, arrays
    )
    return torch.from_numpy(slots).to(flat.device)


def _variables(cache):
    return {"table": cache.embeddings, **cache.slots}


def _moved(hop, tables, flat, use):
    """``hop(flat, use, *tables)`` whose backward passes the tables'
    cotangents through: the lookup's backward hands the whole updated
    table back as the table's "gradient", which must reach the variable
    unchanged (as `keras_sparse.ops.jax.lookup.reset_rows` does)."""
    import jax

    @jax.custom_vjp
    def moved(tables, flat, use):
        out = hop(flat, use, *tables)
        return out[0], list(out[1:])

    def forward(tables, flat, use):
        return moved(tables, flat, use), None

    def backward(_, grads):
        return grads[1], None, None

    moved.defvjp(forward, backward)
    return moved(tables, flat, use)
