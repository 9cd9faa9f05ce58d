"""The public entry points of sharding on JAX: `distribution` (a
``ModelParallel`` from a plan) and `load_model` (a saved model under a
new device count or plan).

Layout: a 1-D device mesh with one axis (``"model"`` by default) that is both
the batch (data-parallel) axis of the dense part of the model and the axis the
tables are split over, the usual hybrid-parallel recommender layout.
"""

import re

import keras

from keras_sparse.sharding import plan_spec
from keras_sparse.sharding import planner as planner_lib
from keras_sparse.sharding.layouts import _axes
from keras_sparse.sharding.layouts import _relayout
from keras_sparse.sharding.layouts import _replicate_other_variables
from keras_sparse.sharding.layouts import _variable_names
from keras_sparse.sharding.routing import check_hash_layer_processes
from keras_sparse.sharding.stacks import _relayout_collection
from keras_sparse.sharding.stacks import collection_stacks

#: Strategies the Keras integration can run ("table": for the tables of an
#: `EmbeddingCollection`).
RUNNABLE = ("data", "table", "row", "column", "key")


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
            shards, skewed id ranges need more. Key-sharded hash layers:
            it sizes the key exchange (`jax_key_mapping.key_capacity`),
            whose slots their row lookup reuses (default: a bound that only
            keys built to collide exceed).

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
        if plan_spec.is_collection(layer):
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
                "keras_sparse.sharding.stacks). Put the table in "
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
        if not plan_spec.is_collection(table.spec.layer)
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
