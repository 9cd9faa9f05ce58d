"""One way to ask for a plan on every backend: `apply_plan`.

`keras_sparse.sharding.plan` picks a strategy per table. JAX places tables
per call from the active distribution (``ks.distribution(..., plan=plan)``);
TensorFlow and PyTorch fix a table's placement when its layer is built, from
the layer's ``sharding``. `apply_plan` writes the plan's strategies into the
(still unbuilt) layers, so one model-building script runs on every backend
and only the backend's setup lines differ (docs/guides/multi-device.md).
"""

import keras

from keras_sparse.sharding.entry_points import RUNNABLE
from keras_sparse.sharding.plan_spec import TableSpec
from keras_sparse.sharding.plan_spec import is_hash_layer

# What a layer built with each ``sharding`` runs on TensorFlow and PyTorch,
# by backend and kind of table (JAX runs every strategy of `RUNNABLE`).
_BUILT_RUNNABLE = {
    "tensorflow": {
        "table": ("data", "row", "column"),  # AllToAllDenseEmbedding
        "hash table": ("data", "key"),  # DistributedHashEmbedding
        "collection table": ("data", "table", "row", "column"),
    },
    "torch": {
        "table": ("data", "row", "column"),
        "hash table": ("data", "key"),
        "collection table": ("data", "table", "row", "column"),
    },
}


def _runnable(backend, kind, devices=None):
    if backend == "jax":
        return RUNNABLE
    if kind == "hash table" and (devices or 1) > 1:
        # One key map per replica or process cannot train there.
        return ("key",)
    return _BUILT_RUNNABLE[backend][kind]


def runnable_strategies(backend=None):
    """The strategies ``backend`` (default: Keras's) runs, to pass as
    ``plan(..., strategies=...)``."""
    backend = backend or keras.backend.backend()
    if backend == "jax":
        return RUNNABLE
    kinds = _BUILT_RUNNABLE[backend].values()
    return tuple(s for s in RUNNABLE if any(s in k for k in kinds))


def _kind(table):
    spec = table.spec
    if spec.collection_table is not None:
        return "collection table"
    return "hash table" if is_hash_layer(spec.layer) else "table"


def _current(table):
    spec = table.spec
    if spec.collection_table is not None:
        return spec.layer.tables[spec.collection_table].sharding
    return spec.layer.sharding


def _check(table, backend, devices=None):
    """Raises for what ``backend`` cannot build ``table`` with."""
    spec, strategy = table.spec, table.strategy
    if spec.layer is None:
        raise ValueError(
            f"Table '{spec.name}': the plan has no layer to apply it to (it "
            "was planned from a TableSpec). Plan the model's layers: "
            "ks.sharding.plan(layers, ...)."
        )
    runnable = _runnable(backend, _kind(table), devices)
    if strategy not in runnable:
        raise ValueError(
            f"Table '{spec.name}': the plan's strategy {strategy!r} is not "
            f"runnable for a {_kind(table)} on the {backend} backend "
            f"(runnable: {runnable}). Plan again with pinned="
            f"{{{spec.name!r}: 'data'}} or strategies={runnable}."
        )
    if table.cache_rows is not None:
        held = TableSpec.from_layer(spec.layer).device_rows
        if held > spec.device_rows:
            arg = "capacity" if spec.hash_keys else "cache_rows"
            raise ValueError(
                f"Table '{spec.name}': layer '{spec.layer.name}' holds a cache "
                f"of {held} rows, more than the {spec.device_rows} the plan "
                f"fits on the device. Create the layer with {arg}="
                f"{table.cache_rows} (the plan's proposal) and plan again."
            )
    if spec.layer.built and _current(table) != strategy:
        raise ValueError(
            f"Table '{spec.name}': layer '{spec.layer.name}' is already built "
            f"with sharding={_current(table)!r}; a table's placement is fixed "
            f"when it is built, so the plan's {strategy!r} cannot apply. "
            "Apply the plan to the layers before building the model."
        )


def _devices_in_use(backend):
    """Devices a built layer would be sharded over now, or None (unknown)."""
    if backend == "tensorflow":
        import tensorflow as tf

        if tf.distribute.has_strategy():
            return tf.distribute.get_strategy().num_replicas_in_sync
    if backend == "torch":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from keras_sparse.sharding import torch_placement

            # The tables shard over their own group (`set_torch_process_group`).
            where = torch_placement.process_group()
            return 1 if where is None else where[1]
    return None


def apply_plan(plan, backend=None):
    """Sets each planned layer's ``sharding`` (an `EmbeddingCollection`
    table's: its `TableConfig`'s) to the plan's strategy.

    Call it before the layers are built: under ``strategy.scope()`` on
    TensorFlow, after ``init_process_group`` on PyTorch. On JAX also pass the
    plan to ``ks.distribution(..., plan=plan)``.

    Raises:
        ValueError: (before changing any layer) a strategy ``backend``
            cannot build for that table, a built layer whose sharding
            differs from the plan's, a table planned without its layer, or
            a plan for another device count than the active strategy's
            replicas (TensorFlow) or processes (PyTorch), or a layer whose
            cache is larger than the one the plan sized for it.
    """
    backend = backend or keras.backend.backend()
    in_use = _devices_in_use(backend)
    if in_use is not None and in_use != plan.num_devices:
        raise ValueError(
            f"The plan is for {plan.num_devices} devices but the "
            f"{backend} backend runs {in_use} (replicas or processes). Plan "
            f"with devices={in_use}."
        )
    tables = list(plan)
    for table in tables:
        _check(table, backend, in_use)
    for table in tables:
        spec = table.spec
        if spec.collection_table is not None:
            spec.layer.tables[spec.collection_table].sharding = table.strategy
        else:
            spec.layer.sharding = table.strategy
    return plan


__all__ = ["apply_plan", "runnable_strategies"]
