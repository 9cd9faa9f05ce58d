"""Row- and column-sharded tables under tf.distribute.MirroredStrategy
(TensorFlow): each replica holds its part of the table and slots, and
fit, predict and saving equal one device.

As in tests/test_tf_mirrored.py, the logical CPU devices must exist before
TensorFlow initializes its devices: the cases run in a fresh subprocess
(this file's ``__main__``) with 4 logical CPUs and print their results as
JSON. One model holds every sharded layer (row/column x sgd/adagrad/adam),
so each replica count traces one fit.
"""

import json
import os

import keras
import numpy as np
import pytest

from tests.subprocess_results import module_results

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="tf.distribute runs on the TensorFlow backend only",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, DIM, BATCH, STEPS, TOL = 21, 4, 8, 4, 1e-5
# name: (sharding, optimizer, combiner); 21 rows leave padding rows on 2
# and on 4 replicas.
LAYERS = {
    "row_sgd": ("row", "sgd", None),
    "row_adagrad": ("row", "adagrad", "sum"),
    "column_adam": ("column", "adam", None),
    "column_adagrad": ("column", "adagrad", "mean"),
}


# ---------------------------------------------------------------- subprocess
def _model():
    """Every sharded layer on the same ids, seeded: tables and head start
    alike on one device and on the replicas."""
    import keras_sparse as ks

    keras.utils.set_random_seed(0)
    ids = keras.Input((3,), dtype="int32", name="ids")
    features = []
    for name, (sharding, opt, combiner) in LAYERS.items():
        layer = ks.AllToAllDenseEmbedding(
            ROWS, DIM, optimizer=opt, combiner=combiner, sharding=sharding, name=name
        )
        features.append(keras.layers.Flatten()(layer(ids)))
    out = keras.layers.Dense(1, name="head")(keras.layers.Concatenate()(features))
    return keras.Model(ids, out)


def _data(samples):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, (samples, 3)).astype("int32")
    ids[:, 0] = 5  # a row every replica touches in every step
    return ids, rng.normal(size=(samples, 1)).astype("float32")


def _fit(model, samples, sample_weight=None):
    model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=False)
    x, y = _data(samples)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
              sample_weight=sample_weight)  # fmt: skip
    return model


def _state(model):
    """Each layer's saved state (whole unpadded arrays) and the head's."""
    state = {}
    for name in LAYERS:
        store = {}
        model.get_layer(name).save_own_variables(store)
        state.update({f"{name}/{k}": np.asarray(v) for k, v in store.items()})
    head = model.get_layer("head").get_weights()
    state.update({f"head/{i}": w for i, w in enumerate(head)})
    return state


def _gap(a, b):
    """Largest gap between two states (or weight lists), key by key."""
    if isinstance(a, list):
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float(np.abs(a[k].astype(float) - b[k]).max()) for k in a)


def _predict_gap(a, b):
    x, _ = _data(3 * BATCH)
    return float(np.abs(a.predict(x, verbose=0) - b.predict(x, verbose=0)).max())


def _error(fn):
    try:
        fn()
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _refusals(strategy, replicas):
    import tensorflow as tf

    import keras_sparse as ks

    def build(dim=DIM, **kwargs):
        kwargs = {"optimizer": "adagrad", "sharding": "column", **kwargs}
        with strategy.scope():
            ks.AllToAllDenseEmbedding(ROWS, dim, name="bad", **kwargs).build()

    def xla(predict):
        with strategy.scope():
            ids = keras.Input((3,), dtype="int32")
            layer = ks.AllToAllDenseEmbedding(
                ROWS, DIM, optimizer="sgd", sharding="row", name="row_xla"
            )
            model = keras.Model(ids, layer(ids))
            model.compile("sgd", "mse", jit_compile=True)
        # The layer opts out of XLA (supports_jit), so Keras compiles the
        # step without it: no error.
        if model.jit_compile:
            raise AssertionError("an XLA step was kept")
        x, _ = _data(BATCH)
        y = np.zeros((BATCH, 3, DIM), "float32")
        if predict:
            model.predict(x, verbose=0)
        else:
            model.fit(x, y, batch_size=BATCH, verbose=0)

    def out_of_range():
        with strategy.scope():
            layer = ks.AllToAllDenseEmbedding(
                ROWS, DIM, optimizer="sgd", sharding="row", name="row_ids"
            )
            layer(np.array([[ROWS - 1, 0, 1]], "int32"))  # builds, reads
            layer(np.array([[ROWS, 0, 1]], "int32"))

    def other_strategy():
        devices = [f"/cpu:{i}" for i in range(replicas)]
        other = tf.distribute.experimental.CentralStorageStrategy(devices)
        with other.scope():
            ks.AllToAllDenseEmbedding(ROWS, DIM, optimizer="sgd", sharding="row",
                                      name="bad").build()  # fmt: skip

    errors = {"dim": _error(lambda: build(dim=replicas + 1))}
    if replicas != 2:
        return errors  # the others do not depend on the replica count
    return errors | {
        "rowwise": _error(lambda: build(optimizer="rowwise_adagrad")),
        "constraint": _error(lambda: build(embeddings_constraint="non_neg")),
        "dense": _error(lambda: build(optimizer=None, sharding="row")),
        "table": _error(lambda: build(sharding="table")),
        "xla_fit": _error(lambda: xla(False)),
        "xla_predict": _error(lambda: xla(True)),
        "out_of_range": _error(out_of_range),
        "strategy": _error(other_strategy),
    }


# A last global batch of 5 samples splits 3/2 over 2 replicas, one of 1
# sample leaves 3 of 4 replicas without ids.
_TAIL = {2: (5, [3, 2]), 4: (1, [1, 0, 0, 0])}


def _uneven_weights(replicas):
    """Keras scales each replica's mean loss by 1 / replicas: one device
    weighting the last batch's samples by ``batch / (local batch *
    replicas)`` trains the same objective."""
    tail, split = _TAIL[replicas]
    weights = np.ones(BATCH * STEPS + tail, "float32")
    start = BATCH * STEPS
    for n in filter(None, split):
        weights[start : start + n] = tail / (n * replicas)
        start += n
    return weights


def _run_cases(replicas, references, tmp):
    import tensorflow as tf

    # Strategies over different device sets in one process must not share
    # collective group keys.
    tf.distribute.MirroredStrategy._collective_key_base = 1000 * replicas
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    out = {}
    with strategy.scope():
        model = _model()
        out["start"] = _gap(_state(model), references["start"])
        out["shapes"] = {
            f"{name}/{v.name}": [
                list(c.shape) for c in strategy.experimental_local_results(v.value)
            ]
            for name in LAYERS
            for v in model.get_layer(name).weights
            if v.name not in ("sparse_iterations", "sparse_update_anchor")
        }
        # The last global batch is split unevenly (see `_TAIL`).
        _fit(model, len(_uneven_weights(replicas)))
        reference = references[replicas]
        out["fit"] = _gap(_state(model), _state(reference))
        out["get_weights"] = _gap(model.get_weights(), reference.get_weights())
        out["predict"] = _predict_gap(model, reference)
        path = os.path.join(tmp, f"sharded{replicas}.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        out["reloaded"] = _gap(_state(loaded), _state(model))
        out["reloaded_predict"] = _predict_gap(loaded, model)
        out["reloaded_placement"] = repr(loaded.get_layer("column_adam").placement)
        from_one = keras.models.load_model(os.path.join(tmp, "one_device.keras"))
        out["from_one_device"] = _gap(_state(from_one), references["saved"])
        out["from_one_device_predict"] = _predict_gap(from_one, references[2])
    with tf.device("/cpu:0"):
        to_one = keras.models.load_model(path)
        out["to_one_device_placement"] = repr(to_one.get_layer("column_adam").placement)
        out["to_one_device_predict"] = _predict_gap(to_one, model)
    out["errors"] = _refusals(strategy, replicas)
    out["exchanged"] = _exchanged(strategy)
    return out


def _exchanged(strategy):
    """Ids the row exchange all-gathers for 6 positions per replica with
    3 distinct values (one invalid position)."""
    import tensorflow as tf

    from keras_sparse.sharding.tf_sharded_lookup import Exchange

    @tf.function
    def step():
        context = tf.distribute.get_replica_context()
        ids = tf.constant([5, 5, 1, 5, 2, 1]) + context.replica_id_in_sync_group
        valid = tf.constant([True, True, True, True, False, True])
        return tf.shape(Exchange(context, ids, valid).all_ids)[0]

    sizes = strategy.experimental_local_results(strategy.run(step))
    return [int(size) for size in sizes]


def _main():
    import tempfile

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 4
    )
    tmp = tempfile.mkdtemp()
    references = {}
    with tf.device("/cpu:0"):
        references["start"] = _state(_model())
        for replicas in _TAIL:
            weights = _uneven_weights(replicas)
            references[replicas] = _fit(_model(), len(weights), weights)
        references["saved"] = _state(references[2])
        references[2].save(os.path.join(tmp, "one_device.keras"))
    results = {r: _run_cases(r, references, tmp) for r in (2, 4)}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    _main()


# --------------------------------------------------------------------- tests
def _results(replicas):
    """The subprocess's results for ``replicas`` (one run for the module)."""
    return module_results(__file__, timeout=400)[str(replicas)]


REPLICAS = pytest.mark.parametrize("replicas", [2, 4])


@REPLICAS
def test_each_replica_holds_its_part(replicas):
    """Row: ceil(21 / D) rows per replica; column: dim / D columns."""
    rows = -(-ROWS // replicas)
    for key, shapes in _results(replicas)["shapes"].items():
        expected = [rows, DIM] if key.startswith("row") else [ROWS, DIM // replicas]
        assert shapes == [expected] * replicas, key
    assert len(_results(replicas)["shapes"]) == 8


@REPLICAS
def test_starts_as_one_device(replicas):
    """The parts are cut from the one-device draw of the seeded table."""
    assert _results(replicas)["start"] == 0.0


@REPLICAS
@pytest.mark.parametrize("what", ["fit", "get_weights", "predict"])
def test_fit_matches_one_device(replicas, what):
    """Tables and slots (whole, unpadded), head and predictions. The last
    global batch leaves replicas with different batch sizes (or none);
    Keras then scales each replica's mean loss by 1 / replicas, which one
    device trains with the matching sample weights."""
    assert _results(replicas)[what] <= TOL


@REPLICAS
def test_each_replica_exchanges_its_distinct_ids_once(replicas):
    """5, 5, 1, 5, (invalid), 1 travel as 5, 1 and one invalid marker, not
    as 6 ids (the fit above repeats id 5 in every sample and matches one
    device)."""
    assert _results(replicas)["exchanged"] == [3 * replicas] * replicas


@REPLICAS
def test_save_and_load_under_the_strategy(replicas):
    results = _results(replicas)
    assert results["reloaded"] == 0.0 and results["reloaded_predict"] == 0.0
    assert results["reloaded_placement"] == (
        f"TfShardedPlacement('column', devices={replicas})"
    )


@REPLICAS
def test_files_move_between_one_device_and_replicas(replicas):
    results = _results(replicas)
    assert results["from_one_device"] <= TOL
    assert results["from_one_device_predict"] <= TOL
    assert results["to_one_device_placement"] == "None"
    assert results["to_one_device_predict"] <= TOL


@REPLICAS
def test_column_width_must_divide(replicas):
    error = _results(replicas)["errors"]["dim"]
    assert error.startswith("ValueError") and "'bad'" in error
    assert f"`output_dim`={replicas + 1}" in error and f"{replicas} replicas" in error


def test_xla_request_runs_without_xla():
    errors = _results(2)["errors"]
    assert errors["xla_fit"] is None and errors["xla_predict"] is None


@pytest.mark.parametrize(
    "case, words",
    [
        ("rowwise", ["ValueError", "RowWiseAdagrad", "sharding='row'"]),
        ("constraint", ["ValueError", "embeddings_constraint", "sharding='row'"]),
        ("dense", ["ValueError", "sparse `optimizer`", "sharding='data'"]),
        ("table", ["ValueError", "'bad'", "EmbeddingCollection", "'row'"]),
        ("out_of_range", ["ValueError", "'row_ids'", "id 21 is out of range"]),
        ("strategy", ["NotImplementedError", "CentralStorageStrategy",
                      "MirroredStrategy only"]),
    ],
)  # fmt: skip
def test_refusals_are_clear(case, words):
    error = _results(2)["errors"][case]
    assert error is not None, f"{case}: no error"
    for word in words:
        assert word in error, (word, error)
