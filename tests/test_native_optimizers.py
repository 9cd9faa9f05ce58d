"""The compiled SGD, Adagrad and Adam row updates of the PyTorch CPU route
(keras_sparse.ops.native_optimizers): equal to a NumPy float32 model of each
optimizer to the bit, within an ulp of the torch route (whose vectorized
sqrt may round differently), and only where they apply."""

import contextlib

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="the torch backend's own update"
)

F = np.float32


def _modules():
    import torch

    from keras_sparse.ops import native_optimizers
    from keras_sparse.ops import native_rows
    from keras_sparse.ops import torch_row_updates

    if native_rows.library() is None:
        pytest.skip(f"compiled helpers unavailable: {native_rows.status()}")
    return torch, native_optimizers, torch_row_updates


@contextlib.contextmanager
def _fused(on):
    _, native_optimizers, _ = _modules()
    native_optimizers.FUSED_OPTIMIZERS = on
    try:
        yield
    finally:
        native_optimizers.FUSED_OPTIMIZERS = True


def _optimizer(name):
    from keras_sparse import optimizers

    schedule = keras.optimizers.schedules.ExponentialDecay(0.2, 2, 0.5)
    return {
        "sgd": optimizers.SGD(0.3),
        "sgd_schedule": optimizers.SGD(schedule),
        "adagrad": optimizers.Adagrad(0.1, epsilon=1e-3),
        "adam": optimizers.Adam(0.05, beta_1=0.8, beta_2=0.9, epsilon=1e-4),
    }[name]


def _numpy_update(name, optimizer, table, slots, ids, valid, grads, iterations):
    """The optimizer's update in NumPy float32, one distinct row at a time."""
    table = table.copy()
    slots = {k: v.copy() for k, v in slots.items()}
    lr = F(float(optimizer.current_learning_rate(iterations)))
    for key in dict.fromkeys(ids[valid].tolist()):
        g = np.zeros(table.shape[1], F)
        for p in np.flatnonzero(valid & (ids == key)):
            g = g + grads[p]
        row = table[key]
        if name.startswith("sgd"):
            table[key] = row - lr * g
        elif name == "adagrad":
            acc = slots["accumulator"][key] + g * g
            slots["accumulator"][key] = acc
            table[key] = row - lr * g / np.sqrt(acc + F(optimizer.epsilon))
        else:
            alpha = F(float(optimizer.step_size(lr, iterations, "float32")))
            m = slots["momentum"][key]
            v = slots["velocity"][key]
            m = m + (g - m) * F(1 - optimizer.beta_1)
            v = v + (g * g - v) * F(1 - optimizer.beta_2)
            slots["momentum"][key], slots["velocity"][key] = m, v
            table[key] = row - (m * alpha) / (np.sqrt(v) + F(optimizer.epsilon))
    return {"table": table, **slots}


def _state(optimizer, rng, num_rows, dim):
    table = rng.normal(size=(num_rows, dim)).astype(F)
    slots = {
        spec.name: (spec.initial_value + rng.uniform(0, 1, (num_rows, dim))).astype(F)
        for spec in optimizer.slot_specs()
    }
    return table, slots


def _apply(optimizer, table, slots, ids, valid, grads, iterations, constraint=None):
    torch, _, updates = _modules()
    state = {"table": torch.tensor(table)}
    state.update({k: torch.tensor(v) for k, v in slots.items()})
    scratch = torch.zeros(table.shape[0] + 1, dtype=torch.int32)
    updates.apply_row_updates(
        state, scratch, optimizer, torch.tensor(ids), torch.tensor(valid),
        torch.tensor(grads), torch.tensor(iterations), constraint, None,
    )  # fmt: skip
    return {k: v.numpy() for k, v in state.items()}


@pytest.mark.parametrize("name", ["sgd", "sgd_schedule", "adagrad", "adam"])
@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 120),
    num_rows=st.integers(1, 25),
    dim=st.sampled_from([1, 3, 16, 19]),
    iterations=st.integers(0, 7),
)
def test_fused_update_equals_numpy_and_the_torch_route(
    name, seed, n, num_rows, dim, iterations
):
    optimizer = _optimizer(name)
    rng = np.random.default_rng(seed)
    table, slots = _state(optimizer, rng, num_rows, dim)
    ids = rng.integers(0, num_rows, n)
    valid = rng.random(n) >= 0.2
    grads = rng.normal(size=(n, dim)).astype(F)
    fused = _apply(optimizer, table, slots, ids, valid, grads, iterations)
    want = _numpy_update(name, optimizer, table, slots, ids, valid, grads, iterations)
    with _fused(False):
        torch_route = _apply(optimizer, table, slots, ids, valid, grads, iterations)
    assert fused.keys() == want.keys() == torch_route.keys()
    for key in want:
        np.testing.assert_array_equal(fused[key], want[key], err_msg=key)
        np.testing.assert_allclose(
            fused[key], torch_route[key], rtol=2e-6, atol=1e-7, err_msg=key
        )


def _spy_on_fused(monkeypatch):
    """Counts the compiled optimizer passes."""
    _, native_optimizers, _ = _modules()
    calls = []
    real = native_optimizers.fused_update

    def spy(*args):
        done = real(*args)
        calls.append(done)
        return done

    monkeypatch.setattr(native_optimizers, "fused_update", spy)
    return calls


def test_subclasses_constraints_and_other_optimizers_take_the_torch_route(
    monkeypatch,
):
    from keras_sparse import optimizers

    torch, _, updates = _modules()

    class ClippedAdagrad(optimizers.Adagrad):
        def new_slots(self, rows, slots, grads, lr, iterations):
            return super().new_slots(rows, slots, keras.ops.clip(grads, -1, 1), lr, 0)

    rng = np.random.default_rng(0)
    ids, valid = np.array([0, 2, 2]), np.ones(3, bool)
    grads = rng.normal(size=(3, 4)).astype(F) * 5
    cases = [
        (optimizers.Adagrad(0.1), None, True),
        (ClippedAdagrad(0.1), None, False),
        (optimizers.Adagrad(0.1), keras.constraints.MaxNorm(1.0), False),
        (optimizers.RowWiseAdagrad(0.1), None, False),
        (optimizers.Ftrl(0.1), None, False),
    ]
    for optimizer, constraint, expect_fused in cases:
        calls = _spy_on_fused(monkeypatch)
        table, slots = _state(optimizer, rng, 4, 4)
        got = _apply(optimizer, table, slots, ids, valid, grads, 0, constraint)
        assert calls == [expect_fused], optimizer
        with _fused(False):
            want = _apply(optimizer, table, slots, ids, valid, grads, 0, constraint)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-6, atol=1e-7)
    # The clip reached the accumulator: the subclass's own update ran.
    clipped = ClippedAdagrad(0.1)
    table, slots = _state(clipped, rng, 4, 4)
    got = _apply(clipped, table, slots, ids, valid, grads, 0)
    assert got["accumulator"][0].max() <= slots["accumulator"][0].max() + 1


def test_layers_train_alike_on_both_routes(monkeypatch):
    import keras_sparse as ks

    def train(name):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((4,), dtype="int32")
        pooled = ks.AllToAllDenseEmbedding(
            50, 6, combiner="sum", optimizer=_optimizer(name)
        )(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
        model.compile(optimizer="sgd", loss="mse")
        rng = np.random.default_rng(0)
        x = rng.integers(0, 50, (64, 4)).astype("int32")
        model.fit(x, rng.normal(size=(64, 1)), batch_size=16, epochs=2, verbose=0)
        return [np.array(v) for v in model.layers[1].variables]

    for name in ("sgd", "adagrad", "adam"):
        calls = _spy_on_fused(monkeypatch)
        fused = train(name)
        assert calls and all(calls), name  # every step took the compiled pass
        with _fused(False):
            reference = train(name)
        for got, want in zip(fused, reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
