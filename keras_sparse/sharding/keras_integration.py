"""Keras side of sharding: a ModelParallel distribution from a plan, and the
routing used by ``SparseEmbeddingBase.lookup_rows``.

Layout: a 1-D device mesh with one axis (``"model"`` by default) that is both
the batch (data-parallel) axis of the dense part of the model and the axis the
tables are split over, the usual hybrid-parallel recommender layout.

Row padding: a row-sharded table with ``num_rows % D != 0`` is built with
``ceil(num_rows / D) * D`` rows (`variable_rows`), the same for its slots,
so each device holds an equal block; the extra rows are zeros that no id
reaches. ``layer.num_rows`` is unchanged; ``layer.embeddings``, the slots and
``model.get_weights()`` / ``set_weights()`` have the padded shape; the
layer's saved state (``.keras`` files) is unpadded (`unpadded_value`,
`padded_value`), so checkpoints load under any device count.

Hash layers: a key-sharded `DistributedHashEmbedding` (strategy "key") gets
a `keras_sparse.table.ShardedHashTable` with one shard per device when it is
built (`place_hash_table`); its ``[D * B, dim]`` table and slots are laid out
like a row-sharded table, its step maps keys on their owners
(`map_keys_in_step`, `jax_key_mapping`) and then looks the rows up as row
sharding does. Under "data", "row" or "column" the layer keeps one host
table per process, which one process cannot share with another
(`check_hash_layer_processes`). The rows a step assigns are re-initialized by
`jax_sharded_lookup.sharded_reset` on the devices holding them, before the
sharded lookup.

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

import dataclasses
import re

import keras

from keras_sparse.layers import table_users
from keras_sparse.sharding import planner as planner_lib
from keras_sparse.sharding.jax_placement import JaxMeshPlacement

#: Strategies the Keras integration can run ("table": for the tables of an
#: `EmbeddingCollection`).
RUNNABLE = ("data", "table", "row", "column", "key")
_ROUTED = ("row", "column", "key")


def _axes(strategy, axis):
    return {
        "row": (axis, None),
        "key": (axis, None),
        "table": (axis, None),
        "column": (None, axis),
        "data": (None, None),
    }[strategy]


def check_hash_layer_processes(layer, strategy, process_count=None):
    """Raises for a `DistributedHashEmbedding` planned with one host key map
    (any strategy but "key") in a multi-process run: each process would fill
    its own map from its own keys, giving one row to different keys."""
    if strategy == "key" or not planner_lib.is_hash_layer(layer):
        return
    if process_count is None:
        import jax

        process_count = jax.process_count()
    if process_count > 1:
        raise ValueError(
            f"Layer '{layer.name}': with sharding={strategy!r} a "
            "DistributedHashEmbedding maps keys in one host table per "
            f"process, which cannot be shared by this run's {process_count} "
            "processes. Use sharding='key' (each device owns its keys' "
            "table shard and rows), the planner's choice for hash layers "
            "in multi-process runs."
        )


def _variable_names(layer):
    names = ["embeddings"]
    opt = getattr(layer, "sparse_optimizer", None)
    if opt is not None:
        names += [spec.name for spec in opt.slot_specs()]
    return names


def distribution(
    model_or_layers,
    devices=None,
    plan=None,
    axis="model",
    row_exchange_slack=None,
    **plan_kwargs,
):
    """A `keras.distribution.ModelParallel` placing each table per its plan.

    Args:
        model_or_layers: a Keras model or a list of keras_sparse embedding
            layers (they may be unbuilt: build the model after
            ``keras.distribution.set_distribution(...)`` so every variable is
            created with its layout; built embedding layers are re-laid out).
        devices: list of devices (default: all of `keras.distribution.list_devices`)
            or their number.
        plan: a `Plan` from `keras_sparse.sharding.plan`; computed with
            ``plan_kwargs`` (restricted to the runnable strategies) if None.
        axis: name of the mesh axis.
        row_exchange_slack: sizes the row-sharded tables' exchange buffers at
            ``ceil(ids_per_device / devices * slack)`` slots per destination
            (``slack / devices`` of the full size). None (default): full-size
            buffers, which can never overflow. With a slack, a step where one
            device has more ids for one owner than that raises an error when
            it runs (ids are never dropped); 2 to 4 suits ids spread over the
            shards, skewed id ranges need more.

    Returns:
        A ``ModelParallel`` distribution; pass it to
        ``keras.distribution.set_distribution``.
    """
    if devices is None:
        devices = keras.distribution.list_devices()
    elif isinstance(devices, int):
        devices = keras.distribution.list_devices()[:devices]
    devices = list(devices)
    if plan is None:
        plan_kwargs.setdefault("strategies", RUNNABLE)
        plan_kwargs.setdefault("processes", _process_count())
        plan = planner_lib.plan(model_or_layers, devices=len(devices), **plan_kwargs)
    if plan.num_devices != len(devices):
        raise ValueError(
            f"The plan is for {plan.num_devices} devices; got {len(devices)}."
        )
    mesh = keras.distribution.DeviceMesh((len(devices),), [axis], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    collections = {}
    for table in plan:
        layer = table.spec.layer
        if layer is None:
            raise ValueError(
                f"Table '{table.name}': the plan was made from a TableSpec "
                "without a layer; plan from the model or its layers."
            )
        if table.strategy not in RUNNABLE:
            raise NotImplementedError(
                f"Table '{table.name}': strategy {table.strategy!r} is not "
                f"runnable (runnable: {RUNNABLE})."
            )
        if planner_lib.is_collection(layer):
            device = table.devices[0] if table.strategy == "table" else None
            placement = collections.setdefault(layer.name, (layer, {}))[1]
            placement[table.spec.collection_table] = (table.strategy, device)
            continue
        if table.strategy == "table":
            raise ValueError(
                f"Table '{table.name}': strategy 'table' (the whole table on "
                f"one device) needs the table in a keras_sparse."
                "EmbeddingCollection, which stacks the tables of each device "
                "into one row-sharded variable (see the design note in "
                "keras_sparse.sharding.keras_integration). Put the table in "
                "an EmbeddingCollection, or use 'row': it takes any row count "
                "and holds ceil(rows / devices) rows per device."
            )
        check_hash_layer_processes(layer, table.strategy)
        if table.strategy == "key" and layer.built:
            _check_key_shards(layer, len(devices))
        axes = _axes(table.strategy, axis)
        layer._ks_strategy = table.strategy
        layer._ks_axis = axis
        for name in _variable_names(layer):
            pattern = f"(.*/)?{re.escape(layer.name)}/{re.escape(name)}"
            layout_map[pattern] = axes
        if layer.built:
            _relayout(layer, axes, mesh)
        _replicate_other_variables(layer, mesh)
    for layer, placement in collections.values():
        stacks = collection_stacks(layer.tables, placement, len(devices))
        if layer.built and all(p[0] == "data" for p in placement.values()):
            # Replicated either way: a built layer keeps its grouping (one
            # stack per table when it was built for a CPU step).
            stacks = layer.stacks
        for stack in stacks:
            axes = _axes(stack.strategy, axis)
            for name in stack.variable_names(layer.sparse_optimizer):
                pattern = f"(^|.*/){re.escape(layer.name)}/{re.escape(name)}$"
                layout_map[pattern] = axes
        if layer.built:
            _relayout_collection(layer, stacks, mesh, axis)
    dist = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name=axis)
    dist.keras_sparse_plan = plan
    # Looked up by layer name in `route`, so layers deserialized later (e.g. by
    # `load_model`) follow this plan rather than their saved `sharding`.
    dist.keras_sparse_strategies = {
        table.spec.layer.name: table.strategy
        for table in plan
        if not planner_lib.is_collection(table.spec.layer)
    }
    # Read by `collection_placement` when an EmbeddingCollection is built.
    dist.keras_sparse_collections = {
        name: placement for name, (_, placement) in collections.items()
    }
    dist.keras_sparse_axis = axis
    dist.keras_sparse_row_exchange_slack = row_exchange_slack
    return dist


def _process_count():
    if keras.backend.backend() != "jax":
        return 1
    import jax

    return jax.process_count()


def _check_key_shards(layer, num_devices):
    """A built hash layer can take key sharding only if its table already
    has one shard per device (its variables cannot be re-cut in place)."""
    table = layer.table
    if getattr(table, "num_shards", None) == num_devices:
        return
    raise ValueError(
        f"Layer '{layer.name}' is already built with a "
        f"{type(table).__name__} of capacity {table.capacity}; key sharding "
        f"over {num_devices} devices needs a table shard per device. Build "
        "the model after keras.distribution.set_distribution(...), or save "
        "it and reload it with keras_sparse.sharding.load_model(...)."
    )


def _embedding_layer_configs(config):
    """Yields the serialized keras_sparse embedding layers found in a model
    config (nested models included)."""
    if isinstance(config, dict):
        module = str(config.get("module", ""))
        if module.startswith("keras_sparse") and "config" in config:
            yield config
            return
        for value in config.values():
            yield from _embedding_layer_configs(value)
    elif isinstance(config, list):
        for value in config:
            yield from _embedding_layer_configs(value)


def _read_config(filepath):
    import json
    import zipfile

    with zipfile.ZipFile(filepath) as archive:
        return json.loads(archive.read("config.json"))


def load_model(
    filepath,
    devices=None,
    plan=None,
    axis="model",
    custom_objects=None,
    compile=True,
    set_distribution=True,
    **plan_kwargs,
):
    """Loads a ``.keras`` model with its tables laid out for ``devices``.

    The checkpoint stores whole (unsharded) arrays, so it loads under any mesh:
    the tables are planned from the saved architecture (without creating any
    variable), the distribution is set, and `keras.saving.load_model` then
    creates every variable directly with its layout and assigns the saved
    values shard by shard (``Variable.assign`` distributes the value per the
    variable's layout). Slots, ``sparse_iterations`` and the Keras optimizer's
    state are restored too.

    Args:
        filepath: a ``.keras`` file (saved under any mesh, or none).
        devices: devices or their number, as for `distribution`; ``1`` (or a
            single device) loads without a distribution.
        plan: a `Plan` made from the layers of this model (same names), or
            a ``{layer name: strategy}`` dict; otherwise planned from the
            layers' saved ``sharding`` and ``plan_kwargs``.
        set_distribution: also make the distribution global (it must be
            active whenever the model runs).

    Returns:
        ``(model, distribution)``; the distribution is None for one device.
    """
    if devices is None:
        devices = keras.distribution.list_devices()
    elif isinstance(devices, int):
        devices = keras.distribution.list_devices()[:devices]
    devices = list(devices)
    if len(devices) == 1:
        if set_distribution:
            keras.distribution.set_distribution(None)
        model = keras.saving.load_model(
            filepath, custom_objects=custom_objects, compile=compile
        )
        return model, None
    # Unbuilt (no build_config): planning needs no variable, and a built
    # layer with uneven rows could not be laid out padded.
    layers = [
        keras.saving.deserialize_keras_object(
            {k: v for k, v in cfg.items() if k != "build_config"},
            custom_objects=custom_objects,
        )
        for cfg in _embedding_layer_configs(_read_config(filepath))
    ]
    if isinstance(plan, dict):
        for layer in layers:
            if layer.name in plan:
                layer.sharding = plan[layer.name]
            # A collection's tables by "collection/table" (the plan's names).
            for table, config in getattr(layer, "tables", {}).items():
                if f"{layer.name}/{table}" in plan:
                    config.sharding = plan[f"{layer.name}/{table}"]
        plan = None
    elif plan is not None:
        by_name = {layer.name: layer for layer in layers}
        for table in plan:
            old = table.spec.layer
            if old is not None and old.name in by_name:
                table.spec.layer = by_name[old.name]
    dist = distribution(layers, devices=devices, plan=plan, axis=axis, **plan_kwargs)
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(dist)
    try:
        model = keras.saving.load_model(
            filepath, custom_objects=custom_objects, compile=compile
        )
    finally:
        if not set_distribution:
            keras.distribution.set_distribution(previous)
    return model, dist


def _relayout(layer, axes, mesh):
    variables = [layer.embeddings] + list(getattr(layer, "slots", {}).values())
    d = mesh.shape[0]
    if axes[0] is not None and layer.embeddings.shape[0] % d:
        raise ValueError(
            f"Layer '{layer.name}' is already built with {layer.num_rows} rows, "
            f"not a multiple of the {d} devices of its row sharding; its "
            "variables cannot be padded in place. Build the model after "
            "keras.distribution.set_distribution(...), or save it and reload "
            "it with keras_sparse.sharding.load_model(...)."
        )
    for variable in variables:
        variable._layout = keras.distribution.TensorLayout(axes, mesh)
        variable._direct_assign(variable.value)


def _replicate_other_variables(layer, mesh):
    """Replicates a layer's variables created before the mesh existed.

    A jitted step needs every variable on the mesh; a variable that predates
    the distribution (the hash layer's seed-generator state, created in its
    constructor; ``sparse_iterations`` of a built layer) would stay on one
    device.
    """
    placed = [layer.embeddings] if layer.built else []
    placed += list(getattr(layer, "slots", {}).values())
    for variable in layer.variables:
        if any(variable is p for p in placed) or variable._layout is not None:
            continue
        axes = (None,) * len(variable.shape)
        variable._layout = keras.distribution.TensorLayout(axes, mesh)
        variable._direct_assign(variable.value)


def route(layer):
    """The layer's `TablePlacement` when its lookup must be routed, else None.

    On TensorFlow and PyTorch: the placement the layer was built with
    (`build_placement`). On JAX: made per call, a `JaxMeshPlacement`
    when a ``ModelParallel`` distribution is active and the layer's
    strategy (from `distribution` or its own ``sharding``) is row, column
    or key; None (the unchanged single-device path) otherwise.
    """
    if keras.backend.backend() != "jax":
        return getattr(layer, "placement", None)
    dist = keras.distribution.distribution()
    if dist is None or not isinstance(dist, keras.distribution.ModelParallel):
        return None
    planned = getattr(dist, "keras_sparse_strategies", {})
    if layer.name in planned:
        strategy = planned[layer.name]
        axis = dist.keras_sparse_axis
    else:
        strategy = getattr(layer, "_ks_strategy", None) or layer.sharding
        axis = getattr(layer, "_ks_axis", None) or "model"
    if strategy not in _ROUTED or not planner_lib._is_shardable_layer(layer):
        return None
    check_hash_layer_processes(layer, strategy)
    mesh = dist.device_mesh
    if axis not in mesh.axis_names:
        return None
    slack = getattr(dist, "keras_sparse_row_exchange_slack", None)
    return JaxMeshPlacement(strategy, mesh.backend_mesh, axis, slack)


def build_placement(layer):
    """The placement ``layer`` (about to create its variables) is built
    with on TensorFlow or PyTorch, where a sharded table's variables hold
    only this device's part; None on JAX (`route` decides per call) and
    for a local table."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from keras_sparse.sharding import tf_placement

        return tf_placement.build_placement(layer)
    if backend == "torch":
        from keras_sparse.sharding import torch_placement

        return torch_placement.build_placement(layer)
    return None


# ------------------------------------------------------------ row padding
def padded_rows(num_rows, num_devices):
    """``num_rows`` rounded up to a multiple of ``num_devices``."""
    return -(-int(num_rows) // int(num_devices)) * int(num_devices)


def variable_rows(layer):
    """Rows of ``layer``'s table and slot variables when built now.

    ``layer.num_rows`` unless the active distribution row-shards the layer
    over ``D`` devices with ``num_rows % D != 0``: then the variables get
    `padded_rows` rows, so every device holds an equal block. Ids are always
    ``< num_rows``, so the padding rows are never read or updated.
    """
    routing = route(layer)
    if routing is not None and hasattr(routing, "variable_rows"):
        return routing.variable_rows(layer.num_rows)
    if routing is None or routing.strategy not in ("row", "key"):
        return layer.num_rows
    return padded_rows(layer.num_rows, routing.devices)


def variable_dim(layer):
    """Columns of ``layer``'s table and slot variables when built now:
    ``output_dim``, or this process's part of a table whose placement
    splits the columns (PyTorch and TensorFlow; JAX lays out whole ones)."""
    routing = route(layer)
    if routing is not None and hasattr(routing, "variable_dim"):
        return routing.variable_dim(layer.output_dim)
    return layer.output_dim


class PaddedInitializer:
    """Draws ``num_rows`` rows with ``initializer`` and appends zero rows.

    The real rows get exactly the values of an unpadded build (same shape
    drawn), so a seeded model starts alike on any device count.
    """

    def __init__(self, initializer, num_rows):
        self.initializer = initializer
        self.num_rows = int(num_rows)

    def __call__(self, shape, dtype=None):
        from keras import ops

        values = self.initializer((self.num_rows,) + tuple(shape[1:]), dtype=dtype)
        pad = [(0, shape[0] - self.num_rows)] + [(0, 0)] * (len(shape) - 1)
        return ops.pad(values, pad)


def table_initializer(layer, rows):
    """The initializer of a table variable built with ``rows`` rows."""
    routing = route(layer)
    if routing is not None and hasattr(routing, "table_initializer"):
        return routing.table_initializer(layer.embeddings_initializer, layer.num_rows)
    if rows == layer.num_rows:
        return layer.embeddings_initializer
    return PaddedInitializer(layer.embeddings_initializer, layer.num_rows)


def loaded_shape(layer, variable):
    """The shape `padded_value` gives a loadable value of ``variable``: the
    variable's own, or the whole table's where a placement holds a part."""
    routing = route(layer)
    if _is_row_state(layer, variable) and hasattr(routing, "saved_shape"):
        return routing.saved_shape(variable, layer.num_rows)
    return tuple(variable.shape)


def assign_value(layer, variable, value):
    """Assigns a value checked against `loaded_shape` (a placement that
    holds a part of the table keeps its own part)."""
    routing = route(layer)
    if _is_row_state(layer, variable) and hasattr(routing, "assign_saved"):
        routing.assign_saved(variable, layer.num_rows, value)
    else:
        variable.assign(value)


def _is_row_state(layer, variable):
    """True for the table and slot variables (the ones that can be padded)."""
    candidates = [layer.embeddings] + list(getattr(layer, "slots", {}).values())
    return any(variable is c for c in candidates)


def variable_options(layer):
    """Extra ``add_weight`` arguments of the table and slot variables (e.g.
    per-replica variables for a table sharded under tf.distribute)."""
    routing = route(layer)
    if routing is not None and hasattr(routing, "variable_options"):
        return routing.variable_options()
    return {}


def unpadded_value(layer, variable):
    """The variable's value as NumPy without padding rows (for saving): the
    whole table's rows even where this device holds only a part."""
    routing = route(layer)
    if _is_row_state(layer, variable) and hasattr(routing, "saved_value"):
        return routing.saved_value(variable, layer.num_rows)
    value = variable.numpy()
    if _is_row_state(layer, variable) and value.shape[0] > layer.num_rows:
        value = value[: layer.num_rows]
    return value


def padded_value(layer, variable, value):
    """``value`` (saved with ``num_rows`` rows) padded to the variable's rows.

    Checkpoints hold unpadded arrays, so they load under any device count;
    the padding rows are zeros.
    """
    import numpy as np

    if not _is_row_state(layer, variable):
        return value
    if hasattr(route(layer), "assign_saved"):
        return value  # the placement cuts it (`assign_value`)
    extra = int(variable.shape[0]) - layer.num_rows
    if extra <= 0:
        return value
    value = np.asarray(value)
    if value.shape[0] != layer.num_rows:
        return value  # let assign report the shape mismatch
    pad = [(0, extra)] + [(0, 0)] * (value.ndim - 1)
    return np.pad(value, pad)


# ------------------------------------------------------------ key sharding
def _key_shards(layer):
    """``(D, local mesh positions, routing)`` of a key-sharded layer under
    the active distribution, else None."""
    routing = route(layer)
    if not isinstance(routing, JaxMeshPlacement) or routing.strategy != "key":
        return None
    import jax

    devices = list(routing.mesh.devices.flat)
    me = jax.process_index()
    local = tuple(i for i, dev in enumerate(devices) if dev.process_index == me)
    return routing.devices, local, routing


def place_hash_table(layer):
    """Gives a hash layer about to be built the table its strategy needs: a
    `ShardedHashTable` (a shard per device, this process's shards held)
    under key sharding, else one `HashTable`. Only an empty table is
    replaced; ``layer.num_rows`` follows the new table's capacity."""
    from keras_sparse.table import HashTable
    from keras_sparse.table import ShardedHashTable

    shards = _key_shards(layer)
    table = layer.table
    if shards is None:
        if not isinstance(table, ShardedHashTable):
            return
        new = HashTable(
            layer.requested_capacity,
            eviction=layer.eviction,
            admit_after=layer.admit_after,
            device=table.device,
            seed=layer.table_seed,
        )
    else:
        d, local, _ = shards
        if getattr(table, "num_shards", None) == d and table.local == local:
            return
        new = ShardedHashTable(
            layer.requested_capacity,
            d,
            local=local,
            eviction=layer.eviction,
            admit_after=layer.admit_after,
            device=table.device,
            seed=layer.table_seed,
            gpus=_shard_gpus(local, shards[2].mesh) if table.device == "gpu" else None,
        )
    sharing = [u.name for u in table_users.users(layer) if u is not layer]
    if sharing:
        raise ValueError(
            f"Layer '{layer.name}': its hash table is shared with layer(s) "
            f"{sharing}, and a distribution gives each layer its own sharded "
            "table. Give each layer its own table, or train without a "
            "distribution."
        )
    if table.size:
        raise ValueError(
            f"Layer '{layer.name}': its hash table holds {table.size} keys and "
            f"cannot be re-cut into {type(new).__name__} for the active "
            "distribution. Save the model and reload it with "
            "keras_sparse.sharding.load_model(...)."
        )
    layer.table = new
    layer.num_rows = new.capacity


def _shard_gpus(local, mesh):
    """CUDA device of each local shard: its mesh device's GPU, or GPU 0
    when the mesh runs on CPUs (a GPU table beside a CPU step)."""
    devices = list(mesh.devices.flat)

    def gpu(device):
        if device.platform != "gpu":
            return 0
        return getattr(device, "local_hardware_id", None) or 0

    return {d: gpu(devices[d]) for d in local}


def map_keys_in_step(layer, keys, use, insert, draw=None):
    """``(rows, fresh, init)`` of a key-sharded hash layer's traced flat
    ``keys``/``use`` (see `jax_key_mapping.map_keys`; ``draw``: the layer's
    ``keyed_draw()`` in training), or None when the layer is not
    key-sharded under the active distribution."""
    shards = _key_shards(layer)
    if shards is None:
        return None
    from keras_sparse.sharding import jax_key_mapping

    routing = shards[2]
    mesh, axis, slack = routing.mesh, routing.axis, routing.slack
    from keras_sparse.layers.jax_step_mapping import step_failures

    failures = step_failures(layer)
    routing = jax_key_mapping.KeyRouting(
        layer.table, layer._restore_part, mesh, axis, slack, layer.name, failures
    )
    return jax_key_mapping.map_keys(routing, keys, use, insert, draw)


@dataclasses.dataclass(frozen=True)
class ExchangeBuckets:
    """How an input stage buckets a row-sharded layer's ids (hashable).

    ``devices`` (the batch and the table are split over), ``shard_rows``
    (rows per device) and ``slack`` (`jax_sharded_lookup.row_capacity`).
    """

    devices: int
    shard_rows: int
    slack: float

    def capacity(self, num_ids):
        from keras_sparse.sharding.jax_sharded_lookup import row_capacity

        return row_capacity(num_ids // self.devices, self.devices, self.slack)

    def slots(self, rows, name):
        """`exchange_buckets.exchange_slots` of one batch's ``rows``."""
        import numpy as np

        from keras_sparse.sharding.exchange_buckets import exchange_slots

        rows = np.asarray(rows)
        return exchange_slots(
            rows, self.devices, self.shard_rows, self.capacity(rows.size), name
        )


def exchange_buckets(layer):
    """An `ExchangeBuckets` when ``layer``'s lookup packs ids into compact
    row-exchange buffers under the active distribution (row sharding with a
    ``row_exchange_slack``), else None: full-size buffers need no packing
    and column sharding all-gathers the ids."""
    routing = route(layer)
    if not isinstance(routing, JaxMeshPlacement):
        return None
    if routing.strategy != "row" or routing.slack is None:
        return None
    devices, slack = routing.devices, routing.slack
    rows = int(layer.embeddings.shape[0]) if layer.built else variable_rows(layer)
    return ExchangeBuckets(devices, rows // devices, float(slack))


# ------------------------------------------------------ collection stacks
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
    """

    def __init__(self, name, strategy, dim, tables, offsets, rows, block_rows=None):
        self.name = name
        self.strategy = strategy
        self.dim = int(dim)
        self.tables = tuple(tables)
        self.offsets = dict(offsets)
        self.rows = int(rows)
        self.block_rows = block_rows

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

    Tables group by ``(output_dim, strategy)``, groups ordered by their first
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
        key = (config.output_dim, strategy) + ((f"t{len(groups)}",) if split else ())
        groups.setdefault(key, []).append(name)
    d = int(num_devices)
    stacks = []
    for (dim, strategy, *own), names in groups.items():
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
        name = f"stack_{dim}_{strategy}" + "".join(f"_{n}" for n in own)
        stacks.append(StackLayout(name, strategy, dim, names, offsets, rows, block))
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

    From the active distribution made by `distribution` (JAX only); ``(None,
    1)`` otherwise: without it every table is in a replicated stack (on
    PyTorch with several processes, a table asking for sharding raises).
    """
    if keras.backend.backend() != "jax":
        if keras.backend.backend() == "torch":
            from keras_sparse.sharding import torch_placement

            torch_placement.check_collection(layer)
        return None, 1
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
    if stack.strategy == "data" or keras.backend.backend() != "jax":
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
