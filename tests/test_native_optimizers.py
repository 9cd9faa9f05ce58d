"""The compiled SGD, Adagrad, Adam and RowWiseAdagrad row updates of the
PyTorch CPU route (keras_sparse.ops.native_optimizers): equal to a NumPy
float32 model of each optimizer to the bit, within an ulp of the torch route
(whose vectorized sqrt may round differently; RowWiseAdagrad's mean may sum
in another order), and only where they apply."""

import os

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tests import optimizer_models as models
from tests.optimizer_models import F

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="the torch backend's own update"
)


def _modules():
    import torch

    from keras_sparse.ops import native_optimizers
    from keras_sparse.ops import native_rows
    from keras_sparse.ops.torch import row_updates as torch_row_updates

    if native_rows.library() is None:
        pytest.skip(f"compiled helpers unavailable: {native_rows.status()}")
    return torch, native_optimizers, torch_row_updates


def _fused(on):
    _, native_optimizers, _ = _modules()
    return models.switch(native_optimizers, "FUSED_OPTIMIZERS", on)


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


@pytest.mark.parametrize("name", models.NAMES)
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
    optimizer = models.optimizer(name)
    rng = np.random.default_rng(seed)
    table, slots = models.random_state(optimizer, rng, num_rows, dim)
    ids = rng.integers(0, num_rows, n)
    valid = rng.random(n) >= 0.2
    grads = rng.normal(size=(n, dim)).astype(F)
    _, native_optimizers, _ = _modules()
    real, passes = native_optimizers.fused_update, []
    native_optimizers.fused_update = lambda *a: passes.append(real(*a)) or passes[-1]
    try:
        fused = _apply(optimizer, table, slots, ids, valid, grads, iterations)
    finally:
        native_optimizers.fused_update = real
    assert passes == ([True] if valid.any() else []), passes
    want = models.numpy_update(
        name, optimizer, table, slots, ids, valid, grads, iterations
    )
    with _fused(False):
        torch_route = _apply(optimizer, table, slots, ids, valid, grads, iterations)
    assert fused.keys() == want.keys() == torch_route.keys()
    for key in want:
        np.testing.assert_array_equal(fused[key], want[key], err_msg=key)
        np.testing.assert_allclose(
            fused[key], torch_route[key], 2e-6, models.route_atol(name), err_msg=key
        )


@pytest.mark.parametrize("name", ["rowwise_adagrad", "ftrl_power"])
def test_several_steps_with_duplicates(name, monkeypatch):
    calls = _spy_on_fused(monkeypatch)
    models.check_several_steps(_apply, name)
    assert calls == [True] * 4  # each step took the compiled pass


def _spy_on_fused(monkeypatch):
    """Records, per update, whether it took the compiled optimizer pass
    (`fused_update`, or a bag route's sweep of compiled calls)."""
    _, native_optimizers, _ = _modules()
    from keras_sparse.ops.torch import bag_updates

    used = models.record_use(monkeypatch, native_optimizers, "fused_update")
    real = bag_updates.prepare

    def prepare(*args):
        update = real(*args)
        if update is not None:  # else fused_update records the update
            used.append(True)
        return update

    monkeypatch.setattr(bag_updates, "prepare", prepare)
    return used


def test_subclasses_constraints_and_other_optimizers_take_the_torch_route(
    monkeypatch,
):
    cases, (ids, valid, grads) = models.route_cases()
    grads = grads * 5
    rng = np.random.default_rng(0)
    for optimizer, constraint, expect_fused in cases:
        calls = _spy_on_fused(monkeypatch)
        table, slots = models.random_state(optimizer, rng, 4, 4)
        got = _apply(optimizer, table, slots, ids, valid, grads, 0, constraint)
        assert calls == [expect_fused], optimizer
        with _fused(False):
            want = _apply(optimizer, table, slots, ids, valid, grads, 0, constraint)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-6, atol=1e-7)
    # The clip reached the accumulator: the subclass's own update ran.
    clipped = cases[1][0]
    table, slots = models.random_state(clipped, rng, 4, 4)
    got = _apply(clipped, table, slots, ids, valid, grads, 0)
    assert got["accumulator"][0].max() <= slots["accumulator"][0].max() + 1


@pytest.mark.parametrize("form", ["layers", "collection"])
def test_models_train_alike_on_both_routes(form, monkeypatch):
    for name in models.TRAINED:
        calls = _spy_on_fused(monkeypatch)
        fused = models.train(form, name)
        assert calls and all(calls), name  # every update took the compiled pass
        with _fused(False):
            reference = models.train(form, name)
        for got, want in zip(fused, reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_stacks_tables_update_side_by_side_to_the_same_bits(monkeypatch):
    torch, _, _ = _modules()
    from keras_sparse.ops.torch import lookup as torch_lookup

    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: the tables update one after another")
    ran = []
    real = torch_lookup._pool
    monkeypatch.setattr(torch_lookup, "_pool", lambda n: ran.append(1) or real(n))
    side_by_side = models.train("collection", "adagrad")
    assert ran  # the pool ran the tables
    monkeypatch.setattr(torch_lookup, "PARALLEL_TABLES", False)
    ran.clear()
    one_by_one = models.train("collection", "adagrad")
    assert not ran
    for got, want in zip(side_by_side, one_by_one):
        np.testing.assert_array_equal(got, want)
    # A forked child gets pools of its own (the inherited ones have no
    # threads and would never run its work).
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os._exit(0 if torch_lookup._pool(2).submit(int, 7).result(30) == 7 else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_only_compiled_in_range_updates_run_side_by_side():
    torch, _, _ = _modules()
    from keras_sparse import optimizers
    from keras_sparse.ops.torch import lookup as torch_lookup

    def job(ids, valid, optimizer=None, constraint=None):
        context = {
            "state": {"table": torch.zeros(10, 2), "accumulator": torch.zeros(10, 2)},
            "optimizer": optimizer or optimizers.Adagrad(0.1),
            "constraint": constraint,
        }
        ids, valid = torch.tensor(ids), torch.tensor(valid)
        return (context, 4, 8, ids, valid, torch.ones(len(ids), 2), None, 1)

    assert torch_lookup._all_compiled(job([0, 3], [True, True]))
    # An invalid position may hold any id; a valid one outside rows [4, 8)
    # of the stack sends every table down the serial route, which raises
    # at that table as before.
    assert torch_lookup._all_compiled(job([0, 9], [True, False]))
    assert not torch_lookup._all_compiled(job([0, 4], [True, True]))
    assert not torch_lookup._all_compiled(job([-1, 2], [True, True]))
    subclass = type("MyAdagrad", (optimizers.Adagrad,), {})(0.1)  # may differ
    assert not torch_lookup._all_compiled(job([0], [True], subclass))
    max_norm = keras.constraints.MaxNorm(1.0)
    assert not torch_lookup._all_compiled(job([0], [True], constraint=max_norm))


def test_the_helpers_list_every_compiled_optimizer():
    import keras_sparse as ks

    _modules()  # skips where the compiled code cannot be built
    text = ks.compiled_cpu_helpers()
    assert text.startswith("on: ")
    assert "; optimizers: SGD, Adagrad, Adam, RowWiseAdagrad, Ftrl; " in text
