"""The hash layer's one key-mapping interface: every route is a `KeyMapper`
giving `MappedKeys`, and a training table call's result carries the keys
it evicted, from which the row store plans its write-backs."""

import numpy as np

import keras_sparse as ks
from keras_sparse.layers.hash import key_mapping
from keras_sparse.layers.hash.key_mapper import KeyMapper
from keras_sparse.layers.hash.key_mapper import MappedKeys
from keras_sparse.layers.hash.key_mapper import UndoCollector
from keras_sparse.table import HashTable


def test_every_route_is_a_key_mapper():
    assert set(key_mapping.ROUTES) == {
        "host",
        "gpu",
        "jax_step",
        "key_sharded",
        "tf_graph",
        "serving_map",
        "shape_only",
    }
    assert all(isinstance(r, KeyMapper) for r in key_mapping.ROUTES.values())
    assert not isinstance(object(), KeyMapper)


def test_eager_call_maps_through_the_host_route_to_mapped_keys():
    layer = ks.DistributedHashEmbedding(2, capacity=64, optimizer="sgd")
    layer.build()
    keys = np.array([[5, 9], [5, 0]], np.int64)
    use = np.array([True, True, True, False])
    assert key_mapping.route_of(layer, keys) is key_mapping.ROUTES["host"]
    mapped = key_mapping.map_keys(layer, keys, use, insert=True)
    assert isinstance(mapped, MappedKeys)
    rows = np.asarray(mapped.rows)
    # A dict of the table's own key->row map is the reference.
    table = dict(zip(*(np.asarray(x).tolist() for x in layer.table.export()[:2])))
    assert rows.tolist() == [table[5], table[9], table[5], -1]
    assert np.asarray(mapped.fresh).tolist() == [True, True, False, False]


def test_table_call_result_names_the_keys_it_evicted():
    table = HashTable(64, eviction="lru")
    first = np.arange(1, 65, dtype=np.int64)
    table.lookup_or_insert_fresh(first)
    held = dict(zip(*(np.asarray(x).tolist() for x in table.export()[:2])))
    second = np.arange(1000, 1032, dtype=np.int64)
    undo = UndoCollector()
    res, fresh = table.lookup_or_insert_fresh(second, undo=undo)
    mapped = MappedKeys.of_table_call(second, res.rows, fresh, undo.record)
    now = set(np.asarray(table.export()[0]).tolist())
    gone = sorted(set(held) - now)
    assert gone and sorted(mapped.evicted_keys.tolist()) == gone
    # Each evicted key's row is the one it held before this call.
    assert [held[k] for k in mapped.evicted_keys.tolist()] == (
        mapped.evicted_rows.tolist()
    )
    empty = MappedKeys.of_table_call(second, res.rows, fresh)
    assert empty.evicted_keys.size == 0 and empty.keys is second


def test_row_store_plans_the_write_backs_of_the_call_result():
    layer = ks.DistributedHashEmbedding(
        2, capacity=64, optimizer="sgd", store=ks.store.Host(), name="planned"
    )
    layer.build()
    layer.map_host_keys(np.arange(1, 65, dtype=np.int64), None, True)
    held = dict(zip(*(np.asarray(x).tolist() for x in layer.table.export()[:2])))
    layer.map_host_keys(np.arange(1000, 1032, dtype=np.int64), None, True)
    plan = layer.row_tier.plans[-1]
    now = set(np.asarray(layer.table.export()[0]).tolist())
    gone = sorted(set(held) - now)
    assert gone and sorted(plan.victim_keys.tolist()) == gone
    assert [held[k] for k in plan.victim_keys.tolist()] == plan.victim_rows.tolist()
    layer.row_tier.drop_plans()
