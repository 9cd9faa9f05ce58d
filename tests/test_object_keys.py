"""Object-dtype keys (pandas' nullable integer columns) and wide int64 ids:
integers are read as integers, strings only where strings were given, and
anything else is refused with the layer named and nothing changed."""

import keras
import numpy as np
import pandas as pd
import pytest

import keras_sparse as ks
from keras_sparse.table import HashTable


def _layer(name="clicks"):
    return ks.DistributedHashEmbedding(4, capacity=64, optimizer="sgd", name=name)


def _inserted_keys(layer, keys):
    layer(keys, training=True)
    return sorted(layer.export()["keys"].tolist())


def test_object_integers_are_the_integers_not_their_text():
    wide = 2**40 + 7
    column = pd.array([7, 8, wide], dtype="Int64").to_numpy(dtype=object)
    assert column.dtype == object
    got = _inserted_keys(_layer(), column.reshape(1, 3))
    assert got == [7, 8, wide]
    ints = _inserted_keys(_layer(), np.array([[7, 8, wide]], np.int64))
    assert got == ints


def test_object_integers_above_int64_keep_their_bits_like_uint64():
    big = 2**64 - 3
    got = _inserted_keys(_layer(), np.array([[big]], dtype=object))
    ref = _inserted_keys(_layer(), np.array([[big]], dtype=np.uint64))
    assert got == ref == [big - 2**64]


def test_object_strings_are_hashed_as_strings():
    got = _inserted_keys(_layer(), np.array([["a", "b"]], dtype=object))
    assert got == sorted(ks.hash_strings(["a", "b"]).tolist())


@pytest.mark.parametrize(
    "bad",
    [
        [[1.5, 2]],
        [[7, None]],
        [[7, pd.NA]],
        [[7, "8"]],
        [[True, 2]],
        [[7.0, 8.0]],
    ],
    ids=["float", "None", "NA", "mixed", "bool", "integral-float"],
)
def test_other_objects_are_refused_naming_the_layer(bad):
    layer = _layer()
    layer(np.array([[1, 2]]), training=True)
    before = layer.export()
    with pytest.raises(TypeError, match="Layer 'clicks'.*inputs"):
        layer(np.array(bad, dtype=object), training=True)
    after = layer.export()
    np.testing.assert_array_equal(before["keys"], after["keys"])
    np.testing.assert_array_equal(before["values"], after["values"])


def test_out_of_range_object_integers_are_refused():
    with pytest.raises(ValueError, match="Layer 'clicks'.*2\\*\\*64"):
        _layer()(np.array([[2**64]], dtype=object), training=True)


def test_import_reads_object_keys_as_integers():
    layer = _layer()
    layer.build()
    values = np.arange(8, dtype="float32").reshape(2, 4)
    layer.import_(np.array([7, 8], dtype=object), values)
    records = layer.export()
    order = np.argsort(records["keys"])
    assert records["keys"][order].tolist() == [7, 8]
    np.testing.assert_array_equal(records["values"][order], values)
    with pytest.raises(TypeError, match="Layer 'clicks'.*keys"):
        layer.import_(np.array([9, None], dtype=object), values)
    assert layer.table.size == 2


def test_table_reads_object_integers_as_integers_and_refuses_strings():
    a, b = HashTable(64, device="cpu"), HashTable(64, device="cpu")
    keys = np.array([3, 2**63 + 1, -4], dtype=object)
    rows = a.lookup_or_insert(keys).rows
    np.testing.assert_array_equal(
        rows, b.lookup_or_insert(np.array([3, -(2**63) + 1, -4])).rows
    )
    with pytest.raises(TypeError, match="integers"):
        a.lookup_or_insert(np.array(["3"], dtype=object))


def test_collection_refuses_wide_ids_eagerly():
    collection = ks.EmbeddingCollection({"a": ks.TableConfig(10, 4)}, name="feat")
    with pytest.raises(ValueError, match="'feat' table 'a': id 4294967301"):
        collection({"a": np.array([[2**32 + 5]], np.int64)})
    out = collection({"a": np.array([[5]], np.int64)})["a"]
    table = keras.ops.convert_to_numpy(
        collection.stack_variables(collection.stacks[0].name)[0]
    )
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(out)[0, 0],
        table[collection.stacks[0].offsets["a"] + 5],
    )
