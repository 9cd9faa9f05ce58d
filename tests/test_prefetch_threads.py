"""A fit fed by a prefetch stage whose source fails leaves no thread behind.

Keras shuts its callbacks' thread pool down in ``on_train_end``, which a
failing ``fit`` never reaches: the pool goes when the last reference to
``fit``'s frames does. The stage's error must not keep those frames in a
reference cycle (only the garbage collector breaks one, at some later
time), so with the collector off, every thread started by the fit ends
once the caller drops the error.
"""

import gc
import threading
import time

import keras
import numpy as np

from keras_sparse.data import PrefetchError
from keras_sparse.data import prefetch
from keras_sparse.layers import DistributedHashEmbedding


def _model():
    keys = keras.Input((2,), dtype="int32", name="keys")
    emb = DistributedHashEmbedding(
        4, capacity=64, combiner="sum", optimizer="adagrad", name="emb"
    )(keys)
    model = keras.Model(keys, keras.layers.Dense(1)(emb))
    model.compile("sgd", "mse")
    return model


def _failing_source():
    rng = np.random.default_rng(0)
    for i in range(8):
        if i == 3:
            raise ZeroDivisionError("the source broke at batch 3")
        keys = rng.integers(0, 50, (8, 2)).astype(np.int32)
        yield keys, np.ones((8, 1), np.float32)


def _fit_error(model, stage):
    """The error ``fit`` raises, as (type, message, worker's error)."""
    try:
        model.fit(stage, epochs=1, verbose=0)
    except Exception as error:  # noqa: BLE001 - inspected below
        original = error.original if isinstance(error, PrefetchError) else None
        return type(error), str(error), original
    raise AssertionError("fit did not raise")


def _threads_left(before, seconds=2.0):
    end = time.perf_counter() + seconds
    while True:
        left = [t for t in threading.enumerate() if t not in before]
        if not left or time.perf_counter() > end:
            return left
        time.sleep(0.01)


def test_a_failed_fit_leaves_no_thread_behind():
    model = _model()
    gc.collect()
    gc.disable()
    try:
        before = set(threading.enumerate())
        stage = prefetch(_failing_source, model, steps=8, threads=2)
        kind, message, original = _fit_error(model, stage)
        left = _threads_left(before)
        stage.close()
    finally:
        gc.enable()
    assert "ZeroDivisionError: the source broke at batch 3" in message
    if keras.backend.backend() != "tensorflow":  # tf.data re-wraps errors
        assert kind is PrefetchError
        assert type(original) is ZeroDivisionError
        assert str(original) == "the source broke at batch 3"
    assert not left, [t.name for t in left]
