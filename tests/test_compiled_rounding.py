"""16-bit tables on the compiled CPU routes (kernels/cpu_rounding.c): the
rows they write equal the backends' own rounding (`row_rounding`) and the
NumPy models of the optimizers and of stochastic rounding, to the bit."""

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

from keras_sparse.ops import native_rows
from keras_sparse.ops import optimizer_rules
from keras_sparse.ops import row_rounding
from tests import optimizer_models as models
from tests import rounding_models

NUMPY = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _library():
    lib = native_rows.library()
    if lib is None:
        pytest.skip(f"compiled helpers unavailable: {native_rows.status()}")
    return lib


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_written_bits_equal_the_python_rounding(dtype):
    lib = _library()
    rng = np.random.RandomState(0)
    # Magnitudes from float32 subnormals to past float16's range; specials.
    x = (rng.randn(64, 8) * np.exp(rng.uniform(-100, 14, (64, 1)))).astype(np.float32)
    x[0] = [0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0, 1e-8, -3e-39]
    rows = rng.permutation(500)[:64]
    table = np.zeros((500, 8), np.uint16)
    kind = native_rows.KINDS[dtype]
    seed = row_rounding.Seed(11, "table")
    lib.narrow_rows((table, kind), rows, x, row_rounding.int_seed(11, "table"))
    got = table[rows].view(NUMPY[dtype])
    want = row_rounding.to_storage(
        ops.convert_to_tensor(x), dtype, ops.convert_to_tensor(rows), seed
    )
    want = ops.convert_to_numpy(ops.cast(want, "float32"))
    np.testing.assert_array_equal(got.astype(np.float32), want)
    # Signs of zeros too, but from float32 subnormals, which XLA and
    # TensorFlow read as zeros (whose sign then differs).
    normal = np.abs(x) >= np.finfo(np.float32).tiny
    assert np.array_equal(np.signbit(got[normal]), np.signbit(want[normal]))
    inside = np.abs(x).max(1) < 6e4  # the NumPy model's range
    np.testing.assert_array_equal(
        got[inside].astype(np.float32),
        rounding_models.stochastic_round(x[inside], rows[inside], 11, "table", dtype),
    )
    assert np.array_equal(lib.widen_rows((table, kind), rows), got.astype(np.float32))
    lib.narrow_rows((table, kind), rows, x)  # no seed: to nearest, as a cast
    np.testing.assert_array_equal(table[rows], x.astype(NUMPY[dtype]).view(np.uint16))


# (table, slots): 16-bit tables, 16-bit slots, both.
DTYPES = [("bfloat16", "float32"), ("float32", "float16"), ("float16", "bfloat16")]


def _compiled_update(
    opt, state, ids, valid, grads, step, first, rows, stochastic, expect_ran=True
):
    """The backend's compiled update of ``state`` (NumPy arrays in their
    dtypes) in place of rows ``[first, first + rows)``; asserts it ran (or,
    with ``expect_ran=False``, that it declined, returning None)."""
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        from keras_sparse.ops import native_optimizers

        tensors = {k: _to_torch(v) for k, v in state.items()}
        unique = np.array(list(dict.fromkeys((first + ids[valid]).tolist())), np.int64)
        summed = np.zeros((len(unique), grads.shape[1]), np.float32)
        for p in np.flatnonzero(valid):  # in position order, as the dedup
            summed[list(unique).index(first + ids[p])] += grads[p]
        ran = native_optimizers.fused_update(
            _library(), opt, tensors, unique, summed,
            torch.tensor(step), None, stochastic,
        )  # fmt: skip
        assert ran is expect_ran
        return {k: _to_numpy(v) for k, v in tensors.items()} if ran else None
    if backend == "jax":
        from keras_sparse.ops.jax import native_rows as jax_native_rows

        arrays = {k: ops.convert_to_tensor(v) for k, v in state.items()}
        if jax_native_rows.library() is None:
            pytest.skip(f"JAX custom call unavailable: {jax_native_rows.status()}")
        slots = [arrays[k] for k in state if k != "table"]
        found = jax_native_rows.fused_rule(opt, None, arrays["table"], slots)
        assert (found is not None) is expect_ran
        if found is None:
            return None
        out = jax_native_rows.fused_update(
            arrays, opt, ids, valid, grads, step, *found, stochastic
        )
        return {k: np.asarray(v) for k, v in out.items()}
    import tensorflow as tf

    from keras_sparse.ops.tensorflow import native_rows as tf_native_rows

    if tf_native_rows.library() is None:
        pytest.skip(f"TensorFlow op unavailable: {tf_native_rows.status()}")
    variables = {k: tf.Variable(v) for k, v in state.items()}
    ran = tf_native_rows.fused_update(
        variables, opt, tf.constant(ids, tf.int32), tf.constant(valid),
        tf.constant(grads), tf.constant(step, tf.int64), first, rows, None,
        stochastic,
    )  # fmt: skip
    assert (ran is not None) is expect_ran
    return {k: v.numpy() for k, v in variables.items()} if ran is not None else None


def _to_torch(array):
    import torch

    if array.dtype == np.float32:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(np.int16)).view(getattr(torch, str(array.dtype)))


def _to_numpy(tensor):
    import torch

    if tensor.dtype == torch.float32:
        return tensor.numpy()
    return tensor.view(torch.int16).numpy().view(NUMPY[str(tensor.dtype)[6:]])


#: The optimizers of the 16-bit compiled update, by their model's name.
SIXTEEN_BIT = ("sgd", "adagrad", "adam", "rowwise_adagrad", "ftrl")


def test_compiled_update_of_16_bit_arrays_equals_the_numpy_model():
    _library()
    assert set(SIXTEEN_BIT) == optimizer_rules.SIXTEEN_BIT_RULES
    for i, name in enumerate(SIXTEEN_BIT):  # one test: each costs a reset
        _check_update(name, DTYPES[i % len(DTYPES)])
    # Ftrl (two slots, a row from a difference of near values) on a
    # bfloat16 table too.
    _check_update("ftrl", DTYPES[0])


def test_the_routes_and_the_status_read_one_list_of_16_bit_rules(monkeypatch):
    """Narrowing `optimizer_rules.SIXTEEN_BIT_RULES` alone sends Ftrl's
    16-bit arrays off the backend's compiled route (it declines, writing
    nothing) and `compiled_cpu_helpers` says so, while float32 stays."""
    import keras_sparse as ks

    _library()
    rules = optimizer_rules.SIXTEEN_BIT_RULES - {"ftrl"}
    monkeypatch.setattr(optimizer_rules, "SIXTEEN_BIT_RULES", rules)
    opt = models.optimizer("ftrl")
    rng = np.random.default_rng(4)
    table, slots = models.random_state(opt, rng, 24, 5)
    state = {"table": table.astype(ml_dtypes.bfloat16), **slots}
    ids, valid, grads = models.random_batch(rng, 18, 40, 5)
    first = 0 if keras.backend.backend() == "jax" else 6
    got = _compiled_update(opt, state, ids, valid, grads, 5, first, 18, True, False)
    assert got is None
    wide = {"table": table, **slots}
    assert _compiled_update(opt, wide, ids, valid, grads, 5, first, 18, True)
    text = ks.compiled_cpu_helpers()
    if text.startswith("on"):
        assert "the ops route updates the 16-bit tables of Ftrl" in text
        assert "with SGD, Adagrad, Adam, RowWiseAdagrad;" in text


def _check_update(name, dtype_pair):
    opt = models.optimizer(name)
    table_dtype, slot_dtype = dtype_pair
    dtypes = {"table": table_dtype, **{s.name: slot_dtype for s in opt.slot_specs()}}
    # A JAX table is updated whole (first row 0); the others a row range.
    first = 0 if keras.backend.backend() == "jax" else 6
    for stochastic in (True, False):
        rng = np.random.default_rng(3)
        table, slots = models.random_state(opt, rng, 24, 5)
        wide = {"table": table, **slots}
        state = {k: v.astype(NUMPY.get(dtypes[k], np.float32)) for k, v in wide.items()}
        wide = {k: v.astype(np.float32) for k, v in state.items()}
        ids, valid, grads = models.random_batch(rng, 18, 40, 5)
        got = _compiled_update(opt, state, ids, valid, grads, 5, first, 18, stochastic)
        table = wide.pop("table")
        want = models.numpy_update(name, opt, table, wide, ids, valid, grads, 5, first)
        touched = first + np.array(list(dict.fromkeys(ids[valid].tolist())))
        for key, values in want.items():
            if dtypes[key] != "float32":
                new = values[touched]
                values[touched] = (
                    rounding_models.stochastic_round(new, touched, 5, key, dtypes[key])
                    if stochastic
                    else new.astype(NUMPY[dtypes[key]]).astype(np.float32)
                )
            assert got[key].dtype == NUMPY.get(dtypes[key], np.float32), key
            np.testing.assert_array_equal(got[key].astype(np.float32), values, key)
