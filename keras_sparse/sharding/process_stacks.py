"""Sharded `EmbeddingCollection` stacks on TensorFlow and PyTorch.

On JAX a collection's placement comes from the active distribution (see
`keras_sparse.sharding.stacks`). TensorFlow (a MirroredStrategy of several
replicas, `tf_stacks`) and PyTorch (several torch.distributed processes,
`torch_stacks`) have none: the collection decides at build from each
table's own ``sharding`` (else the collection's; "auto" is "data"):

* Nothing but "data"/"auto": no placement, as on one device (every stack
  a full copy per replica or process).
* Otherwise every table is pinned to its strategy and planned by
  `keras_sparse.sharding.planner.plan` over the ``D`` replicas/processes,
  which checks each pin and picks each "table" table's owner as it does on
  JAX: largest table first, onto the device holding the fewest rows of
  its stack, then the fewest lookups. Every replica/process plans the same
  collection alike, so they agree without talking.

The stacks are `collection_stacks`'s. A "table" stack (``[D * B, dim]``,
device ``k``'s block holding its whole tables) and a "row" stack are
row-sharded, a "column" stack column-sharded, through the backend's row
and column primitives; each variable holds this replica's/process's part
only. The collection's saved state stays per table, whole and unpadded
(`stack_value` gathers, `assign_stack_value` cuts), so files load under
any device count, grouping or backend.
"""

import keras

from keras_sparse.sharding import planner as planner_lib


def _backend():
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from keras_sparse.sharding import tf_stacks

        return tf_stacks
    if backend == "torch":
        from keras_sparse.sharding import torch_stacks

        return torch_stacks
    return None


def _asks_for_sharding(layer):
    return any(layer.table_sharding(n) not in ("auto", "data") for n in layer.tables)


def collection_placement(layer):
    """``(placement, devices)`` of a collection built now off JAX, as
    `keras_sparse.sharding.stacks.collection_placement`; ``(None, 1)``:
    every stack a full copy (one device, or no table asks for sharding)."""
    backend = _backend()
    if backend is None or not _asks_for_sharding(layer):
        return None, 1
    site = backend.site(layer)
    if site is None:
        return None, 1
    pinned = {}
    for name in layer.tables:
        strategy = layer.table_sharding(name)
        pinned[f"{layer.name}/{name}"] = "data" if strategy == "auto" else strategy
    try:
        plan = planner_lib.plan([layer], devices=site.devices, pinned=pinned)
    except ValueError as error:
        raise ValueError(
            f"Layer '{layer.name}' (EmbeddingCollection) under {site.where}: "
            f"{error}. Change that table's `sharding` (one of 'data', "
            "'table', 'row', 'column'; 'data' keeps a full copy per device) "
            "or the collection's `optimizer`."
        ) from None
    placement = {}
    for table in plan:
        device = table.devices[0] if table.strategy == "table" else None
        placement[table.spec.collection_table] = (table.strategy, device)
    return placement, site.devices


def place_stacks(layer, stacks):
    """Gives each sharded stack of ``layer`` (being built) its placement
    (``stack.placement``: a "table" stack is row-sharded)."""
    backend = _backend()  # None on JAX: the distribution lays stacks out
    sharded = [s for s in stacks if s.strategy != "data"]
    if backend is None or not sharded:
        return
    site = backend.site(layer)
    for stack in sharded:
        strategy = "column" if stack.strategy == "column" else "row"
        stack.placement = site.placement(layer, stack, strategy)


def add_stack_weight(layer, stack, table, shape, initializer, name, **kwargs):
    """A stack's table (``table=True``) or slot variable of whole shape
    ``shape``: `add_weight`, or this device's part of a sharded stack."""
    where = getattr(stack, "placement", None)
    if where is None:
        return layer.add_weight(
            shape=shape, initializer=initializer, name=name, **kwargs
        )
    return where.stack_weight(layer, table, tuple(shape), initializer, name, **kwargs)


def stack_value(stack, variable):
    """The whole stack (NumPy, padding included) of one of its variables
    (PyTorch: gathered from every process, which must all call)."""
    where = getattr(stack, "placement", None)
    if where is None:
        return variable.numpy()
    return where.saved_value(variable, stack.rows)


def assign_stack_value(stack, variable, value):
    """Assigns the whole stack ``value``: each device keeps its part."""
    where = getattr(stack, "placement", None)
    if where is None:
        variable.assign(value)
    else:
        where.assign_saved(variable, stack.rows, value)
