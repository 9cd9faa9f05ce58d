"""tf.distribute.MirroredStrategy (TensorFlow): sparse-optimizer layers train
on 2 and 4 replicas exactly like on one device (row regularizer included),
the replicas' table copies stay identical, and DistributedHashEmbedding and
XLA-compiled steps raise clear errors.

The logical CPU devices must be configured before TensorFlow initializes
its devices, so the cases run in a fresh subprocess (this file's
``__main__``) with 4 logical CPUs, which fits every case on the strategy
(over 2 and over 4 of them) and on one device and prints the largest
weight differences as JSON.
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
BATCH, STEPS, TOL = 8, 6, 1e-5
# (optimizer, combiner) of the AllToAllDenseEmbedding layers of the model.
EMBEDDINGS = [("sgd", None), ("adagrad", "sum"), ("adam", None), ("adam", "sum")]
LAYERS = [f"{opt}_{combiner}" for opt, combiner in EMBEDDINGS]
LAYERS += ["collection", "head"]


# ---------------------------------------------------------------- subprocess
def _model(embeddings=EMBEDDINGS, collection=True, regularizer=None):
    """AllToAllDenseEmbedding layers on the same ids, and an
    EmbeddingCollection of three tables (two share a stack): one model holds
    every case, so each replica count traces one fit."""
    import keras_sparse as ks

    inputs = {
        "a": keras.Input((3,), dtype="int32", name="a"),
        "b": keras.Input((), dtype="int32", name="b"),
        "c": keras.Input((2,), dtype="int32", name="c"),
    }
    features = []
    for opt, combiner in embeddings:
        layer = ks.AllToAllDenseEmbedding(
            40,
            4,
            combiner=combiner,
            optimizer=opt,
            embeddings_regularizer=regularizer,
            name=f"{opt}_{combiner}",
        )
        features.append(keras.layers.Flatten()(layer(inputs["a"])))
    if collection:
        tables = {
            "a": ks.TableConfig(40, 4, combiner="sum"),
            "b": ks.TableConfig(30, 4),
            "c": ks.TableConfig(20, 2, combiner="mean"),
        }
        out = ks.EmbeddingCollection(tables, optimizer="adagrad", name="collection")
        out = out(inputs)
        features += [keras.layers.Flatten()(out[n]) for n in tables]
    x = keras.layers.Concatenate()(features) if len(features) > 1 else features[0]
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


def _data(samples):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 30, (samples, 3)).astype("int32")
    ids[:, 0] = 5  # a row every replica touches in every step
    x = {"a": ids, "b": ids[:, 1], "c": ids[:, 1:] % 20}
    return x, rng.normal(size=(samples, 1)).astype("float32")


def _fit(weights, samples, jit_compile=False, **model_kwargs):
    model = _model(**model_kwargs)
    model.set_weights(weights)
    model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=jit_compile)
    x, y = _data(samples)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return model


def _largest_gaps(model, reference=None):
    """Per weight: largest gap between the replicas' copies, and to the
    reference's weight (when given)."""
    gaps = {}
    for i, var in enumerate(model.weights):
        copies = [np.asarray(c) for c in getattr(var.value, "values", [var.value])]
        gaps[var.path + " (replicas)"] = max(
            float(np.abs(copies[0] - c).max()) for c in copies
        )
        if reference is not None:
            ref = np.asarray(reference.weights[i])
            gaps[var.path] = max(float(np.abs(ref - c).max()) for c in copies)
    return gaps


def _hash_error(strategy):
    import keras_sparse as ks

    with strategy.scope():
        ids = keras.Input((3,), dtype="int64")
        emb = ks.DistributedHashEmbedding(
            4, capacity=64, optimizer="sgd", name="hashed", sharding="data"
        )  # replicated: "auto" and "key" key-shard (test_tf_sharded_hash.py)
        model = keras.Model(
            ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids)))
        )
        model.compile("sgd", "mse", jit_compile=False)
    x, y = _data(4 * BATCH)
    try:
        model.fit(x["a"].astype("int64"), y, batch_size=BATCH, verbose=0)
    except NotImplementedError as error:
        return {"error": str(error), "size": emb.stats()["size"]}
    return {"error": None, "size": emb.stats()["size"]}


def _xla_error(small):
    """The error of an XLA-compiled fit (None if it trains)."""
    try:
        _fit(_model(**small).get_weights(), BATCH, jit_compile=True, **small)
    except NotImplementedError as error:
        return str(error)
    return None


# Model arguments of each case compared with one device ("full": every
# layer but the regularized one; a row regularizer's penalty covers a
# replica's rows only).
COMPARED = {
    "full": {},
    "regularized": {
        "embeddings": [("sgd", "sum")],
        "collection": False,
        "regularizer": {"class_name": "L2", "config": {"l2": 0.5}},
    },
}


def _run_cases(replicas, references):
    """Gaps of each case on ``replicas`` replicas; errors of the others.

    ``references``: case -> (initial weights, model fitted on one device).
    """
    import tensorflow as tf

    # Each strategy numbers its collective groups from this base; strategies
    # over different device sets in one process must not share group keys.
    tf.distribute.MirroredStrategy._collective_key_base = 1000 * replicas
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    results = {}
    with strategy.scope():
        for case, kwargs in COMPARED.items():
            weights, reference = references[case]
            model = _fit(weights, BATCH * STEPS, **kwargs)
            results[case] = _largest_gaps(model, reference)
        # A last global batch of 5 samples splits 3/2 over 2 replicas, one of
        # 1 sample leaves 3 of 4 replicas without ids. Keras then scales the
        # replicas' losses unlike one device: only the copies must agree. (A
        # small model: the last batch traces the step again.)
        small = {"embeddings": [("adagrad", "sum")], "collection": False}
        weights = _model(**small).get_weights()
        tail = 5 if replicas == 2 else 1
        results["uneven"] = _largest_gaps(_fit(weights, BATCH * STEPS + tail, **small))
        results["xla"] = _xla_error(small)
    results["hash"] = _hash_error(strategy)
    return results


def _main():
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 4
    )
    keras.utils.set_random_seed(0)
    references = {}
    with tf.device("/cpu:0"):
        for case, kwargs in COMPARED.items():
            weights = _model(**kwargs).get_weights()
            references[case] = weights, _fit(weights, BATCH * STEPS, **kwargs)
    results = {r: _run_cases(r, references) for r in (2, 4)}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    _main()


# --------------------------------------------------------------------- tests
def _results(replicas):
    """The subprocess's gaps for ``replicas`` (one run for the whole module)."""
    return module_results(__file__, timeout=300)[str(replicas)]


def _assert_matches(gaps, layer):
    mine = {k: v for k, v in gaps.items() if k.startswith(layer + "/")}
    assert len(mine) >= 2, gaps.keys()
    bad = {k: v for k, v in mine.items() if v > TOL}
    assert not bad, bad


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("layer", LAYERS)
def test_matches_one_device(replicas, layer):
    """Every weight of the layer equals one device's, in every replica."""
    _assert_matches(_results(replicas)["full"], layer)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("layer", ["sgd_sum", "head"])
def test_regularizer_matches_one_device(replicas, layer):
    _assert_matches(_results(replicas)["regularized"], layer)


@pytest.mark.parametrize("replicas", [2, 4])
def test_uneven_last_batch_keeps_copies_identical(replicas):
    gaps = _results(replicas)["uneven"]
    assert any(k.startswith("adagrad_sum/embeddings") for k in gaps)
    assert max(gaps.values()) == 0.0, gaps


@pytest.mark.parametrize("replicas", [2, 4])
def test_hash_embedding_raises_before_training(replicas):
    result = _results(replicas)["hash"]
    assert result["error"] is not None, "trained under MirroredStrategy"
    assert "'hashed'" in result["error"] and "MirroredStrategy" in result["error"]
    assert "sharding='key'" in result["error"]
    assert result["size"] == 0  # the failed step inserted no key


@pytest.mark.parametrize("replicas", [2, 4])
def test_xla_compiled_step_raises(replicas):
    error = _results(replicas)["xla"]
    assert error is not None, "trained in an XLA step under MirroredStrategy"
    assert "'adagrad_sum'" in error and "jit_compile=False" in error
