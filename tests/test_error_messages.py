"""Errors in the user's terms: each names the layer, the argument and what
would be valid, and in-step table errors keep their own type."""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.table import TableFullError


def _hashed(**kwargs):
    args = dict(capacity=64, optimizer="sgd", combiner="sum", name="users")
    args.update(kwargs)
    return ks.DistributedHashEmbedding(4, **args)


def test_misspelt_argument_names_the_close_valid_ones():
    with pytest.raises(
        TypeError, match=r"'users'.*`eviciton` \(did you mean `eviction`"
    ):
        _hashed(eviciton="lru")
    # Also a ValueError, as Keras raises for unknown keywords.
    with pytest.raises(ValueError, match=r"`dim` \(did you mean `output_dim`"):
        ks.DistributedHashEmbedding(dim=8, capacity=64, optimizer="sgd")


def test_missing_required_arguments_say_what_they_mean():
    with pytest.raises(
        TypeError, match=r"missing `capacity` \(rows of the hash table\)"
    ):
        ks.DistributedHashEmbedding(8, optimizer="sgd", name="users")
    with pytest.raises(
        TypeError, match=r"missing `output_dim` \(the embedding width\)"
    ):
        ks.DistributedHashEmbedding(capacity=64, optimizer="sgd")


def test_a_batch_larger_than_the_table_names_layer_and_capacity():
    layer = _hashed(eviction=None)
    with pytest.raises(ValueError, match=r"'users'.*capacity=64.*`capacity` argument"):
        layer(np.arange(100), training=True)
    assert layer.table.size == 0


def test_ragged_python_lists_point_to_ragged_to_padded():
    with pytest.raises(
        ValueError, match=r"'users'.*ragged Python list.*ragged_to_padded"
    ):
        _hashed()([[1, 2], [3]])
    ids, weights = ks.ragged_to_padded([1, 2, 3], [2, 1])
    assert tuple(_hashed(name="ok")(ids, weights=weights).shape) == (2, 4)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiled steps")
def test_a_full_table_inside_fit_raises_the_table_error_itself():
    """Not JAX's runtime-error wrapper around a callback traceback."""
    layer = _hashed(eviction=None)
    x = keras.Input((2,), dtype="int32")
    model = keras.Model(x, keras.layers.Dense(1)(layer(x)))
    model.compile("sgd", "mse")
    keys = np.arange(400).reshape(200, 2)
    with pytest.raises(TableFullError, match=r"Layer 'users'.*eviction=None"):
        model.fit(keys, np.zeros((200, 1)), batch_size=20, verbose=0)


def test_drop_in_layer_names_close_arguments_too():
    with pytest.raises(TypeError, match=r"`combinr` \(did you mean `combiner`"):
        ks.AllToAllDenseEmbedding(10, 4, combinr="sum", name="items")
    with pytest.raises(
        ValueError, match=r"'items'.*`optimiser` \(did you mean `optimizer`"
    ):
        ks.AllToAllDenseEmbedding(10, 4, optimiser="adagrad", name="items")
    # Keras layer arguments still pass through.
    layer = ks.AllToAllDenseEmbedding(10, 4, name="items", dtype="float32")
    assert layer.name == "items"


def test_embedding_collection_names_close_arguments_and_table_settings():
    tables = {"user": ks.TableConfig(100, 8)}
    with pytest.raises(
        ValueError, match=r"'features'.*`optimiser` \(did you mean `optimizer`"
    ):
        ks.EmbeddingCollection(tables, optimiser="adagrad", name="features")
    with pytest.raises(
        TypeError,
        match=r"'features', table 'user'.*`combinr` \(did you mean `combiner`",
    ):
        ks.EmbeddingCollection(
            {"user": {"input_dim": 100, "output_dim": 8, "combinr": "sum"}},
            name="features",
        )
    # Keras layer arguments still pass through.
    layer = ks.EmbeddingCollection(tables, name="features", dtype="float32")
    assert layer.name == "features"


@pytest.mark.parametrize(
    "argument, value, valid",
    [
        ("eviction", "LRU", r" \(did you mean 'lru'\?\)\. Valid choices are "
         r"'lru', 'lfu', None\."),
        ("table_device", "GPU0", r"\. Valid choices are 'cpu', 'gpu', 'auto'\."),
    ],
    ids=["eviction", "table_device"],
)  # fmt: skip
def test_hash_layer_choices_name_layer_argument_and_valid_values(
    argument, value, valid
):
    with pytest.raises(ValueError, match=f"^Layer 'users': unknown `{argument}`="):
        _hashed(**{argument: value})
    with pytest.raises(ValueError, match=valid):
        ks.DistributedHashEmbedding(4, capacity=64, **{argument: value})
    # Refused before Keras's Layer setup: not even its name was taken.
    assert ks.DistributedHashEmbedding(4, capacity=64).name == (
        "distributed_hash_embedding"
    )


def test_hash_layer_table_seed_must_be_an_integer():
    with pytest.raises(ValueError, match=r"'users': `table_seed` must be an integ"):
        _hashed(table_seed="7")


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX steps")
@pytest.mark.parametrize("declared", ["string", "int64"])
def test_string_keys_in_jax_fit_name_the_layer_and_hash_strings(declared):
    layer = _hashed(name="items")
    item = keras.Input((1,), dtype=declared, name="item")
    model = keras.Model(item, keras.layers.Dense(1)(layer(item)))
    model.compile("sgd", "mse")
    words = np.array([["a"], ["b"], ["c"], ["a"]])
    y = np.ones((4, 1), "float32")
    said = "declared as keras.Input" if declared == "string" else "given as a NumPy"
    with pytest.raises(
        TypeError,
        match=rf"^Layer 'items': its keys, input 'item', are strings \({said}.*"
        r"keras_sparse\.hash_strings\(keys\).*keras_sparse\.data\.prefetch",
    ):
        model.fit(words, y, batch_size=2, verbose=0)
    with pytest.raises(TypeError, match="hash_strings"):
        model.predict(words, verbose=0)
    assert layer.table.size == 0  # refused before any step
    if declared == "int64":
        # What the message says works: hashed on the host, a key gets the
        # row its string gets.
        model.fit(ks.hash_strings(words), y, batch_size=2, verbose=0)
        assert layer.table.size == 3
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(layer(np.array([["c"]]))),
            keras.ops.convert_to_numpy(layer(ks.hash_strings(np.array([["c"]])))),
        )
