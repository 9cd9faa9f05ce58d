"""Row-store edge cases: imports that evict, tables set later, refused
builds, reopened shard folders, saves of unbuilt layers, incomplete files."""

import os

import keras
import numpy as np
import pytest

from keras_sparse.layers.hash.embedding import DistributedHashEmbedding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layer(name="ids", capacity=64, **kwargs):
    layer = DistributedHashEmbedding(
        4, capacity=capacity, optimizer="adagrad", store="host", name=name, **kwargs
    )
    layer.build((None, 2))
    return layer


def _record(layer, key):
    rec = layer.export()
    at = np.flatnonzero(rec["keys"] == key)
    assert at.size == 1
    return {name: np.asarray(value)[at[0]] for name, value in rec.items()}


def _bucket_mates(layer, key, count):
    """``count`` keys with ``key``'s first bucket among their candidates."""
    table = layer.table
    home = np.asarray(table.candidate_buckets(np.asarray([key])))[0][0]
    pool = np.arange(1, 200_000, dtype="int64")
    b1, b2 = (np.asarray(b) for b in table.candidate_buckets(pool))
    return pool[(b1 == home) | (b2 == home)][:count]


def test_an_import_writes_the_keys_it_evicts_down_to_the_store():
    layer = _layer()
    key = np.int64(12345)
    width = {"values": 4, "accumulator": 4}
    # The store keeps an older copy of the key (as after a fill)...
    old = {n: np.full((1, w), -1.0, "float32") for n, w in width.items()}
    layer.row_tier.store.write([key], {**old, "score": np.ones((1, 1), "int64")})
    # ...and the table a newer one, which wins while the key has a row.
    new = np.full((1, 4), 2.0, "float32")
    layer.import_([key], new, slots={"accumulator": new + 1}, scores=[0])
    np.testing.assert_allclose(_record(layer, key)["values"], new[0])
    # Hotter keys of the key's bucket fill it and their other buckets: an
    # import evicts the key.
    mates = _bucket_mates(layer, key, 64).reshape(-1, 8)
    for others in mates:
        layer.import_(others, np.zeros((8, 4), "float32"), scores=[9] * 8)
        if key not in keras.ops.convert_to_numpy(layer.table.export()[0]):
            break
    else:
        raise AssertionError("the key was never evicted")
    # It went down with its newer row, vector, slots and score.
    got = _record(layer, key)
    np.testing.assert_allclose(got["values"], new[0])
    np.testing.assert_allclose(got["accumulator"], new[0] + 1)
    assert got["scores"] == 0


def test_a_table_with_a_time_to_live_is_refused_under_a_store():
    from keras_sparse.table import HashTable

    layer = DistributedHashEmbedding(4, capacity=64, store="host", name="ttl")
    before = layer.table
    with pytest.raises(ValueError, match="'ttl'.*ttl_steps=5.*store"):
        layer.table = HashTable(64, ttl_steps=5)
    assert layer.table is before  # nothing changed
    layer.table = HashTable(64)  # without a time to live it is taken
    assert layer.table is not before


def test_a_refused_store_leaves_the_layer_unbuilt():
    layer = DistributedHashEmbedding(
        4,
        capacity=64,
        store="host",
        embeddings_initializer=keras.initializers.Orthogonal(seed=1),
        name="orth",
    )
    keys = np.array([[1, 2]], "int64")
    for _ in range(2):  # a caught refusal does not let it train storeless
        with pytest.raises(ValueError, match="'orth'.*per key"):
            layer(keys, training=True)
        assert not layer.built


def _sharded(path, reopen, devices):
    import keras_sparse as ks
    from keras_sparse import sharding

    layer = DistributedHashEmbedding(
        4,
        capacity=512,
        optimizer="sgd",
        sharding="key",
        store=ks.store.Disk(str(path), reopen=reopen),
        name="own",
    )
    keras.distribution.set_distribution(sharding.distribution([layer], devices=devices))
    try:
        layer.build((None, 2))
    finally:
        keras.distribution.set_distribution(None)
    return layer


@pytest.mark.skipif(
    keras.backend.backend() != "jax" or len(keras.distribution.list_devices()) < 8,
    reason="key-sharded stores: JAX on 8 devices",
)
def test_a_reopened_shard_folder_must_serve_the_same_shard(tmp_path):
    keys = np.arange(40, dtype=np.int64) * 7_919 + 5
    rows = {"values": np.ones((40, 4), "float32"), "score": np.ones((40, 1), "int64")}
    layer = _sharded(tmp_path, False, 8)
    layer.row_tier.store.write(keys, rows)
    layer.row_tier.store.close()
    with pytest.raises(ValueError, match="'own'.*shard 0 of 8.*shard 0 of 4"):
        _sharded(tmp_path, True, 4)
    # Under the same shard count every key is back in its owner's store.
    again = _sharded(tmp_path, True, 8)
    found, _ = again.row_tier.store.read(keys)
    assert found.all()


def test_a_model_with_an_unbuilt_cached_layer_saves(tmp_path):
    import keras_sparse as ks

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(inputs))
    # Tracked but never called, so never built: no row store yet.
    model.ids = ks.AllToAllDenseEmbedding(300, 3, cache_rows=64, optimizer="sgd")
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    for a, b in zip(loaded.get_layer("out").get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_an_incomplete_file_says_which_keys_are_missing(tmp_path):
    from keras_sparse.layers import store_assets
    from tests import row_store_models as shared

    keys, target = shared.batches(1, 250, 12)
    model, layer = shared.model(64, "host")
    model.fit(keys, target, batch_size=shared.BATCH, shuffle=False, verbose=0)
    stored = layer.stats()["store_size"]
    model.save(tmp_path / "m.keras")
    weights = shared.weights_entries(tmp_path / "m.keras")
    at = "layers/distributed_hash_embedding"
    entries = {k.split("/")[-1]: v for k, v in weights.items() if k.startswith(at)}
    _, again = shared.model(64, "host")
    (tmp_path / "empty").mkdir()
    with store_assets.assets_follow():
        again.load_own_variables(entries)
        with pytest.raises(ValueError, match="incomplete") as raised:
            again.load_assets(str(tmp_path / "empty"))
    message = str(raised.value)
    assert f"those {stored:,} keys are missing" in message
    assert "store is empty" not in message
    # As it says: the weights' (table) keys are loaded, the stored ones not.
    np.testing.assert_array_equal(
        np.sort(again.export()["keys"]), np.sort(entries["record_keys"])
    )


_HOLDER = """
import sys
import numpy as np
from keras_sparse import store
fields = [store.FieldSpec("values", 4, "float32")]
s = store.DenseDiskStore(sys.argv[1], fields, 1000, lambda a, b: {"values":
    np.full((b - a, 4), 7.0, "float32")})
print("open", flush=True)
sys.stdin.readline()  # holds the store (and its maps) until told
rows = s.row_arrays()["values"]
print(float(rows[999, 0]), flush=True)
"""


def test_a_folder_another_process_holds_is_never_touched(tmp_path):
    import subprocess
    import sys

    from keras_sparse import store

    folder = tmp_path / "rows"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "open"
        fields = [store.FieldSpec("values", 4, "float32")]
        # A store on the same files would cut them under the holder's maps.
        with pytest.raises(store.FolderInUse, match="open in another"):
            store.DenseDiskStore(folder, fields, 10, overwrite=True)
        with pytest.raises(store.FolderInUse, match="open in another"):
            store.DenseDiskStore.open(folder)
        spec = store.Disk(str(folder))
        with pytest.warns(UserWarning, match=r"in this process or another.*rows\.1"):
            moved = spec.open_dense(fields, 10)
        assert moved.path == f"{folder}.1" and moved.asked_path == str(folder)
        moved.close()
        with pytest.raises(ValueError, match="is open already"):
            store.Disk(str(folder), reopen=True).open_dense(fields, 1000)
        out, _ = holder.communicate("go\n", timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert holder.returncode == 0 and out.strip() == "7.0"
    # Its lock went with it: the folder opens again.
    with store.DenseDiskStore.open(folder) as reopened:
        assert reopened.row_arrays()["values"][999, 0] == 7.0


def test_a_file_system_without_locks_opens_with_a_warning(tmp_path, monkeypatch):
    import errno

    from keras_sparse import store
    from keras_sparse.store import on_disk

    if on_disk.fcntl is None:
        pytest.skip("no advisory locks on this platform")

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(on_disk.fcntl, "flock", no_locks)
    fields = [store.FieldSpec("values", 2, "float32")]
    with pytest.warns(UserWarning, match="cannot lock"):
        opened = store.Disk(str(tmp_path / "rows")).open_dense(fields, 5)
    assert opened.path == str(tmp_path / "rows")  # not sent to rows.1
    opened.close()


def test_a_store_that_fails_to_open_lets_go_of_its_folder(tmp_path):
    from keras_sparse import store

    fields = [store.FieldSpec("values", 2, "float32")]

    def broken(first, end):
        raise RuntimeError("no rows today")

    with pytest.raises(RuntimeError, match="no rows today") as failed:
        store.DenseDiskStore(tmp_path / "rows", fields, 5, broken)
    # The failed store lives on in the traceback, without the folder.
    assert failed.value.__traceback__ is not None
    with store.DenseDiskStore(tmp_path / "rows", fields, 5, overwrite=True) as again:
        assert again.size == 5


def test_a_forked_child_does_not_keep_the_folder(tmp_path):
    import signal

    from keras_sparse import store

    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    fields = [store.FieldSpec("values", 2, "float32")]
    held = store.DenseDiskStore(tmp_path / "rows", fields, 5)
    child = os.fork()
    if child == 0:  # holds the parent's copies until killed
        import time

        time.sleep(60)
        os._exit(0)
    try:
        held.close()
        with store.DenseDiskStore.open(tmp_path / "rows") as again:
            assert again.size == 5
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
