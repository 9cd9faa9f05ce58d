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
    return {"row": (axis, None), "column": (None, axis), "data": (None, None)}[
        strategy
    ]


def _variable_names(layer):
    names = ["embeddings"]
    opt = getattr(layer, "sparse_optimizer", None)
    if opt is not None:
        names += [spec.name for spec in opt.slot_specs()]
    return names


def distribution(
    model_or_layers, devices=None, plan=None, axis="model", **plan_kwargs
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
    return dist


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
    strategy = getattr(layer, "_ks_strategy", None) or layer.sharding
    if strategy not in _ROUTED:
        return None
    axis = getattr(layer, "_ks_axis", None) or "model"
    mesh = dist.device_mesh
    if axis not in mesh.axis_names:
        return None
    return strategy, mesh.backend_mesh, axis


def routed_lookup(routing):
    """A drop-in for ``ops.jax_lookup.lookup_with_sparse_update`` that runs the
    sharded primitive for ``routing`` (from `route`)."""
    from keras_sparse.sharding import jax_sharded_lookup

    strategy, mesh, axis = routing

    def lookup(
        table_var, slot_vars, anchor_var, optimizer, ids, valid, iterations,
        constraint=None, apply_update=True, reset=None,
    ):
        del anchor_var  # the table itself carries the update on JAX
        if reset is not None:
            raise NotImplementedError(
                "keras_sparse.sharding: row resets are not supported by the "
                "sharded lookup yet."
            )
        slots = {name: var.value for name, var in slot_vars.items()}
        return jax_sharded_lookup.sharded_lookup_with_sparse_update(
            strategy, mesh, axis, table_var.value, slots, optimizer, ids, valid,
            iterations, constraint, apply_update=apply_update,
        )

    return lookup


def routed_gather(routing, table_var, ids, valid):
    from keras_sparse.sharding import jax_sharded_lookup

    strategy, mesh, axis = routing
    return jax_sharded_lookup.sharded_gather(
        strategy, mesh, axis, table_var.value, ids, valid
    )
