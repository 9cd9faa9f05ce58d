"""Inference from several threads at once (a model server's pattern) equals
sequential inference, with 64-bit keys, on every backend."""

import threading

import keras
import numpy as np

import keras_sparse as ks


def _served_model():
    keras.utils.set_random_seed(0)
    keys = keras.Input((3,), dtype="int64")
    ids = keras.Input((2,), dtype="int64")
    hashed = ks.DistributedHashEmbedding(8, capacity=4096, combiner="sum", name="h")
    fixed = ks.AllToAllDenseEmbedding(50, 8, combiner="mean", name="d")
    joined = keras.layers.Concatenate()([hashed(keys), fixed(ids)])
    model = keras.Model([keys, ids], keras.layers.Dense(1)(joined))
    rng = np.random.default_rng(0)
    # Keys differing only above bit 32 must keep rows of their own.
    low = rng.integers(0, 2**20, (16, 64, 3))
    high = rng.integers(0, 4, (16, 64, 3)) << 32
    batches = [(k, rng.integers(0, 50, (64, 2))) for k in low + high]
    hashed(np.concatenate([k for k, _ in batches]), training=True)
    return model, hashed, batches


def _outputs(model, batch):
    return keras.ops.convert_to_numpy(model(list(batch), training=False))


def test_threads_calling_one_model_get_the_sequential_outputs():
    model, _, batches = _served_model()
    expected = [_outputs(model, b) for b in batches]
    # Wide keys do get rows of their own (the check below could not pass
    # on keys truncated to 32 bits).
    assert len({e.tobytes() for e in expected}) == len(expected)
    wrong, errors = [], []

    def serve(first):
        for _ in range(3):
            for i in range(first, len(batches), 2):
                try:
                    if not np.array_equal(_outputs(model, batches[i]), expected[i]):
                        wrong.append(i)
                except Exception as e:  # reported below
                    errors.append(repr(e))

    threads = [threading.Thread(target=serve, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and wrong == []


def test_a_direct_call_leaves_the_trainers_key_queue_alone():
    """The full keys a running ``fit`` queued for its next steps stay queued
    while another thread calls the model directly (JAX without x64 keeps
    them; other backends queue nothing)."""
    from keras_sparse.layers import jax_key_queue

    model, hashed, batches = _served_model()
    queued = np.arange(3 * 64, dtype=np.int64) + 2**33
    jax_key_queue.key_queue(hashed).append(queued)
    _outputs(model, batches[0])
    assert jax_key_queue.key_queue(hashed).head() is queued
