"""The stacked variables of an `EmbeddingCollection` under sharding.

Table-wise sharding: EmbeddingCollection stacks
------------------------------------------------
A Keras variable's layout is a PartitionSpec over the whole mesh: no spec
says "all rows on device k". So "table t lives whole on device k" is a
*stack*: an `EmbeddingCollection` (one layer owning several tables) groups
its tables by ``(output_dim, strategy)`` and keeps one variable per group
(and one per optimizer slot), see `collection_stacks`:

* "table" group: ``[D * B, dim]`` laid out ``(axis, None)``, ``B`` = the
  most rows the planner packed onto one device (``TablePlan.devices``);
  table ``t`` on device ``k`` at offset ``o_t`` of block ``k``, its id ``i``
  is global row ``k * B + o_t + i``. Each device holds ``B`` rows: its own
  tables plus zero padding. The lookup is the row-sharded primitive
  unchanged, with full-size exchange buffers (all of a table's ids go to one
  owner, so a slack would overflow).
* "row" group: the concatenation of its tables, padded to a multiple of
  ``D`` rows and row-sharded; "column" group: the concatenation, laid out
  ``(None, axis)``; "data" group (and every group without a distribution):
  the concatenation, replicated. Without a distribution, on a JAX or
  TensorFlow CPU step, each table is a group of its own (`per_table_stacks`).

The layer runs one sparse lookup per group per call (the ids of the group's
tables, offset and concatenated; the rows split back), so exactly one
custom_vjp owns each stacked variable and ``overwrite_with_gradient`` gets
one whole updated stack. That is why "table" needs the collection: separate
layers sharing one stacked variable would each hand back a whole updated
stack and autodiff would sum them. A standalone layer is planned without
"table" (the planner names `EmbeddingCollection` in its reason) and a plan
pinning it raises. The collection saves per table (unpadded, unstacked
arrays), so checkpoints load under any device count, grouping or strategy.
"""

import keras

from keras_sparse.sharding.jax_placement import JaxMeshPlacement
from keras_sparse.sharding.layouts import _axes
from keras_sparse.sharding.routing import padded_rows


class StackLayout:
    """One stacked variable of an `EmbeddingCollection` (see the module note).

    Attributes:
        name: variable name (slots: ``f"{name}_{slot}"``).
        strategy: "data", "table", "row" or "column" (layout of the stack).
        dim: embedding width of every table in the stack.
        tables: the table names, in the collection's order.
        offsets: table name -> first global row of the table in the stack.
        rows: rows of the stacked variable (padding included).
        block_rows: rows per device of a "table" stack (``B``), else None.
        placement: the `TablePlacement` of a sharded stack on TensorFlow or
            PyTorch, set at build (`process_stacks.place_stacks`), else None.
    """

    def __init__(self, name, strategy, dim, tables, offsets, rows, block_rows=None):
        self.name = name
        self.strategy = strategy
        self.dim = int(dim)
        self.tables = tuple(tables)
        self.offsets = dict(offsets)
        self.rows = int(rows)
        self.block_rows = block_rows
        self.placement = None
        # The tables' `TableStorage` (dtypes, rounding), set by
        # `collection_stacks`; None: the layer's variable dtype.
        self.storage = None

    def variable_names(self, optimizer):
        names = [self.name]
        if optimizer is not None:
            names += [f"{self.name}_{spec.name}" for spec in optimizer.slot_specs()]
        return names

    def key(self):
        return (self.name, self.strategy, self.dim, self.tables, self.rows)

    def __repr__(self):
        return (
            f"StackLayout({self.name!r}, {self.strategy!r}, dim={self.dim}, "
            f"rows={self.rows}, offsets={self.offsets})"
        )


def collection_stacks(tables, placement, num_devices):
    """The `StackLayout` list of a collection's tables.

    Args:
        tables: ordered ``{name: config}`` with ``input_dim``/``output_dim``.
        placement: ``{name: (strategy, device)}`` (device: the owner of a
            "table" table, else None), or None: one device, every group
            replicated ("data").
        num_devices: devices of the mesh (``D``).

    Tables group by ``(output_dim, strategy)`` and storage dtypes (a
    16-bit table's stack is named by them), groups ordered by their first
    table; a "table" stack packs each device's tables (in collection order)
    into its block of ``B`` rows. Without a distribution, on a JAX CPU
    step, each table is a stack of its own (`per_table_stacks`).
    """
    groups = {}
    split = placement is None and per_table_stacks()
    for name, config in tables.items():
        strategy = "data" if placement is None else placement[name][0]
        # A table's own stack is named by its position: names of tables
        # could collide with another stack's slot suffixes.
        # Tables of different storage dtypes never share a variable, and a
        # 16-bit table has one of its own: its rows round by their row
        # numbers, which must be the table's own (as in a layer of its own).
        storage = getattr(config, "storage", None)
        suffix = storage.stack_suffix() if storage is not None else ""
        own = split or bool(suffix)
        key = (config.output_dim, strategy, suffix) + (
            (f"t{len(groups)}",) if own else ()
        )
        groups.setdefault(key, []).append(name)
    d = int(num_devices)
    stacks = []
    for (dim, strategy, suffix, *own), names in groups.items():
        offsets, block = {}, None
        if strategy == "table":
            per_device = [[] for _ in range(d)]
            for name in names:
                device = placement[name][1]
                if device is None or not 0 <= device < d:
                    raise ValueError(
                        f"Table '{name}': table-wise placement needs a device "
                        f"in [0, {d}); got {device!r}."
                    )
                per_device[device].append(name)
            block = max(sum(tables[n].input_dim for n in p) for p in per_device)
            for k, owned in enumerate(per_device):
                offset = k * block
                for name in owned:
                    offsets[name] = offset
                    offset += tables[name].input_dim
            rows = d * block
        else:
            rows = 0
            for name in names:
                offsets[name] = rows
                rows += tables[name].input_dim
            if strategy == "row":  # an equal block per device
                rows = padded_rows(rows, d)
        name = f"stack_{dim}_{strategy}{suffix}" + "".join(f"_{n}" for n in own)
        stack = StackLayout(name, strategy, dim, names, offsets, rows, block)
        stack.storage = getattr(tables[names[0]], "storage", None)
        stacks.append(stack)
    return stacks


# Without a distribution, JAX and TensorFlow steps on a CPU update a
# collection's tables fastest one stack each: XLA:CPU and TensorFlow's
# graph executor run the per-table update chains side by side on the cores,
# where the writes into one stacked variable run one after another (26
# tables: see BENCHMARKS.md). Accelerators keep one stack per width (fewer,
# larger kernels), and so does eager PyTorch (one fused gather-and-sum per
# stack). False: one stack per width everywhere.
PER_TABLE_STACKS_ON_CPU = True


def per_table_stacks():
    """Whether an undistributed collection keeps one stack per table."""
    backend = keras.backend.backend()
    if not PER_TABLE_STACKS_ON_CPU or backend not in ("jax", "tensorflow"):
        return False
    if backend == "tensorflow":
        import tensorflow as tf

        # Under tf.distribute too (CPU replicas): a model's weights then
        # keep one layout with and without a strategy.
        return not tf.config.list_logical_devices("GPU")
    if keras.distribution.distribution() is not None:
        return False
    import jax

    return jax.default_backend() == "cpu"


def collection_placement(layer):
    """``(placement, num_devices)`` for building ``layer`` (a collection) now.

    From the active distribution made by `distribution` on JAX, from the
    tables' own ``sharding`` under a MirroredStrategy or torch.distributed
    processes (`process_stacks`); ``(None, 1)`` otherwise: every table is in
    a replicated stack.
    """
    if keras.backend.backend() != "jax":
        from keras_sparse.sharding import process_stacks

        return process_stacks.collection_placement(layer)
    dist = keras.distribution.distribution()
    if dist is None or not isinstance(dist, keras.distribution.ModelParallel):
        return None, 1
    placement = getattr(dist, "keras_sparse_collections", {}).get(layer.name)
    if placement is None:
        return None, 1
    missing = [name for name in layer.tables if name not in placement]
    if missing:
        raise ValueError(
            f"Layer '{layer.name}': the active distribution places no table "
            f"named {missing} (it was made for a collection with tables "
            f"{sorted(placement)}). Re-create it with keras_sparse.distribution."
        )
    axis = dist.keras_sparse_axis
    return placement, dist.device_mesh.shape[dist.device_mesh.axis_names.index(axis)]


def route_stack(stack):
    """Routing (as `route`) for one stack of a collection, or None."""
    if keras.backend.backend() != "jax":
        return stack.placement  # decided at build (TensorFlow, PyTorch)
    if stack.strategy == "data":
        return None
    dist = keras.distribution.distribution()
    if dist is None or not isinstance(dist, keras.distribution.ModelParallel):
        return None
    axis = getattr(dist, "keras_sparse_axis", "model")
    mesh = dist.device_mesh
    if axis not in mesh.axis_names:
        return None
    if stack.strategy == "table":
        # Every id of a table goes to its one owner: only full-size buffers
        # cannot overflow.
        return JaxMeshPlacement("row", mesh.backend_mesh, axis, None)
    slack = getattr(dist, "keras_sparse_row_exchange_slack", None)
    return JaxMeshPlacement(stack.strategy, mesh.backend_mesh, axis, slack)


def _relayout_collection(layer, stacks, mesh, axis):
    """Lays out a built collection's stacks for ``stacks`` (same grouping)."""
    current = [s.key() for s in layer.stacks]
    if current != [s.key() for s in stacks] or any(
        a.offsets != b.offsets for a, b in zip(layer.stacks, stacks)
    ):
        raise ValueError(
            f"Layer '{layer.name}' (EmbeddingCollection) is already built with "
            "stacks that differ from the ones this distribution needs "
            f"({[s.name for s in layer.stacks]} -> {[s.name for s in stacks]}); "
            "its variables cannot be re-stacked in place. Build the model "
            "after keras.distribution.set_distribution(...), or save it and "
            "reload it with keras_sparse.sharding.load_model(...)."
        )
    for stack in stacks:
        layout = keras.distribution.TensorLayout(_axes(stack.strategy, axis), mesh)
        for variable in layer.stack_variables(stack.name):
            variable._layout = layout
            variable._direct_assign(variable.value)
    layer.stacks = list(stacks)
    for variable in layer.variables:
        if variable._layout is None:
            axes = (None,) * len(variable.shape)
            variable._layout = keras.distribution.TensorLayout(axes, mesh)
            variable._direct_assign(variable.value)
