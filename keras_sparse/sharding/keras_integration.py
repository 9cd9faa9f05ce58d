"""Keras side of sharding: a ModelParallel distribution from a plan, and the
routing used by ``SparseEmbeddingBase.lookup_rows``.

Layout: a 1-D device mesh with one axis (``"model"`` by default) that is both
the batch (data-parallel) axis of the dense part of the model and the axis the
tables are split over, the usual hybrid-parallel recommender layout.
"""

import re

import keras

from keras_sparse.sharding import planner as planner_lib

#: Strategies the Keras integration can run today.
RUNNABLE = ("data", "row", "column")
_ROUTED = ("row", "column")


def _axes(strategy, axis):
    return {"row": (axis, None), "column": (None, axis), "data": (None, None)}[strategy]


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
        plan = planner_lib.plan(model_or_layers, devices=len(devices), **plan_kwargs)
    if plan.num_devices != len(devices):
        raise ValueError(
            f"The plan is for {plan.num_devices} devices; got {len(devices)}."
        )
    mesh = keras.distribution.DeviceMesh((len(devices),), [axis], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    for table in plan:
        layer = table.spec.layer
        if layer is None:
            raise ValueError(
                f"Table '{table.name}': the plan was made from a TableSpec "
                "without a layer; plan from the model or its layers."
            )
        if table.strategy not in RUNNABLE:
            raise NotImplementedError(
                f"Table '{table.name}': strategy {table.strategy!r} is planned "
                f"but not runnable yet (runnable: {RUNNABLE}). Re-plan with "
                f"strategies={RUNNABLE!r} or pin another strategy."
            )
        axes = _axes(table.strategy, axis)
        layer._ks_strategy = table.strategy
        layer._ks_axis = axis
        for name in _variable_names(layer):
            pattern = f"(.*/)?{re.escape(layer.name)}/{re.escape(name)}"
            layout_map[pattern] = axes
        if layer.built:
            _relayout(layer, axes, mesh)
    dist = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name=axis)
    dist.keras_sparse_plan = plan
    # Looked up by layer name in `route`, so layers deserialized later (e.g. by
    # `load_model`) follow this plan rather than their saved `sharding`.
    dist.keras_sparse_strategies = {
        table.spec.layer.name: table.strategy for table in plan
    }
    dist.keras_sparse_axis = axis
    dist.keras_sparse_row_exchange_slack = row_exchange_slack
    return dist


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
    layers = [
        keras.saving.deserialize_keras_object(cfg, custom_objects=custom_objects)
        for cfg in _embedding_layer_configs(_read_config(filepath))
    ]
    if isinstance(plan, dict):
        for layer in layers:
            if layer.name in plan:
                layer.sharding = plan[layer.name]
        plan = None
    elif plan is not None:
        by_name = {layer.name: layer for layer in layers}
        for table in plan:
            if table.spec.layer is not None and table.name in by_name:
                table.spec.layer = by_name[table.name]
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
    for variable in variables:
        variable._layout = keras.distribution.TensorLayout(axes, mesh)
        variable._direct_assign(variable.value)


def route(layer):
    """``(strategy, jax mesh, axis)`` when ``layer``'s lookup must be routed.

    None (the unchanged single-device path) unless the backend is JAX, a
    ``ModelParallel`` distribution is active, and the layer's strategy (from
    `distribution` or its own ``sharding``) is row or column.
    """
    if keras.backend.backend() != "jax":
        return None
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
    mesh = dist.device_mesh
    if axis not in mesh.axis_names:
        return None
    slack = getattr(dist, "keras_sparse_row_exchange_slack", None)
    return strategy, mesh.backend_mesh, axis, slack


def routed_lookup(routing):
    """A drop-in for ``ops.jax_lookup.lookup_with_sparse_update`` that runs the
    sharded primitive for ``routing`` (from `route`)."""
    from keras_sparse.sharding import jax_sharded_lookup

    strategy, mesh, axis, slack = routing

    def lookup(
        table_var,
        slot_vars,
        anchor_var,
        optimizer,
        ids,
        valid,
        iterations,
        constraint=None,
        apply_update=True,
        reset=None,
    ):
        del anchor_var  # the table itself carries the update on JAX
        if reset is not None:
            raise NotImplementedError(
                "keras_sparse.sharding: row resets are not supported by the "
                "sharded lookup yet."
            )
        slots = {name: var.value for name, var in slot_vars.items()}
        return jax_sharded_lookup.sharded_lookup_with_sparse_update(
            strategy,
            mesh,
            axis,
            table_var.value,
            slots,
            optimizer,
            ids,
            valid,
            iterations,
            constraint,
            apply_update=apply_update,
            slack=slack,
        )

    return lookup


def routed_gather(routing, table_var, ids, valid):
    from keras_sparse.sharding import jax_sharded_lookup

    strategy, mesh, axis, slack = routing
    return jax_sharded_lookup.sharded_gather(
        strategy, mesh, axis, table_var.value, ids, valid, slack
    )
