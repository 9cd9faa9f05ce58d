"""HashEmbeddingCollection: its fields train exactly as separate
DistributedHashEmbedding layers do, with one table callback per JAX step."""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.layers.hash import jax_group_mapping
from tests.hash_fields import FIELDS
from tests.hash_fields import field_layers
from tests.hash_fields import fields_data
from tests.hash_fields import fields_model

BATCH, EPOCHS = 32, 2


def _sorted(records):
    order = np.argsort(records["keys"])
    return {name: values[order] for name, values in records.items()}


def _trained(together):
    keras.utils.set_random_seed(0)
    model, layers = fields_model(together)
    x, y = fields_data()
    hist = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model, layers, hist.history["loss"], x


def test_fields_train_like_separate_layers(monkeypatch):
    """Losses, table counters, stored records (keys, rows, vectors, slots,
    scores) and predictions equal those of the same fields as separate
    layers, under evictions, admission and padding; on JAX every step maps
    all fields with one callback."""
    callbacks = []
    host_rows = jax_group_mapping._host_rows

    def counted(layers, *args):
        callbacks.append(len(layers))
        return host_rows(layers, *args)

    monkeypatch.setattr(jax_group_mapping, "_host_rows", counted)
    ref_model, ref_layers, ref_loss, x = _trained(together=False)
    assert not callbacks
    model, layers, loss, _ = _trained(together=True)
    if keras.backend.backend() == "jax":
        steps = EPOCHS * len(x["user"]) // BATCH
        assert callbacks == [len(FIELDS)] * steps
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    stats = {name: layer.stats() for name, layer in layers.items()}
    assert stats == {name: layer.stats() for name, layer in ref_layers.items()}
    assert stats["user"]["evictions"] > 0 and stats["item"]["evictions"] > 0
    assert stats["item"]["rejected_admissions"] > 0
    for name in FIELDS:
        got, want = _sorted(layers[name].export()), _sorted(ref_layers[name].export())
        assert set(got) == set(want)
        np.testing.assert_array_equal(got["keys"], want["keys"])
        for part in want:
            np.testing.assert_allclose(got[part], want[part], rtol=1e-5, err_msg=part)
    np.testing.assert_allclose(
        model.predict(x, verbose=0), ref_model.predict(x, verbose=0), rtol=1e-5
    )


def test_save_and_load_keep_every_field(tmp_path):
    model, layers, _, x = _trained(together=True)
    path = str(tmp_path / "fields.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    collection = loaded.get_layer("fields")
    assert isinstance(collection, ks.HashEmbeddingCollection)
    assert collection.field_names == list(FIELDS)
    for name in FIELDS:
        got = _sorted(collection.fields[name].export())
        want = _sorted(layers[name].export())
        np.testing.assert_array_equal(got["keys"], want["keys"])
        np.testing.assert_allclose(got["values"], want["values"], rtol=1e-6)
        assert collection.fields[name].get_config() == layers[name].get_config()
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5
    )


def test_config_round_trip():
    collection = ks.HashEmbeddingCollection(field_layers(), name="c")
    again = ks.HashEmbeddingCollection.from_config(collection.get_config())
    assert again.name == "c" and again.field_names == collection.field_names
    for name in FIELDS:
        assert again.fields[name].get_config() == collection.fields[name].get_config()


def test_eager_calls_match_separate_layers():
    x, _ = fields_data(samples=16)
    keras.utils.set_random_seed(0)
    ref = field_layers()
    keras.utils.set_random_seed(0)
    collection = ks.HashEmbeddingCollection(field_layers())
    inputs = {name: x[name] for name in FIELDS}
    out = collection(inputs, weights={"item": x["item_w"]}, training=True)
    for name, layer in ref.items():
        w = x["item_w"] if name == "item" else None
        want = layer(x[name], weights=w, training=True)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(out[name]),
            keras.ops.convert_to_numpy(want),
            rtol=1e-6,
        )
        assert collection.fields[name].stats() == layer.stats()
    assert collection.stats() == {n: layer.stats() for n, layer in ref.items()}


def test_bad_arguments_name_the_layer_and_change_nothing():
    layers = field_layers()
    with pytest.raises(ValueError, match="'c'.*non-empty dict"):
        ks.HashEmbeddingCollection([], name="c")
    with pytest.raises(TypeError, match="'c'.*field 'x' must be a Distributed"):
        ks.HashEmbeddingCollection({"x": keras.layers.Dense(2)}, name="c")
    with pytest.raises(ValueError, match="'c'.*'a' and 'b' share one layer"):
        ks.HashEmbeddingCollection({"a": layers["user"], "b": layers["user"]}, name="c")
    collection = ks.HashEmbeddingCollection(layers, name="c")
    x, _ = fields_data(samples=4)
    with pytest.raises(ValueError, match="'c'.*exactly the fields"):
        collection({"user": x["user"]}, training=True)
    with pytest.raises(ValueError, match="'c'.*`weights`.*among the fields"):
        collection({name: x[name] for name in FIELDS}, weights={"nope": x["item_w"]})
    assert all(layer.stats()["size"] == 0 for layer in layers.values())


def _wide(x):
    """The keys moved beyond 32 bits (distinct keys stay distinct)."""
    x = dict(x)
    for name in FIELDS:
        x[name] = x[name].astype(np.int64) * (2**32 + 1)
    return x


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="only JAX narrows int64 inputs"
)
def test_wide_keys_reach_every_field_whole():
    """On JAX without x64 the fields get the full 64-bit keys of the model
    inputs feeding the collection, as separate layers do."""
    x, y = fields_data()
    x = _wide(x)
    results = []
    for together in (False, True):
        keras.utils.set_random_seed(0)
        model, layers = fields_model(together, key_dtype="int64")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        results.append({n: _sorted(layer.export()) for n, layer in layers.items()})
    for name in FIELDS:
        keys = results[1][name]["keys"]
        assert (np.abs(keys) >= 2**32).any()
        assert set(keys.tolist()) <= set(x[name].ravel().tolist())
        np.testing.assert_array_equal(keys, results[0][name]["keys"])
        np.testing.assert_allclose(
            results[1][name]["values"], results[0][name]["values"], rtol=1e-5
        )


def test_prefetch_stage_feeds_the_fields():
    """`keras_sparse.data.prefetch` maps the fields' keys ahead of the step
    (finding them through the collection) and trains as separate layers."""
    from keras_sparse.data import prefetch

    _, ref_layers, ref_loss, _ = _trained(together=False)
    x, y = fields_data()
    keras.utils.set_random_seed(0)
    model, layers = fields_model(True)
    with prefetch((x, y), model, batch_size=BATCH, threads=2) as stage:
        loss = model.fit(stage, epochs=EPOCHS, verbose=0).history["loss"]
        assert stage.stats()["batches"] == EPOCHS * len(y) // BATCH
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name in FIELDS:
        assert layers[name].stats() == ref_layers[name].stats()
        got, want = _sorted(layers[name].export()), _sorted(ref_layers[name].export())
        np.testing.assert_array_equal(got["keys"], want["keys"])
        np.testing.assert_allclose(got["values"], want["values"], rtol=1e-5)


@pytest.mark.skipif(
    keras.backend.backend() == "tensorflow",
    reason="TF graphs wrap a tf.numpy_function's error (as for a single layer)",
)
def test_a_full_field_fails_fit_with_its_own_error():
    """A field whose table fills with eviction=None stops ``fit`` with the
    table's error naming that field's layer, whatever maps the fields."""
    from keras_sparse.table import TableFullError

    fields = {
        "a": ks.DistributedHashEmbedding(
            2, capacity=64, eviction=None, optimizer="sgd", name="strict_a"
        ),
        "b": ks.DistributedHashEmbedding(2, capacity=64, optimizer="sgd", name="b"),
    }
    inputs = {n: keras.Input((), dtype="int32", name=n) for n in fields}
    out = ks.HashEmbeddingCollection(fields)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(out["a"] + out["b"]))
    model.compile("sgd", "mse")
    x = {n: np.arange(200, dtype="int32") for n in fields}
    with pytest.raises(TableFullError, match="strict_a"):
        model.fit(x, np.zeros((200, 1)), batch_size=50, verbose=0)
    assert fields["a"].stats()["size"] <= 64


def test_a_field_also_called_outside_counts_both_calls():
    """A field layer the model also calls directly has two calls per step,
    so its table calls keep their program order (ordered route), and the
    collection maps its fields one by one."""
    from keras_sparse.layers.hash import jax_step_mapping

    layers = field_layers()
    inputs = {n: keras.Input((3,), dtype="int32", name=n) for n in FIELDS}
    out = ks.HashEmbeddingCollection(layers)(inputs)
    again = layers["user"](inputs["user"])
    assert jax_step_mapping.calls_per_step(layers["user"]) == 2
    assert not jax_step_mapping._called_once(layers["user"])
    assert jax_step_mapping.calls_per_step(layers["item"]) == 1
    assert again.shape[-1] == out["user"].shape[-1]


def test_fields_restore_their_full_keys_together_or_one_by_one():
    """A collection's full 64-bit keys (JAX without x64): every field's
    oldest queued batch in one check when all match; otherwise each field
    finds its own batch (an entry queued ahead of it stays); fields with
    nothing queued keep the step's keys. NumPy stands in for CuPy."""
    from keras_sparse.layers import jax_key_queue
    from keras_sparse.layers.hash import jax_group_mapping

    class Field:
        name = "field"

    def low(*parts):  # what the step holds: the low 32 bits
        return np.concatenate(parts).astype(np.int32)

    ka = np.array([(1 << 40) + 3, 7], np.int64)
    kb = np.array([5, (7 << 33) + 2, 9], np.int64)
    ahead = np.array([(1 << 35) + 8, 4], np.int64)
    bounds = [(0, 2), (2, 5)]
    a, b = Field(), Field()
    jax_key_queue.key_queue(a).append(ka)
    jax_key_queue.key_queue(b).append(kb)
    got = jax_group_mapping._restore_together([a, b], bounds, low(ka, kb), np)
    np.testing.assert_array_equal(got, np.concatenate([ka, kb]))
    assert len(jax_key_queue.key_queue(a)) == len(jax_key_queue.key_queue(b)) == 0

    jax_key_queue.key_queue(a).append(ahead)  # another iterator's batch first
    jax_key_queue.key_queue(a).append(ka)
    jax_key_queue.key_queue(b).append(kb)
    got = jax_group_mapping._restore_together([a, b], bounds, low(ka, kb), np)
    np.testing.assert_array_equal(got, np.concatenate([ka, kb]))
    assert jax_key_queue.key_queue(a).head() is ahead
    assert len(jax_key_queue.key_queue(b)) == 0

    c = Field()  # nothing queued (x64 mode, or keys that fit in 32 bits)
    jax_key_queue.key_queue(b).append(kb)
    got = jax_group_mapping._restore_together([c, b], bounds, low(ka[:2], kb), np)
    np.testing.assert_array_equal(got, np.concatenate([low(ka), kb]))
    assert got.dtype == np.int64

    # uint64 keys: the step holds their low words as uint32 and the queue
    # their bits as int64; one check restores both fields.
    ua = np.array([2**64 - 5, 3], np.uint64)
    ub = np.array([(1 << 63) + 9, 11, 2**40], np.uint64)
    jax_key_queue.key_queue(a).clear()
    jax_key_queue.key_queue(a).append(ua.view(np.int64))
    jax_key_queue.key_queue(b).append(ub.view(np.int64))
    step = np.concatenate([ua, ub]).astype(np.uint32)
    got = jax_group_mapping._restore_together([a, b], bounds, step, np)
    np.testing.assert_array_equal(got, np.concatenate([ua, ub]).view(np.int64))
    assert len(jax_key_queue.key_queue(a)) == len(jax_key_queue.key_queue(b)) == 0
