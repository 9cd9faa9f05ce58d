"""PyTorch's fused bag route (``embedding_bag`` forward, per-bag gradients in
the sparse update) against the per-position route it replaces."""

import keras
import numpy as np
import pytest

import keras_sparse as ks

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="the torch backend's own route"
)


def _train(combiner, constraint=None, mask_zero=False, optimizer="adagrad"):
    keras.utils.set_random_seed(11)
    inputs = keras.Input((5,), dtype="int32")
    layer = ks.AllToAllDenseEmbedding(
        40, 6, combiner=combiner, mask_zero=mask_zero,
        embeddings_constraint=constraint,
        optimizer=ks.optimizers.get(optimizer),
    )  # fmt: skip
    model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 40, (96, 5)).astype("int32")
    x[:, 0] = rng.integers(0, 3, 96)  # hot ids, duplicated across bags
    model.fit(x, rng.normal(size=(96, 1)), batch_size=32, epochs=3, verbose=0)
    return [np.array(v) for v in layer.variables], model.predict(x, verbose=0)


def _calls(monkeypatch, fused):
    from keras_sparse.ops.torch import lookup as torch_lookup

    calls = []
    real = torch_lookup.bag_sums_with_sparse_update

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_lookup, "bag_sums_with_sparse_update", counted)
    if not fused:
        monkeypatch.setattr(torch_lookup, "bag_sums_apply", lambda *a: False)
    return calls


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_bag_route_trains_like_the_per_position_route(monkeypatch, combiner, optimizer):
    constraint = keras.constraints.MaxNorm(0.5) if combiner == "sum" else None
    with monkeypatch.context() as patch:
        calls = _calls(patch, fused=True)
        fused, fused_out = _train(combiner, constraint, optimizer=optimizer)
    assert len(calls) == 9  # 3 epochs x 3 batches, then predict (no update)
    with monkeypatch.context() as patch:
        calls = _calls(patch, fused=False)
        reference, reference_out = _train(combiner, constraint, optimizer=optimizer)
    assert not calls
    # embedding_bag may sum a bag in another order than torch.sum: the
    # routes agree to float32 rounding, not to the bit.
    for got, want in zip(fused, reference):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(fused_out, reference_out, rtol=2e-5, atol=2e-6)


def test_bags_with_padding_keep_the_per_position_route(monkeypatch):
    calls = _calls(monkeypatch, fused=True)
    _train("mean", mask_zero=True)  # id 0 is padding: not every id is valid
    assert not calls


def _train_collection():
    keras.utils.set_random_seed(5)
    tables = {
        "a": ks.TableConfig(30, 4, combiner="sum"),
        "b": ks.TableConfig(20, 4, combiner="mean"),  # a's stack, other bag size
        "c": ks.TableConfig(25, 6, combiner="sqrtn"),  # a stack of its own
    }
    bags = {"a": 2, "b": 3, "c": 3}
    inputs = {n: keras.Input((bags[n],), dtype="int32", name=n) for n in tables}
    collection = ks.EmbeddingCollection(tables, optimizer=ks.optimizers.Adagrad(0.2))
    outputs = collection(inputs)
    joined = keras.layers.Concatenate()([outputs[n] for n in tables])
    model = keras.Model(inputs, keras.layers.Dense(1)(joined))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(2)
    x = {
        n: rng.integers(0, t.input_dim, (64, bags[n])).astype("int32")
        for n, t in tables.items()
    }
    model.fit(x, rng.normal(size=(64, 1)), batch_size=16, epochs=2, verbose=0)
    return [np.array(v) for v in collection.variables]


def test_collection_bag_route_trains_like_the_per_position_route(monkeypatch):
    with monkeypatch.context() as patch:
        calls = _calls(patch, fused=True)
        fused = _train_collection()
    assert len(calls) == 16  # 2 stacks x 2 epochs x 4 batches
    with monkeypatch.context() as patch:
        calls = _calls(patch, fused=False)
        reference = _train_collection()
    assert not calls
    for got, want in zip(fused, reference):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def _train_variant(kind):
    """A model that must keep the per-position route: ``kind`` is
    "weights" (per-id weights), "regularizer" (a row regularizer) or
    "rank3" (``[batch, 2, bag]`` ids)."""
    keras.utils.set_random_seed(3)
    shape = (2, 4) if kind == "rank3" else (4,)
    ids_in = keras.Input(shape, dtype="int32")
    layer = ks.AllToAllDenseEmbedding(
        30, 5, combiner="sum", optimizer="adagrad",
        embeddings_regularizer="l2" if kind == "regularizer" else None,
    )  # fmt: skip
    rng = np.random.default_rng(2)
    x = rng.integers(0, 30, (64, *shape)).astype("int32")
    if kind == "weights":
        w_in = keras.Input(shape, dtype="float32")
        out = layer(ids_in, weights=w_in)
        inputs, data = [ids_in, w_in], [x, rng.random((64, *shape)).astype("float32")]
    else:
        out = layer(ids_in)
        inputs, data = ids_in, x
    out = keras.layers.Flatten()(out)
    model = keras.Model(inputs, keras.layers.Dense(1)(out))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(data, rng.normal(size=(64, 1)), batch_size=32, epochs=2, verbose=0)
    return [np.array(v) for v in layer.variables]


@pytest.mark.parametrize("kind", ["weights", "regularizer", "rank3"])
def test_weights_regularizers_and_rank3_ids_keep_the_per_position_route(
    monkeypatch, kind
):
    """The bag route fuses plain bags only: with per-id weights, a row
    regularizer or rank-3 ids the layer never takes it, and trains exactly as
    with the route switched off."""
    with monkeypatch.context() as patch:
        calls = _calls(patch, fused=True)
        got = _train_variant(kind)
    assert not calls
    with monkeypatch.context() as patch:
        _calls(patch, fused=False)
        want = _train_variant(kind)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
