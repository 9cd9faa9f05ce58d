"""The workers' copy check of a table with ``cache_rows`` under a
MultiWorkerMirroredStrategy (`keras_sparse.layers.row_storage.cache_workers`):
what each worker's step decides from the gathered fingerprints. The real
two-worker run (tests/test_tf_multiworker.py) trains copies that agree;
here the fingerprints of real copies (two tables, two disk folders) stand
in for the workers'."""

import os

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.layers.row_storage import cache_copies
from keras_sparse.layers.row_storage import cache_workers

# Host-side decisions on NumPy words: once, not per backend.
pytestmark = pytest.mark.backend_independent


def _cache(seed, store="host"):
    layer = ks.AllToAllDenseEmbedding(
        500, 4, optimizer="adagrad", cache_rows=20, store=store, name="ids",
        embeddings_initializer=keras.initializers.RandomUniform(seed=seed),
    )  # fmt: skip
    layer.build((None, 2))
    return layer.row_cache


def _words(cache):
    """The cache's fingerprint words, as its worker's first step takes
    them (and keeps them for `check`)."""
    variables = [cache.embeddings, *cache.slots.values()]
    values = [keras.ops.convert_to_numpy(v) for v in variables]
    identity = cache_copies.identity(cache, values)
    words = cache_workers._words(*identity)
    cache.__dict__["_worker_words"] = words
    return words


def test_equal_copies_pass_and_differing_ones_are_refused():
    mine, same, other = _cache(1), _cache(1), _cache(2)
    words = _words(mine)
    np.testing.assert_array_equal(words, _words(same))
    # Two replicas per worker: each worker's first replica is compared.
    gathered = np.concatenate([words, words, _words(same), _words(same)])
    cache_workers.check(mine, gathered, 2)
    before = mine.stats()
    gathered = np.concatenate([words, _words(other)])
    with pytest.raises(ValueError) as error:
        cache_workers.check(mine, gathered, 1)
    message = str(error.value)
    assert "Layer 'ids'" in message and "`cache_rows`" in message, message
    assert "MultiWorkerMirroredStrategy with 2 workers" in message, message
    assert "copies differ" in message and "chief's seed" in message, message
    assert mine.stats() == before


def test_workers_sharing_a_disk_folder_are_refused(tmp_path):
    shared = _cache(1, ks.store.Disk(os.fspath(tmp_path / "shared")))
    own = _cache(1, ks.store.Disk(os.fspath(tmp_path / "worker1")))
    words, other = _words(shared), _words(own)
    assert not np.array_equal(words[:2], other[:2])  # folders told apart
    cache_workers.check(shared, np.concatenate([words, other]), 1)
    with pytest.raises(ValueError) as error:
        cache_workers.check(shared, np.concatenate([words, words]), 1)
    message = str(error.value)
    assert "share the disk store's folder" in message, message
    assert os.path.realpath(tmp_path / "shared") in message, message
    assert "worker{index}" in message, message
