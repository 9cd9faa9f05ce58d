"""A hash layer's row moves in a compiled JAX step on one CPU device: the
in-place buffer route, exact where every step re-admits the keys the step
before evicted (a reordering of the moves across steps would fill them
from stale stored copies)."""

import keras
import numpy as np
import pytest

from tests import row_store_models as shared

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="the buffer route is JAX's"
)

BATCH, FIELDS = shared.BATCH, shared.FIELDS


def _cycling(steps):
    """Five disjoint sets of 16 keys in turn, one a step: the 64-row LRU
    table holds four, so every step evicts the set the next step trains
    (the keys are re-admitted one step after their write-back)."""
    first = np.arange(BATCH * FIELDS, dtype="int64").reshape(BATCH, FIELDS) * 7 + 5
    keys = np.concatenate([first + 10_000 * (s % 5) for s in range(steps)])
    target = np.random.default_rng(0).normal(size=(len(keys), 1)).astype("float32")
    return keys, target


def test_moves_take_the_buffer_route_and_stay_exact(monkeypatch):
    from jax._src.interpreters import pxla

    from keras_sparse.layers import row_moves

    hops = []
    real_hop = row_moves._jax_buffer_hop
    monkeypatch.setattr(
        row_moves, "_jax_buffer_hop", lambda *a: hops.append(1) or real_hop(*a)
    )
    keys, target = _cycling(15)
    full, full_layer = shared.model(4096, None)
    cached, layer = shared.model(64, "host")
    for model in (full, cached):
        model.fit(keys[:40], target[:40], batch_size=BATCH, shuffle=False, verbose=0)
    assert hops  # the moves were traced on the buffer route
    # No ordered effect left in the step: JAX's C++ dispatch runs it.
    python_dispatches = []
    real_call = pxla.ExecuteReplicated.__call__

    def counted(self, *args):
        python_dispatches.append(1)
        return real_call(self, *args)

    monkeypatch.setattr(pxla.ExecuteReplicated, "__call__", counted)
    for model in (full, cached):
        model.fit(keys[40:], target[40:], batch_size=BATCH, shuffle=False, verbose=0)
    assert python_dispatches == []
    stats = layer.stats()
    assert stats["evictions"] >= 8 * BATCH * FIELDS, stats
    assert stats["fills"] >= 8 * BATCH * FIELDS, stats
    want, got = shared.records(full_layer), shared.records(layer)
    np.testing.assert_array_equal(got["keys"], want["keys"])
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
