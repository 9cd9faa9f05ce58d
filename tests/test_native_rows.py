"""The compiled CPU helpers of the PyTorch update (keras_sparse.ops.native_rows):
the dedup and row writes equal to the torch-operations route to the bit,
checked against NumPy, safe on bad ids, and a loader that falls back
cleanly (the compiled optimizers: tests/test_native_optimizers.py)."""

import contextlib
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="the torch backend's own update"
)


def _modules():
    import torch

    from keras_sparse.ops import native_rows
    from keras_sparse.ops.torch import row_updates as torch_row_updates

    return torch, native_rows, torch_row_updates


def _native():
    _, native_rows, _ = _modules()
    lib = native_rows.library()
    if lib is None:
        pytest.skip(f"compiled helpers unavailable: {native_rows.status()}")
    return lib


@contextlib.contextmanager
def _torch_operations_route():
    """As on a machine without a compiler: the update runs as torch ops."""
    _, native_rows, _ = _modules()
    real = native_rows.library
    native_rows.library = lambda: None
    try:
        yield
    finally:
        native_rows.library = real


@contextlib.contextmanager
def _unfused_optimizers():
    """The compiled dedup and writes, the optimizer as torch operations."""
    from keras_sparse.ops import native_optimizers

    native_optimizers.FUSED_OPTIMIZERS = False
    try:
        yield
    finally:
        native_optimizers.FUSED_OPTIMIZERS = True


def _optimizers():
    from keras_sparse import optimizers

    return {
        "sgd": optimizers.SGD(0.3),
        "adagrad": optimizers.Adagrad(0.1),
        "rowwise_adagrad": optimizers.RowWiseAdagrad(0.1),
        "adam": optimizers.Adam(0.01),
        "ftrl": optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
    }


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(0, 300),
    bag=st.sampled_from([1, 2, 5]),
    num_rows=st.integers(1, 40),
    invalid_share=st.sampled_from([0.0, 0.4, 1.0]),
)
def test_distinct_sum_matches_numpy(seed, n, bag, num_rows, invalid_share):
    native = _native()
    rng = np.random.default_rng(seed)
    n = n // bag * bag
    ids = rng.integers(0, num_rows, n).astype("int64")
    valid = rng.random(n) >= invalid_share
    grads = rng.normal(size=(n // bag, 3)).astype("float32")
    count, unique, summed = native.distinct_sum(ids, valid, grads, num_rows, bag=bag)
    unique, summed = unique[:count], summed[:count]
    # Each id once, ordered by its last position.
    last = [int(i) for i in ids[valid][::-1]]
    assert unique.tolist() == list(dict.fromkeys(last))[::-1]
    per_position = np.repeat(grads, bag, axis=0)
    for row, key in zip(summed, unique.tolist()):
        np.testing.assert_allclose(
            row, per_position[valid & (ids == key)].sum(0), rtol=1e-5, atol=1e-6
        )


def test_distinct_sum_reads_a_column_slice_in_place_to_the_same_bits():
    native = _native()
    _, native_rows, _ = _modules()
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 9, 24)
    valid = rng.random(24) >= 0.2
    wide = rng.normal(size=(12, 40)).astype("float32")  # 12 bags of 2 ids
    view = wide[:, 16:32]  # one table's columns of a concatenated gradient
    assert native_rows._rows_view(view) is view  # no copy
    assert native_rows._rows_view(wide[:, ::2]) is not wide  # not rows: copied
    got = native.distinct_sum(ids, valid, view, 9, bag=2)
    want = native.distinct_sum(ids, valid, view.copy(), 9, bag=2)
    assert got[0] == want[0] > 0
    np.testing.assert_array_equal(got[1][: got[0]], want[1][: want[0]])
    np.testing.assert_array_equal(got[2][: got[0]], want[2][: want[0]])
    keys = want[1][: want[0]].tolist()
    per_position = np.repeat(view, 2, axis=0)
    np.testing.assert_allclose(
        want[2][: want[0]],
        [per_position[valid & (ids == k)].sum(0) for k in keys], rtol=1e-5,
    )  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 5000),
    num_rows=st.sampled_from([2**24, 2**31, 2**62]),
    stride=st.sampled_from([1, 2**10, 2**20]),
    repeats=st.sampled_from([1, 3]),
)
def test_distinct_sum_keeps_apart_every_key_of_a_half_full_hash(
    seed, n, num_rows, stride, repeats
):
    # The dedup's hash has 2n to 4n slots: n distinct ids fill up to half
    # of them, with probe chains and wrap-arounds. Ids spaced by a power
    # of two test that the hash spreads what a low-bits hash would not.
    native = _native()
    rng = np.random.default_rng(seed)
    distinct = min(max(1, n // repeats), num_rows // stride)
    keys = rng.choice(num_rows // stride, distinct, replace=False) * stride
    ids = rng.permutation(np.resize(keys, n)).astype("int64")
    grads = rng.normal(size=(n, 2)).astype("float32")
    count, unique, summed = native.distinct_sum(ids, np.ones(n, bool), grads, num_rows)
    sums = {}
    for key, grad in zip(ids.tolist(), grads):
        sums[key] = sums.get(key, np.zeros(2, "float32")) + grad
    last = {key: p for p, key in enumerate(ids.tolist())}
    assert unique[:count].tolist() == sorted(last, key=last.get)
    # Bit for bit: each sum is float32 from 0, in position order.
    np.testing.assert_array_equal(
        summed[:count], [sums[k] for k in unique[:count].tolist()]
    )


def _update(optimizer, seed, n, num_rows, invalid_share, dim=4):
    """The state after one `apply_row_updates` of a random batch."""
    torch, _, updates = _modules()
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(num_rows, dim))
    state = {"table": torch.tensor(table, dtype=torch.float32)}
    for spec in optimizer.slot_specs():
        shape = (num_rows, 1 if spec.row_wise else dim)
        state[spec.name] = spec.initial_value + torch.tensor(
            rng.uniform(0, 1, shape), dtype=torch.float32
        )
    ids = torch.tensor(rng.integers(0, num_rows, n))
    valid = torch.tensor(rng.random(n) >= invalid_share)
    grads = torch.tensor(rng.normal(size=(n, dim)), dtype=torch.float32)
    scratch = torch.randint(-9, 9, (num_rows + 1,), dtype=torch.int32)
    updates.apply_row_updates(
        state, scratch, optimizer, ids, valid, grads, torch.tensor(3), None, None
    )
    return {name: tensor.numpy() for name, tensor in state.items()}


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"])
@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 200),
    num_rows=st.integers(1, 30),
    invalid_share=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_compiled_route_trains_to_the_bit_like_torch_operations(
    name, seed, n, num_rows, invalid_share
):
    _native()
    with _unfused_optimizers():  # their own test: tests/test_native_optimizers.py
        compiled = _update(_optimizers()[name], seed, n, num_rows, invalid_share)
    with _torch_operations_route():
        reference = _update(_optimizers()[name], seed, n, num_rows, invalid_share)
    assert compiled.keys() == reference.keys()
    for key in compiled:
        np.testing.assert_array_equal(compiled[key], reference[key], err_msg=key)


def test_an_id_outside_the_table_raises_and_changes_no_row():
    _native()
    torch, _, updates = _modules()
    from keras_sparse import optimizers

    table = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    state = {"table": table.clone(), "accumulator": torch.ones(4, 3)}
    ids = torch.tensor([1, 2, 4, 0])
    with pytest.raises(IndexError, match=r"id 4 at position 2 .*\[0, 4\)"):
        updates.apply_row_updates(
            state, torch.zeros(5, dtype=torch.int32), optimizers.Adagrad(0.1),
            ids, torch.ones(4, dtype=torch.bool), torch.ones(4, 3),
            torch.tensor(0), None, None,
        )  # fmt: skip
    assert torch.equal(state["table"], table)
    assert torch.equal(state["accumulator"], torch.ones(4, 3))


def test_an_invalid_position_may_hold_any_id():
    native = _native()
    count, unique, summed = native.distinct_sum(
        np.array([-7, 2, 99, 2]), np.array([False, True, False, True]),
        np.ones((4, 2), "float32"), 3,
    )  # fmt: skip
    assert count == 1 and unique[:1].tolist() == [2]
    assert summed[:1].tolist() == [[2.0, 2.0]]


def test_arguments_that_do_not_fit_are_refused_before_the_call():
    native = _native()
    ids, valid = np.array([0, 1, 2]), np.ones(3, bool)
    grads = np.ones((3, 2), "float32")
    with pytest.raises(TypeError, match="dtypes"):
        native.distinct_sum(ids.astype("int32"), valid, grads, 3)
    with pytest.raises(ValueError, match="do not fit"):
        native.distinct_sum(ids, valid, grads, 3, bag=2)
    with pytest.raises(ValueError, match="do not fit"):
        native.distinct_sum(ids, valid[:2], grads, 3)


def test_layers_train_to_the_bit_alike_with_and_without_the_helpers():
    _native()
    import keras_sparse as ks

    def train():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((4,), dtype="int32")
        pooled = ks.AllToAllDenseEmbedding(
            50, 6, combiner="mean", optimizer=ks.optimizers.Adam(0.05)
        )(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
        model.compile(optimizer="sgd", loss="mse")
        rng = np.random.default_rng(0)
        x = rng.integers(0, 50, (64, 4)).astype("int32")
        model.fit(x, rng.normal(size=(64, 1)), batch_size=16, epochs=2, verbose=0)
        return [np.array(v) for v in model.layers[1].variables]

    with _unfused_optimizers():
        compiled = train()
    with _torch_operations_route():
        reference = train()
    for got, want in zip(compiled, reference):
        np.testing.assert_array_equal(got, want)


def test_only_the_torch_route_makes_a_table_sized_scratch():
    _native()
    import keras_sparse as ks

    def trained_layer():
        layer = ks.AllToAllDenseEmbedding(1000, 4, optimizer="adagrad")
        inputs = keras.Input((3,), dtype="int32")
        model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        x = np.random.default_rng(0).integers(0, 1000, (32, 3)).astype("int32")
        model.fit(x, np.ones((32, 1)), batch_size=16, verbose=0)
        return layer

    def scratch_of(layer):
        tables = [v for v in layer.variables if v.path.endswith("embeddings")]
        return getattr(tables[0], "_keras_sparse_dedup_scratch", None)

    # The compiled dedup hashes within the batch: no int32 per table row.
    assert scratch_of(trained_layer()) is None
    with _torch_operations_route():
        assert scratch_of(trained_layer()).shape == (1001,)


def _load_in_subprocess(tmp_path, **env):
    code = (
        "from keras_sparse.ops import native_rows as n;"
        "print(n.library() is not None);print(n.status())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "KERAS_SPARSE_CACHE": str(tmp_path), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip().splitlines()[-2:]


def test_the_loader_builds_once_and_reuses_the_cache(tmp_path):
    _native()
    assert _load_in_subprocess(tmp_path)[0] == "True"
    built = list(tmp_path.glob("cpu_rows-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    loaded, status = _load_in_subprocess(tmp_path)
    assert loaded == "True" and str(built[0]) in status
    assert built[0].stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"KERAS_SPARSE_NATIVE": "0"}, "KERAS_SPARSE_NATIVE=0"),
        ({"CC": "/no/such/compiler"}, "no C compiler"),
        ({"CC": "false"}, "failed"),
    ],
)
def test_the_loader_falls_back_with_a_reason(tmp_path, env, reason):
    loaded, status = _load_in_subprocess(tmp_path, **env)
    assert loaded == "False"
    assert status.startswith("off") and reason in status
    assert not list(tmp_path.glob("*.so"))


def test_big_batches_keep_one_row_order_on_both_routes():
    # Past 32768 ids torch writes from several threads; both routes must
    # still list the rows alike, which a constraint across rows can see.
    torch, _, updates = _modules()
    from keras_sparse import optimizers

    native = _native()
    rng = np.random.default_rng(0)
    n = 200_000
    ids = torch.tensor(rng.zipf(1.3, n).clip(max=300) - 1)
    grads = torch.tensor(rng.normal(size=(n, 4)), dtype=torch.float32)
    valid = torch.ones(n, dtype=torch.bool)
    count, order, _ = native.distinct_sum(
        ids.numpy(), valid.numpy(), grads.numpy(), 301
    )
    unique, _ = updates.distinct_keys(ids, torch.zeros(301, dtype=torch.int32))
    np.testing.assert_array_equal(unique.numpy(), order[:count])
    constraint = keras.constraints.MaxNorm(0.5)  # axis 0: across the rows

    def run():
        state = {"table": torch.ones(300, 4), "accumulator": torch.ones(300, 4)}
        updates.apply_row_updates(
            state, torch.zeros(301, dtype=torch.int32), optimizers.Adagrad(0.3),
            ids, valid, grads, torch.tensor(0), constraint, None,
        )  # fmt: skip
        return state["table"].numpy()

    compiled = run()
    with _torch_operations_route():
        first, second = run(), run()
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(compiled, first)


def test_a_slot_of_the_wrong_shape_raises_on_both_routes_and_corrupts_nothing():
    torch, _, updates = _modules()
    from keras_sparse import optimizers

    _native()

    class NarrowSlot(optimizers.Adagrad):
        def new_slots(self, rows, slots, grads, lr, iterations):
            return {"accumulator": torch.full((grads.shape[0], 1), 7.0)}

    for route in (contextlib.nullcontext, _torch_operations_route):
        state = {"table": torch.zeros(6, 3), "accumulator": torch.ones(6, 3)}
        with route(), pytest.raises(RuntimeError):
            updates.apply_row_updates(
                state, torch.zeros(7, dtype=torch.int32), NarrowSlot(0.1),
                torch.tensor([1, 4]), torch.ones(2, dtype=torch.bool),
                torch.ones(2, 3), torch.tensor(0), None, None,
            )  # fmt: skip
        assert torch.equal(state["accumulator"], torch.ones(6, 3))


@pytest.mark.parametrize("fused", [True, False])
def test_a_graph_that_saved_the_table_sees_the_update(fused):
    torch, _, updates = _modules()
    from keras_sparse import optimizers

    _native()
    route = contextlib.nullcontext() if fused else _unfused_optimizers()
    table = torch.zeros(5, 2, requires_grad=True)
    state = {"table": table.detach(), "accumulator": torch.ones(5, 2)}
    x = torch.ones(3, 2, requires_grad=True)
    y = x @ state["table"].T  # saves the table for x's gradient
    with route:
        updates.apply_row_updates(
            state, torch.zeros(6, dtype=torch.int32), optimizers.Adagrad(0.1),
            torch.tensor([0, 3]), torch.ones(2, dtype=torch.bool), torch.ones(2, 2),
            torch.tensor(0), None, None,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_a_missing_source_or_a_shared_cache_turns_the_helpers_off(
    monkeypatch, tmp_path
):
    _native()
    _, native_rows, _ = _modules()

    def missing(name):
        raise FileNotFoundError(f"{name} not found")

    from keras_sparse import kernel_sources

    with monkeypatch.context() as patch:
        patch.setattr(kernel_sources, "kernel_source", missing)
        lib, status = native_rows._LIBRARY.build()
    assert lib is None and "cpu_rows.c not found" in status
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("KERAS_SPARSE_CACHE", str(shared))
    lib, status = native_rows._LIBRARY.build()
    assert lib is None and "not private" in status
    assert not list(shared.iterdir())
