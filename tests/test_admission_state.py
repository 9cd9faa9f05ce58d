"""Count-min sketch state: save, restore and re-bin to another width."""

import numpy as np
import pytest

from keras_sparse.table.admission import CountMinSketch

pytestmark = pytest.mark.backend_independent


def _filled(width, seed=3):
    rng = np.random.default_rng(0)
    keys = rng.integers(-(2**63), 2**63 - 1, size=3000, dtype=np.int64)
    keys = np.unique(keys)
    counts = rng.integers(1, 5, size=keys.shape[0]).astype(np.int64)
    sketch = CountMinSketch(width, seed=seed)
    sketch.add(keys, counts)
    return sketch, keys, counts


def _estimates(sketch, keys):
    return sketch.add(keys, np.zeros(keys.shape[0], np.int64))


@pytest.mark.parametrize("new_width", [256, 1024, 4096, 16384])
def test_rebinned_state_never_undercounts(new_width):
    sketch, keys, counts = _filled(1024)
    other = CountMinSketch(new_width, seed=3)
    other.load_state(sketch.state(), seed=3)
    est = _estimates(other, keys)
    assert np.all(est >= counts)
    if new_width == 1024:  # same width: exact copy
        np.testing.assert_array_equal(other.state(), sketch.state())
        np.testing.assert_array_equal(est, _estimates(sketch, keys))
    if new_width > 1024:  # splitting copies cells: estimates are unchanged
        np.testing.assert_array_equal(est, _estimates(sketch, keys))


def test_state_is_a_copy_and_bad_states_are_rejected():
    sketch, _, _ = _filled(1024)
    state = sketch.state()
    state[...] = 0
    assert sketch.state().sum() > 0
    other = CountMinSketch(1024, seed=3)
    with pytest.raises(ValueError, match="seed"):
        other.load_state(sketch.state(), seed=4)
    with pytest.raises(ValueError, match="shape"):
        other.load_state(np.zeros((3, 1024), np.uint32), seed=3)
    with pytest.raises(ValueError, match="power of two"):
        other.load_state(np.zeros((4, 1000), np.uint32), seed=3)
    assert other.state().sum() == 0
