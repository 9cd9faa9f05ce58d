"""`ks.sharding.apply_plan`: a plan's strategies become the layers'
``sharding`` before they are built (TensorFlow and PyTorch place tables
from it at build), with clear errors for what a backend cannot build.

The TensorFlow check under a strategy of 2 replicas runs in the worker
processes of tests/test_tf_multiworker.py (a strategy needs a fresh
process); here: the layers' values, the refusals, and torch's process-count
check (one gloo process).
"""

import keras
import pytest

import keras_sparse as ks
from keras_sparse.sharding import RUNNABLE

BACKEND = keras.backend.backend()


def _layers():
    """A table too big to replicate under the memory budget below, a small
    one, a hash layer and a collection of two tables."""
    return [
        ks.AllToAllDenseEmbedding(4000, 8, optimizer="adagrad", name="big"),
        ks.AllToAllDenseEmbedding(10, 8, optimizer="adagrad", name="small"),
        ks.DistributedHashEmbedding(8, capacity=64, optimizer="adagrad", name="h"),
        ks.EmbeddingCollection(
            {"a": ks.TableConfig(30, 4), "b": ks.TableConfig(20, 4)},
            optimizer="adagrad",
            name="col",
        ),
    ]


def _plan(layers, devices=2, **kwargs):
    kwargs.setdefault("strategies", ks.sharding.runnable_strategies())
    return ks.sharding.plan(layers, devices=devices, memory_per_device=200_000,
                            **kwargs)  # fmt: skip


def _shardings(layers):
    big, small, h, col = layers
    return {
        "big": big.sharding,
        "small": small.sharding,
        "h": h.sharding,
        "col/a": col.tables["a"].sharding,
        "col/b": col.tables["b"].sharding,
    }


def test_apply_sets_each_unbuilt_layers_sharding():
    layers = _layers()
    plan = _plan(layers)
    assert set(_shardings(layers).values()) == {"auto"}
    assert ks.sharding.apply_plan(plan) is plan
    # 4000 x 8 float32 with its adagrad slot (250 KiB) cannot be replicated
    # in 200 kB: the planner splits it; the small tables stay replicated.
    assert _shardings(layers) == {
        "big": "row", "small": "data", "h": "data", "col/a": "data", "col/b": "data",
    }  # fmt: skip
    assert _shardings(layers) == {t.name: t.strategy for t in plan}
    assert layers[0].get_config()["sharding"] == "row"  # saved with the model


def test_runnable_strategies():
    assert ks.sharding.runnable_strategies("jax") == RUNNABLE
    for backend in ("tensorflow", "torch"):
        assert ks.sharding.runnable_strategies(backend) == RUNNABLE


def _error(plan, backend=None):
    with pytest.raises(ValueError) as info:
        ks.sharding.apply_plan(plan, backend=backend)
    return str(info.value)


@pytest.mark.parametrize(
    "backend, pinned, table, kind, runnable",
    [
        ("tensorflow", {"h": "row"}, "h", "hash table", "('data', 'key')"),
        ("torch", {"h": "row"}, "h", "hash table", "('data', 'key')"),
        ("torch", {"h": "column"}, "h", "hash table", "('data', 'key')"),
    ],
)
def test_refuses_what_the_backend_cannot_build(backend, pinned, table, kind, runnable):
    layers = _layers()
    plan = _plan(layers, pinned=pinned, strategies=RUNNABLE)
    error = _error(plan, backend)
    strategy = pinned[table]
    assert f"Table '{table}'" in error and f"strategy {strategy!r}" in error
    assert f"for a {kind} on the {backend} backend" in error
    assert f"runnable: {runnable}" in error
    # Nothing changed: the refusal comes before any layer is set.
    assert set(_shardings(layers).values()) == {"auto"}
    # JAX runs them all (its distribution places them per call).
    ks.sharding.apply_plan(plan, backend="jax")
    assert _shardings(layers)[table] == strategy


def test_refuses_a_built_layer_with_another_sharding():
    layers = _layers()
    layers[0].build()
    error = _error(_plan(layers))
    assert "Table 'big'" in error and "layer 'big' is already built" in error
    assert "sharding='auto'" in error and "plan's 'row'" in error
    assert layers[1].sharding == "auto"


def test_a_built_layer_already_planned_is_accepted():
    layers = _layers()
    layers[0].sharding = "row"
    layers[0].build()
    plan = _plan(layers)  # a layer's own sharding pins it
    ks.sharding.apply_plan(plan)
    assert layers[0].sharding == "row" and layers[1].sharding == "data"


def test_refuses_a_plan_of_table_specs():
    spec = ks.sharding.TableSpec("t", 100, 8)
    error = _error(ks.sharding.plan([spec], devices=2))
    assert "Table 't'" in error and "no layer" in error


@pytest.mark.skipif(BACKEND != "torch", reason="torch.distributed check")
def test_torch_plan_for_another_process_count(tmp_path):
    """One gloo process: a plan for 2 devices is refused, one for 1 is
    applied."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        layers = _layers()
        error = _error(_plan(layers))
        assert "for 2 devices" in error and "runs 1" in error
        assert "devices=1" in error
        one = ks.sharding.plan(layers, devices=1)
        ks.sharding.apply_plan(one)
        assert set(_shardings(layers).values()) == {"data"}
    finally:
        dist.destroy_process_group()
