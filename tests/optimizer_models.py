"""Shared by the tests of the compiled row updates (PyTorch helpers and the
TensorFlow op): the optimizers they run, NumPy float32 models of them, and
a small two-table model to train on either route."""

import contextlib

import keras
import numpy as np

F = np.float32
NAMES = ("sgd", "sgd_schedule", "adagrad", "adam", "rowwise_adagrad", "ftrl")
#: Trained end to end on both routes by each backend's test.
TRAINED = ("sgd", "adagrad", "adam", "rowwise_adagrad")


def optimizer(name):
    from keras_sparse import optimizers

    schedule = keras.optimizers.schedules.ExponentialDecay(0.2, 2, 0.5)
    return {
        "sgd": optimizers.SGD(0.3),
        "sgd_schedule": optimizers.SGD(schedule),
        "adagrad": optimizers.Adagrad(0.1, epsilon=1e-3),
        "adam": optimizers.Adam(0.05, beta_1=0.8, beta_2=0.9, epsilon=1e-4),
        "rowwise_adagrad": optimizers.RowWiseAdagrad(
            0.1, initial_accumulator_value=0.2, epsilon=1e-3
        ),
        # Every term of the update in use; the second with a power other
        # than a square root (the C library's powf).
        "ftrl": optimizers.Ftrl(
            0.2, l1_regularization_strength=0.05, l2_regularization_strength=0.1,
            l2_shrinkage_regularization_strength=0.02, beta=0.3,
        ),
        "ftrl_power": optimizers.Ftrl(
            schedule, learning_rate_power=-0.3, l1_regularization_strength=0.01,
            beta=0.5,
        ),
    }[name]  # fmt: skip


def route_atol(name):
    """The absolute tolerance between the compiled route and the backend's
    own: Ftrl's row is a difference of near values (the clipped linear
    slot minus itself), where an ulp of a root becomes ~1e-7 absolute."""
    return 1e-6 if name.startswith("ftrl") else 1e-7


def given_updates(**extra):
    """hypothesis ``@given`` over one update: ``seed``, ``n`` ids, ``rows``,
    ``dim``, ``it`` (updates before), and ``extra`` strategies."""
    from hypothesis import given
    from hypothesis import strategies as st

    return given(
        seed=st.integers(0, 2**16), n=st.integers(0, 100), rows=st.integers(1, 20),
        dim=st.sampled_from([1, 3, 16]), it=st.integers(0, 7), **extra,
    )  # fmt: skip


def random_state(opt, rng, num_rows, dim):
    """``(table, slots)``: float32 arrays, slots above their initial value."""
    table = rng.normal(size=(num_rows, dim)).astype(F)
    slots = {
        spec.name: (
            spec.initial_value + rng.uniform(0, 1, spec.shape(num_rows, dim))
        ).astype(F)
        for spec in opt.slot_specs()
    }
    return table, slots


def random_batch(rng, rows, n, dim):
    """``(ids, valid, grads)``: ``n`` ids in ``[0, rows)``, a fifth of them
    not valid, and float32 gradients."""
    ids = rng.integers(0, rows, n)
    valid = rng.random(n) >= 0.2
    return ids, valid, rng.normal(size=(n, dim)).astype(F)


def numpy_update(name, opt, table, slots, ids, valid, grads, iterations, first=0):
    """The optimizer's update in NumPy float32 (a correctly rounded sqrt),
    one distinct row (``first + id``) at a time; returns the new state."""
    table = table.copy()
    slots = {k: v.copy() for k, v in slots.items()}
    lr = F(float(opt.current_learning_rate(iterations)))
    for key in dict.fromkeys(ids[valid].tolist()):
        g = np.zeros(table.shape[1], F)
        for p in np.flatnonzero(valid & (ids == key)):
            g = g + grads[p]
        row = first + key
        if name.startswith("sgd"):
            table[row] = table[row] - lr * g
        elif name == "adagrad":
            acc = slots["accumulator"][row] + g * g
            slots["accumulator"][row] = acc
            table[row] = table[row] - lr * g / np.sqrt(acc + F(opt.epsilon))
        elif name == "rowwise_adagrad":
            squares = F(0)
            for x in g * g:  # in column order, as the compiled loop sums
                squares = squares + x
            acc = slots["accumulator"][row] + squares / F(len(g))
            slots["accumulator"][row] = acc
            table[row] = table[row] - lr * g / np.sqrt(acc + F(opt.epsilon))
        elif name.startswith("ftrl"):
            _ftrl_row(opt, lr, table, slots, row, g)
        else:
            alpha = F(float(opt.step_size(lr, iterations, "float32")))
            m, v = slots["momentum"][row], slots["velocity"][row]
            m = m + (g - m) * F(1 - opt.beta_1)
            v = v + (g * g - v) * F(1 - opt.beta_2)
            slots["momentum"][row], slots["velocity"][row] = m, v
            table[row] = table[row] - (m * alpha) / (np.sqrt(v) + F(opt.epsilon))
    return {"table": table, **slots}


def _ftrl_row(opt, lr, table, slots, row, g):
    """Ftrl on one row in place, in the optimizer's order of operations."""
    power = F(-opt.learning_rate_power)
    pow_ = np.sqrt if power == F(0.5) else (lambda x: _powf(x, power))
    old_acc = slots["accumulator"][row]
    new_acc = old_acc + g * g
    new_power, old_power = pow_(new_acc), pow_(old_acc)
    w = table[row]
    shrink = F(2 * opt.l2_shrinkage_regularization_strength)
    linear = (slots["linear"][row] + (g + shrink * w)) - (
        (new_power - old_power) / lr
    ) * w
    l1 = F(opt.l1_regularization_strength)
    l2_reg = F(opt.l2_regularization_strength) + F(opt.beta) / (F(2) * lr)
    clipped = np.where(linear < -l1, -l1, np.where(linear > l1, l1, linear))
    slots["accumulator"][row], slots["linear"][row] = new_acc, linear
    table[row] = (clipped - linear) / (new_power / lr + F(2) * l2_reg)


def _powf(x, p):
    """``x ** p`` elementwise by the C library's powf, which the compiled
    update calls (NumPy's float32 power may be another implementation)."""
    import ctypes
    import ctypes.util

    powf = ctypes.CDLL(ctypes.util.find_library("m")).powf
    powf.restype, powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    return np.array([powf(float(v), float(p)) for v in x], F)


def optimizer_update(opt, table, slots, ids, valid, grads, iterations):
    """The new state by the optimizer's own ``update`` in Keras operations
    (the arithmetic of each backend's reference route) on the distinct
    valid ids, their gradients summed by NumPy."""
    keys = list(dict.fromkeys(ids[valid].tolist()))
    out = {"table": table.copy(), **{k: v.copy() for k, v in slots.items()}}
    if not keys:
        return out
    summed = np.stack([grads[valid & (ids == k)].sum(0) for k in keys]).astype(F)
    tensor = keras.ops.convert_to_tensor
    new_rows, new_slots = opt.update(
        tensor(table[keys]), {k: tensor(v[keys]) for k, v in slots.items()},
        tensor(summed), iterations,
    )  # fmt: skip
    for name, values in {"table": new_rows, **new_slots}.items():
        out[name][keys] = keras.ops.convert_to_numpy(values)
    return out


def check_several_steps(apply, name, steps=4, rows=6, n=40, dim=16):
    """Chains ``steps`` updates of ``name``, each ``n`` ids over ``rows``
    rows (duplicates in every batch), through ``apply(optimizer, table,
    slots, ids, valid, grads, iterations) -> state`` (the compiled route):
    its state equals the NumPy model to the bit and the optimizer's own
    update to 10 * `route_atol` after each step."""
    opt = optimizer(name)
    rng = np.random.default_rng(7)
    table, slots = random_state(opt, rng, rows, dim)
    states = [{"table": table, **slots}] * 3  # compiled, NumPy, reference

    def split(state):
        return state["table"], {k: v for k, v in state.items() if k != "table"}

    for it in range(steps):
        ids, valid, grads = random_batch(rng, rows, n, dim)
        assert len(set(ids[valid].tolist())) < valid.sum()  # duplicates
        compiled, model, reference = states
        states = [
            apply(opt, *split(compiled), ids, valid, grads, it),
            numpy_update(name, opt, *split(model), ids, valid, grads, it),
            optimizer_update(opt, *split(reference), ids, valid, grads, it),
        ]
        for key in states[1]:
            np.testing.assert_array_equal(states[0][key], states[1][key], key)
            np.testing.assert_allclose(
                states[0][key], states[2][key], rtol=1e-6,
                atol=10 * route_atol(name),  # steps compound the roundings
                err_msg=key,
            )  # fmt: skip
    assert not np.array_equal(states[0]["table"], table)  # the steps did update


def train(form, name, eager=False, jit_compile="auto"):
    """Trains two tables (separate layers or one collection) of optimizer
    ``name`` for 8 steps; returns every weight of the model."""
    import keras_sparse as ks

    keras.utils.set_random_seed(3)
    inputs = {n: keras.Input((4,), dtype="int32", name=n) for n in ("a", "b")}
    if form == "layers":
        parts = [
            ks.AllToAllDenseEmbedding(
                50, 6, combiner="sum", optimizer=optimizer(name), name=f"t_{n}"
            )(x)
            for n, x in inputs.items()
        ]
    else:
        collection = ks.EmbeddingCollection(
            {n: ks.TableConfig(50 + 7 * i, 6, combiner="sum")
             for i, n in enumerate(inputs)},
            optimizer=optimizer(name),
        )  # fmt: skip
        outputs = collection(inputs)
        parts = [outputs[n] for n in inputs]
    pooled = keras.layers.Concatenate()(parts)
    model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
    model.compile(
        optimizer="sgd", loss="mse", run_eagerly=eager, jit_compile=jit_compile
    )
    rng = np.random.default_rng(0)
    x = {n: rng.integers(0, 50, (64, 4)).astype("int32") for n in inputs}
    model.fit(x, rng.normal(size=(64, 1)), batch_size=16, epochs=2, verbose=0)
    return [np.array(v) for v in model.weights]


def route_cases():
    """``(optimizer, constraint, compiled)``: what the compiled updates take
    (exact built-in classes, no constraint) and what they leave to the
    backend's own operations, with a batch that updates rows 0 and 2."""
    from keras_sparse import optimizers

    class ClippedAdagrad(optimizers.Adagrad):
        def new_slots(self, rows, slots, grads, lr, iterations):
            return super().new_slots(rows, slots, keras.ops.clip(grads, -1, 1), lr, 0)

    rng = np.random.default_rng(0)
    batch = (np.array([0, 2, 2]), np.ones(3, bool), rng.normal(size=(3, 4)).astype(F))
    cases = [
        (optimizers.Adagrad(0.1), None, True),
        (ClippedAdagrad(0.1), None, False),
        (optimizers.Adagrad(0.1), keras.constraints.MaxNorm(1.0), False),
        (optimizers.RowWiseAdagrad(0.1), None, True),
        (optimizers.RowWiseAdagrad(0.1), keras.constraints.MaxNorm(1.0), False),
        (optimizers.Ftrl(0.1), None, True),
        (optimizers.Ftrl(0.1), keras.constraints.MaxNorm(1.0), False),
    ]
    return cases, batch


def tf_op():
    """``(tf, tf_native_rows)``; skips the test where the op cannot be built."""
    import pytest
    import tensorflow as tf

    from keras_sparse.ops.tensorflow import native_rows as tf_native_rows

    if tf_native_rows.library() is None:
        pytest.skip(f"TensorFlow op unavailable: {tf_native_rows.status()}")
    return tf, tf_native_rows


@contextlib.contextmanager
def switch(module, name, on):
    """``module.<name>`` (a route switch, True by default) set to ``on``
    inside, back to True after."""
    setattr(module, name, on)
    try:
        yield
    finally:
        setattr(module, name, True)


def record_use(monkeypatch, module, name):
    """Wraps ``module.name``; returns a list that gets, per call, whether
    the call took the compiled route: returned something other than None
    or False."""
    real = getattr(module, name)
    used = []

    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        used.append(result is not None and result is not False)
        return result

    monkeypatch.setattr(module, name, wrapper)
    return used
