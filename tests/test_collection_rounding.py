"""16-bit tables of an `EmbeddingCollection` (``TableConfig(table_dtype=,
stochastic_rounding=, slot_dtype=)``): each trains exactly as a separate
`AllToAllDenseEmbedding` with the same settings, in a stack of its own;
saves keep the dtypes; sharded row-wise on JAX they equal one device."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_sparse as ks
from keras_sparse.layers.arguments import ArgumentError
from keras_sparse.ops import row_rounding

SPECS = {
    "a": {"table_dtype": "bfloat16"},
    "a2": {"table_dtype": "bfloat16"},  # same storage: still its own stack
    "h": {"table_dtype": "float16", "slot_dtype": "float16",
          "stochastic_rounding": False},
}  # fmt: skip


def _f32(value):
    return ops.convert_to_numpy(ops.cast(value, "float32"))


def _init(i):
    return keras.initializers.RandomUniform(seed=i)


def _loss(y, p):
    return ops.sum(p * p)


def _fit(layers, specs, ids):
    """Fits ``layers`` (``{name: layer}``, or one collection) on ``ids``."""
    inputs = {k: keras.Input((2,), dtype="int32", name=k) for k in specs}
    if isinstance(layers, dict):
        out = {k: layers[k](inputs[k]) for k in specs}
    else:
        out = layers(inputs)
    model = keras.Model(inputs, keras.layers.Concatenate()([out[k] for k in specs]))
    model.compile("sgd", _loss)
    model.fit(ids, np.zeros((24, 1)), batch_size=8, verbose=0, shuffle=False)
    return model


def _collection(specs, **table_args):
    tables = {
        k: ks.TableConfig(
            16 + i,
            4,
            combiner="sum",
            embeddings_initializer=_init(i),
            **v,
            **table_args,
        )  # fmt: skip
        for i, (k, v) in enumerate(specs.items())
    }
    return ks.EmbeddingCollection(
        tables, optimizer=ks.optimizers.Adagrad(0.05), name="coll"
    )


def _ids(specs):
    rng = np.random.default_rng(0)
    return {k: rng.integers(0, 16, (24, 2)) for k in specs}


def test_collection_tables_train_as_separate_layers_and_save(tmp_path):
    ids = _ids(SPECS)
    coll = _collection(SPECS)
    model = _fit(coll, SPECS, ids)
    layers = {
        k: ks.AllToAllDenseEmbedding(
            16 + i,
            4,
            combiner="sum",
            embeddings_initializer=_init(i),
            optimizer=ks.optimizers.Adagrad(0.05),
            **v,
        )  # fmt: skip
        for i, (k, v) in enumerate(SPECS.items())
    }
    _fit(layers, SPECS, ids)
    for stack in coll.stacks:
        table, *slots = coll.stack_variables(stack.name)
        storage = coll.tables[stack.tables[0]].storage
        assert row_rounding.dtype_name(table.dtype) == (
            storage.table_dtype or "float32"
        )
        assert {row_rounding.dtype_name(s.dtype) for s in slots} == {
            storage.slot_dtype or "float32"
        }
        if storage.is_sixteen_bit():
            assert len(stack.tables) == 1, stack
    for k, layer in layers.items():
        got = coll.get_table(k)
        np.testing.assert_array_equal(_f32(got), _f32(layer.embeddings.value), k)
        assert not np.array_equal(_f32(got), _f32(_init(list(SPECS).index(k))(
            (16 + list(SPECS).index(k), 4))))  # trained  # fmt: skip
    path = str(tmp_path / "c.keras")
    model.save(path)
    loaded = keras.models.load_model(path, compile=False, safe_mode=False)
    again = next(x for x in loaded.layers if isinstance(x, ks.EmbeddingCollection))
    assert again.tables["h"].storage.config() == coll.tables["h"].storage.config()
    assert again.get_config()["tables"]["a"]["table_dtype"] == "bfloat16"
    plain = ks.EmbeddingCollection({"f": ks.TableConfig(8, 4)}, optimizer="sgd")
    assert "table_dtype" not in plain.get_config()["tables"]["f"]
    for stack in again.stacks:
        dtype = again.tables[stack.tables[0]].storage.table_dtype or "float32"
        assert row_rounding.dtype_name(again.stack_variables(stack.name)[0].dtype) == (
            dtype
        )
    for k in SPECS:
        np.testing.assert_array_equal(_f32(again.get_table(k)), _f32(coll.get_table(k)))


def test_storage_settings_are_checked():
    with pytest.raises(ArgumentError, match="TableConfig: `table_dtype` must be"):
        ks.TableConfig(8, 4, table_dtype="float64")
    with pytest.raises(ArgumentError, match="'c' table 't'.*sparse `optimizer`"):
        ks.EmbeddingCollection(
            {"t": ks.TableConfig(8, 4, slot_dtype="bfloat16")}, name="c"
        )
    with pytest.raises(ArgumentError, match="combined with `cache_rows`"):
        ks.TableConfig(8, 4, cache_rows=4, table_dtype="bfloat16")
    for where in ({"sharding": "table"}, {}):
        collection = {} if where else {"sharding": "column"}
        with pytest.raises(ArgumentError, match="cannot be sharded '(table|column)'"):
            ks.EmbeddingCollection(
                {"t": ks.TableConfig(8, 4, table_dtype="bfloat16", **where)},
                optimizer="sgd", **collection,
            )  # fmt: skip


def test_row_sharded_collection_rounds_as_one_device():
    if keras.backend.backend() != "jax":
        pytest.skip("keras_sparse.sharding distributions are JAX's")
    from keras_sparse import sharding

    specs = {"r": {"table_dtype": "bfloat16"}, "d": {"table_dtype": "float16"}}
    pins = {"r": "row", "d": "data"}
    ids = _ids(specs)
    tables = []
    for distributed in (False, True):
        coll = ks.EmbeddingCollection(
            {k: ks.TableConfig(16 + i, 4, combiner="sum", sharding=pins[k],
                               embeddings_initializer=_init(i), **v)
             for i, (k, v) in enumerate(specs.items())},
            optimizer=ks.optimizers.Adagrad(0.05), name="coll",
        )  # fmt: skip
        if distributed:
            keras.distribution.set_distribution(
                sharding.distribution([coll], devices=8)
            )
        try:
            _fit(coll, specs, ids)
            tables.append({k: _f32(coll.get_table(k)) for k in specs})
            strategies = {s.strategy for s in coll.stacks}
        finally:
            keras.distribution.set_distribution(None)
    assert strategies == {"row", "data"}
    for k in specs:
        np.testing.assert_array_equal(tables[1][k], tables[0][k], k)
    coll = _collection({"t": {"table_dtype": "bfloat16"}})
    with pytest.raises(ValueError, match="16-bit table .* not sharded table-wise"):
        sharding.plan([coll], devices=8, pinned={"coll/t": "table"})
