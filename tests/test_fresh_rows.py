"""Initial values of freshly assigned rows: sized to the fresh count."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_sparse.layers.hash.fresh_rows import draw
from keras_sparse.layers.hash.fresh_rows import draw_sizes
from keras_sparse.layers.hash.fresh_rows import fresh_row_values

N, DIM = 1024, 8


def _mask(positions):
    m = np.zeros(N, bool)
    m[list(positions)] = True
    return ops.convert_to_tensor(m)


@pytest.mark.parametrize(
    "fresh_count, drawn_rows", [(3, 32), (32, 32), (33, 128), (129, 512), (N, N)]
)
def test_the_kth_fresh_position_gets_row_k_of_the_smallest_draw_that_fits(
    fresh_count, drawn_rows
):
    assert draw_sizes(N) == [32, 128, 512, N]
    assert draw_sizes(40) == [2, 5, 20, 40]
    init = keras.initializers.RandomUniform(-1.0, 1.0)
    rng = np.random.default_rng(fresh_count)
    positions = np.sort(rng.choice(N, size=fresh_count, replace=False))
    gen = keras.random.SeedGenerator(7)
    seed = ops.convert_to_numpy(gen.state)
    got = ops.convert_to_numpy(
        fresh_row_values(init, _mask(positions), DIM, "float32", gen)
    )
    assert got.shape == (N, DIM)
    # The generator advanced exactly once (as one initializer call would).
    ref = keras.random.SeedGenerator(7)
    ref.next()
    np.testing.assert_array_equal(ops.convert_to_numpy(gen.state), ref.state)
    want = ops.convert_to_numpy(
        draw(init, (drawn_rows, DIM), "float32", ops.convert_to_tensor(seed))
    )
    np.testing.assert_array_equal(got[positions], want[:fresh_count])
    fresh = got[positions]
    assert np.all((fresh >= -1.0) & (fresh < 1.0))
    assert len({row.tobytes() for row in fresh}) == fresh_count  # all distinct


def test_variance_scaling_uses_the_given_fans_and_constants_are_exact():
    gen = keras.random.SeedGenerator(3)
    mask = _mask(range(0, N, 2))  # 512 fresh positions -> the 512-row draw
    init = keras.initializers.VarianceScaling(
        scale=1.0, mode="fan_in", distribution="uniform"
    )
    fans = (10_000, DIM)  # the table's fans: limit sqrt(3 / 10000)
    got = ops.convert_to_numpy(fresh_row_values(init, mask, DIM, "float32", gen, fans))
    limit = np.sqrt(3.0 / 10_000)
    fresh = got[::2]
    assert np.abs(fresh).max() <= limit
    assert np.abs(fresh).max() > 0.9 * limit  # not the batch's (wider) fans
    assert abs(fresh.std() - limit / np.sqrt(3.0)) < 0.1 * limit

    before = ops.convert_to_numpy(gen.state)
    const = ops.convert_to_numpy(
        fresh_row_values(keras.initializers.Constant(0.25), mask, DIM, "float32", gen)
    )
    np.testing.assert_array_equal(const, np.full((N, DIM), 0.25, "float32"))
    np.testing.assert_array_equal(ops.convert_to_numpy(gen.state), before)


def test_same_generator_state_and_mask_give_the_same_values():
    mask = _mask([1, 5, 700])
    init = keras.initializers.RandomNormal(stddev=0.1)
    a = fresh_row_values(init, mask, DIM, "float32", keras.random.SeedGenerator(11))
    b = fresh_row_values(init, mask, DIM, "float32", keras.random.SeedGenerator(11))
    c = fresh_row_values(init, mask, DIM, "float32", keras.random.SeedGenerator(12))
    a, b, c = (ops.convert_to_numpy(t)[[1, 5, 700]] for t in (a, b, c))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_accelerators_draw_every_row_without_a_branch(monkeypatch):
    from keras_sparse.layers.hash import fresh_rows

    monkeypatch.setattr(fresh_rows, "sized_draws", lambda: False)
    init = keras.initializers.RandomUniform(-1.0, 1.0)
    gen = keras.random.SeedGenerator(5)
    seed = ops.convert_to_tensor(ops.convert_to_numpy(gen.state))
    got = fresh_row_values(init, _mask([3, 9]), DIM, "float32", gen)
    got = ops.convert_to_numpy(got)
    want = ops.convert_to_numpy(draw(init, (N, DIM), "float32", seed))
    np.testing.assert_array_equal(got[[3, 9]], want[:2])
