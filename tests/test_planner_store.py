"""The planner with row stores: the device holds a cache, the store the
table; the plan counts each level and sizes caches for a memory budget."""

from collections import Counter

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.sharding import plan_store
from keras_sparse.sharding.plan_apply import apply_plan
from keras_sparse.sharding.plan_spec import TableSpec
from keras_sparse.store import FieldSpec
from keras_sparse.store import HostStore

SERVING = ("serving_key_words", "serving_rows", "serving_directory")


def dense(input_dim=3000, dim=4, cache_rows=300, store="host", name="ids"):
    return ks.AllToAllDenseEmbedding(
        input_dim,
        dim,
        optimizer="adagrad",
        cache_rows=cache_rows,
        store=store,
        name=name,
    )


def hashed(capacity=300, dim=4, store="host", name="keys"):
    return ks.DistributedHashEmbedding(
        dim, capacity=capacity, optimizer="adam", store=store, name=name
    )


def nbytes(layer, names):
    """Bytes of ``layer``'s variables whose names end with ``names``."""
    return sum(
        keras.ops.convert_to_numpy(v).nbytes
        for v in layer.variables
        if v.path.split("/")[-1] in names
    )


def hand_cache_bytes(cache_rows, bytes_per_row):
    """A fixed vocabulary's cache's device bytes from the layer's documented
    shapes: values and slots of exactly ``cache_rows`` rows (no serving map:
    its ids are mapped on the host)."""
    return cache_rows * bytes_per_row


@pytest.mark.parametrize("make", [dense, hashed])
def test_device_bytes_are_the_cache_variables(make):
    layer = make()
    layer.build((None,))
    cache = getattr(layer, "row_cache", None) or layer
    spec = TableSpec.from_layer(layer)
    table = ["embeddings", *cache.slots]
    assert spec.store == "host"
    assert spec.device_rows == cache.embeddings.shape[0]
    assert spec.total_bytes == nbytes(cache, table)
    assert spec.serving_map_bytes == nbytes(cache, SERVING)
    p = ks.plan([layer], devices=1)
    assert p[layer.name].bytes_per_device == nbytes(cache, table + list(SERVING))


def test_dense_store_bytes_are_the_store_rows():
    layer = dense(store="host")
    layer.build((None,))
    store = layer.row_cache.row_tier.store
    spec = TableSpec.from_layer(layer)
    assert spec.rows == 3000 and spec.device_rows == 300  # cache_rows exactly
    assert spec.store_bytes == (store._rows.nbytes, 0)
    on_disk = TableSpec.from_layer(dense(store=ks.store.Disk("unused")))
    assert on_disk.store_bytes == (0, store._rows.nbytes)  # no keys: ids


@pytest.mark.parametrize("n", [5000, 40000])
def test_keyed_store_bytes_bound_a_real_store(n):
    fields = [
        FieldSpec("values", 4, "float32"),
        FieldSpec("m", 4, "float32"),
        FieldSpec("v", 4, "float32"),
        FieldSpec("score", 1, "int64"),
    ]
    store = HostStore(fields)
    keys = np.arange(n, dtype=np.int64) * 7919 - 10**12  # distinct
    store.write(keys, {f.name: np.zeros((n, f.width), f.dtype) for f in fields})
    spec = TableSpec("t", n, 4, [4, 4], hash_keys=True, store="host", device_rows=304)
    host, disk = spec.store_bytes
    rows = n * sum(f.row_bytes for f in fields)
    index = store._index.nbytes + store._live.nbytes
    assert disk == 0 and host - rows == n * plan_store.KEY_INDEX_BYTES
    assert index <= host - rows < 3 * index  # an upper bound, not far off
    disk_spec = TableSpec(
        "t", n, 4, [4, 4], hash_keys=True, store="disk", device_rows=304
    )
    assert disk_spec.store_bytes == (host - rows, rows)


def test_num_keys_sizes_a_hash_layers_store():
    layer = hashed(capacity=300)
    spec = TableSpec.from_layer(layer, num_keys=50_000)
    assert (spec.rows, spec.device_rows) == (50_000, layer.capacity)
    p = ks.plan([layer], devices=1, num_keys={layer.name: 50_000})
    row = spec.bytes_per_row + plan_store.SCORE_BYTES + plan_store.KEY_INDEX_BYTES
    assert p[layer.name].host_bytes == 50_000 * row
    assert p.host_bytes == 50_000 * row and p.disk_bytes == 0


@pytest.mark.parametrize("budget", [20_000, 33_333, 51_200])
def test_proposed_cache_is_the_largest_that_fits(budget):
    layer = dense(input_dim=3000, dim=4)
    spec = TableSpec.from_layer(layer)
    c = ks.propose_cache_rows(layer, budget)
    assert hand_cache_bytes(c, spec.bytes_per_row) <= budget
    assert hand_cache_bytes(c + 1, spec.bytes_per_row) > budget
    # The real layers: a cache of c rows fits, one of c + 1 does not.
    names = ["embeddings", "accumulator", *SERVING]
    for rows, fits in ((c, True), (c + 1, False)):
        built = dense(input_dim=3000, dim=4, cache_rows=rows, name=f"c{rows}")
        built.build((None,))
        assert (nbytes(built.row_cache, names) <= budget) == fits


def test_plan_sizes_a_cache_that_does_not_fit():
    big = dense(input_dim=100_000, dim=8, cache_rows=50_000, name="big")
    other = ks.AllToAllDenseEmbedding(500, 8, optimizer="adagrad", name="other")
    budget = 2**20
    p = ks.plan([big, other], devices=1, memory_per_device=budget)
    left = budget - TableSpec.from_layer(other).total_bytes
    c = ks.propose_cache_rows(big, left)
    assert p["big"].cache_rows == c and c < 50_000
    assert p["big"].spec.device_rows == c
    bpr = TableSpec.from_layer(big).bytes_per_row
    assert p["big"].bytes_per_device == hand_cache_bytes(c, bpr)
    assert max(p.device_bytes) <= budget
    assert f"cache {c:,} of 100,000 rows" in p["big"].reason
    assert p["other"].cache_rows is None
    with pytest.raises(ValueError, match=f"cache_rows={c}"):
        apply_plan(p)  # the layer's own cache does not fit
    # Asked for: the largest cache, even where the layer's own fits.
    small = dense(input_dim=100_000, dim=8, cache_rows=64, name="small")
    asked = ks.plan([small], devices=1, memory_per_device=budget, propose_cache=True)
    assert asked["small"].cache_rows == ks.propose_cache_rows(small, budget) > 64
    apply_plan(asked)  # its own (smaller) cache fits: nothing to refuse


def test_caches_share_the_memory_left_by_table_size():
    a = dense(input_dim=30_000, cache_rows=64, name="a")
    b = dense(input_dim=10_000, cache_rows=64, name="b")
    p = ks.plan([a, b], devices=1, memory_per_device=60_000, propose_cache=["a", "b"])
    assert p["a"].cache_rows > p["b"].cache_rows
    assert max(p.device_bytes) <= 60_000
    with pytest.raises(ValueError, match="without a row store or unknown"):
        ks.plan([a], devices=1, propose_cache=["nope"])


def test_hit_rate_of_the_ids_sample():
    layer = dense(input_dim=100_000, dim=8, cache_rows=64, name="z")
    ids = np.random.default_rng(1).zipf(1.3, 5000) % 100_000
    p = ks.plan(
        [layer],
        devices=1,
        memory_per_device=50_000,
        propose_cache=True,
        ids_sample={"z": ids},
    )
    c = p["z"].cache_rows
    top = sum(n for _, n in Counter(ids.tolist()).most_common(c))
    assert f"expected hit rate {top / ids.size:.1%} on the ids sample" in (
        p["z"].reason
    )


def test_host_memory_suggests_a_disk_store(tmp_path):
    on_host = dense(input_dim=100_000, dim=8, cache_rows=64, name="h")
    full = TableSpec.from_layer(on_host).store_bytes[0]
    p = ks.plan([on_host], devices=1, host_memory=full - 1)
    assert "ks.store.Disk(path)" in p["h"].reason
    assert "> host_memory" in p["h"].reason
    assert "ks.store.Disk" not in str(ks.plan([on_host], devices=1, host_memory=full))
    # Only the stores that must move: the largest first, until the rest fits.
    small = dense(input_dim=1000, dim=8, cache_rows=64, name="s")
    p = ks.plan([on_host, small], devices=1, host_memory=full)
    assert "ks.store.Disk" in p["h"].reason
    assert "ks.store.Disk" not in p["s"].reason
    keyed = hashed(capacity=64, store=ks.store.Disk(str(tmp_path)), name="k")
    p = ks.plan([keyed], devices=1, host_memory=10**9, num_keys={"k": 10_000})
    index = 10_000 * plan_store.KEY_INDEX_BYTES
    assert (p["k"].host_bytes, p.host_bytes) == (index, index)
    assert p["k"].disk_bytes == 10_000 * (TableSpec.from_layer(keyed).bytes_per_row + 8)
    assert "ks.store.Disk" not in p["k"].reason


def test_a_table_without_store_that_does_not_fit_suggests_one():
    layer = ks.AllToAllDenseEmbedding(100_000, 8, optimizer="adagrad", name="e")
    budget = 2**20
    with_store = TableSpec("e", 100_000, 8, [8], store="host", device_rows=64)
    c = ks.propose_cache_rows(with_store, budget)
    with pytest.raises(ValueError, match="fits no strategy") as e:
        ks.plan([layer], devices=1, memory_per_device=budget)
    assert f"cache_rows={c}, store='host'" in str(e.value)


def test_printed_plan_has_device_host_and_disk_columns(tmp_path):
    layers = [
        dense(name="d"),
        hashed(store=ks.store.Disk(str(tmp_path)), name="k"),
        ks.AllToAllDenseEmbedding(100, 4, optimizer="adagrad", name="plain"),
    ]
    p = ks.plan(layers, devices=1, host_memory=2**30, num_keys={"k": 1000})
    text = str(p)
    head = text.splitlines()[0].split("  ")
    for column in ("device rows", "bytes/device", "host bytes", "disk bytes"):
        assert column in [h.strip() for h in head if h.strip()]
    assert "host bytes/process" in text and "disk bytes/process" in text
    assert "host bytes" not in str(ks.plan(layers[2:], devices=1))


def test_model_plans_the_cached_layer_once():
    layer = dense(name="d")
    inputs = keras.Input((2,), dtype="int32")
    model = keras.Model(inputs, layer(inputs))
    assert [t.name for t in ks.plan(model, devices=1)] == ["d"]


def test_store_bytes_split_over_processes_when_sharded():
    spec = TableSpec("t", 8000, 4, [4], store="host", device_rows=1024)
    whole = plan_store.store_bytes_per_process(spec, "data", 4)
    assert whole == (8000 * 32, 0)
    assert plan_store.store_bytes_per_process(spec, "row", 4) == (2000 * 32, 0)
    p = ks.plan([spec], devices=8, pinned={"t": "row"})
    assert p["t"].bytes_per_device == 128 * 32 + spec.serving_map_bytes


def test_a_cache_is_planned_replicated_on_several_devices():
    """A fixed vocabulary's cache trains replicated, a copy per process
    across processes (test_sharded_dense_cache.py, test_tf_mirrored_cache.py,
    test_jax_processes_cache.py): planned so, each device holding the whole
    cache; other strategies say why not."""
    layer = dense()
    p = ks.plan([layer], devices=8)
    assert p["ids"].strategy == "data"
    assert p["ids"].bytes_per_device == 300 * (4 + 4) * 4  # values, accumulator
    assert "row: a cache (`cache_rows`) runs on several devices replicated" in str(p)
    two = ks.plan([layer], devices=8, processes=2)
    assert two["ids"].strategy == "data"
    assert two["ids"].bytes_per_device == p["ids"].bytes_per_device
