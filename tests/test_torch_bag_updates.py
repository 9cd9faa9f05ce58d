"""PyTorch: the bag route's sweep of compiled calls (`ops.torch.bag_updates`)
against the table-by-table compiled route it replaces, to the bit."""

import keras
import numpy as np
import pytest

import keras_sparse as ks

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="the torch backend's own route"
)

OPTIMIZERS = {
    "sgd": lambda: ks.optimizers.SGD(0.3),
    "adagrad": lambda: ks.optimizers.Adagrad(0.3),
    "rowwise_adagrad": lambda: ks.optimizers.RowWiseAdagrad(0.3),
    "adam": lambda: ks.optimizers.Adam(0.05),
    "ftrl": lambda: ks.optimizers.Ftrl(0.3, l1_regularization_strength=0.01),
}


def _train(make_optimizer, collection):
    keras.utils.set_random_seed(7)
    bags = {"a": 2, "b": 3, "c": 1}
    rows = {"a": 30, "b": 20, "c": 25}
    inputs = {n: keras.Input((b,), dtype="int32", name=n) for n, b in bags.items()}
    if collection:  # one stack: a, b, c at their offsets
        layer = ks.EmbeddingCollection(
            {n: ks.TableConfig(rows[n], 4, combiner="sum") for n in bags},
            optimizer=make_optimizer(),
        )
        out = layer(inputs)
        parts, layers = [out[n] for n in bags], [layer]
    else:
        layers = [
            ks.AllToAllDenseEmbedding(
                rows[n], 4, combiner="mean", optimizer=make_optimizer()
            )
            for n in bags
        ]
        parts = [lay(inputs[n]) for lay, n in zip(layers, bags)]
    joined = keras.layers.Concatenate()(parts)
    model = keras.Model(inputs, keras.layers.Dense(1)(joined))
    model.compile(optimizer="sgd", loss="mse")
    first = (
        (lambda: layers[0].get_table("a"))
        if collection
        else (lambda: np.array(layers[0].embeddings))
    )
    initial = first()
    rng = np.random.default_rng(3)
    x = {n: rng.integers(0, rows[n], (48, b)).astype("int32") for n, b in bags.items()}
    x["a"][:, 0] = rng.integers(0, 2, 48)  # hot ids, repeated within and across bags
    model.fit(x, rng.normal(size=(48, 1)), batch_size=16, epochs=2, verbose=0)
    return [np.array(v) for lay in layers for v in lay.variables], (initial, first())


def _route(monkeypatch, sweep):
    """Counts the backward passes the sweep serves; ``sweep=False`` sends
    them down the table-by-table route."""
    from keras_sparse.ops.torch import bag_updates

    served = []
    real = bag_updates.prepare

    def prepare(*args):
        update = real(*args) if sweep else None
        served.append(update is not None)
        return update

    monkeypatch.setattr(bag_updates, "prepare", prepare)
    return served


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize(
    "collection, threads",
    [(True, 1), (True, 2), (False, 1)],  # 2: a stack's tables side by side
    ids=["collection", "collection-2-threads", "layers"],
)
def test_sweep_trains_to_the_bit_like_table_by_table(
    monkeypatch, name, collection, threads
):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with monkeypatch.context() as patch:
            served = _route(patch, sweep=True)
            got, (initial, trained) = _train(OPTIMIZERS[name], collection)
        with monkeypatch.context() as patch:
            _route(patch, sweep=False)
            want, _ = _train(OPTIMIZERS[name], collection)
    finally:
        torch.set_num_threads(before)
    # 2 epochs x 3 batches, one backward pass per stack or per layer
    assert served == [True] * (6 if collection else 18)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(trained, initial)  # it trained


def test_update_tables_matches_a_numpy_model_and_refuses_an_id_outside_its_table():
    from keras_sparse.ops import native_rows

    native = native_rows.library()
    if native is None:
        pytest.skip(native_rows.status())
    table = np.arange(20, dtype=np.float32).reshape(10, 2)
    want = table.copy()
    grads = np.array([[1, 2], [3, 4]], np.float32)
    ids = np.array([1, 3, 1, 1], np.int64)  # bags of 2, relative to row 4
    native.update_tables("sgd", [table], [(ids, 4, 8, grads, 2)], [0.5])
    want[5] -= 0.5 * (grads[0] + grads[1] + grads[1])
    want[7] -= 0.5 * grads[0]
    np.testing.assert_array_equal(table, want)
    bad = np.array([1, 4], np.int64)  # 4: past the table's 4 rows
    with pytest.raises(IndexError, match=r"id 4 at position 1 .*rows \[0, 4\)"):
        native.update_tables("sgd", [table], [(bad, 4, 8, grads, 1)], [0.5])
    np.testing.assert_array_equal(table, want)  # nothing written
    with pytest.raises(ValueError, match="do not fit"):
        native.update_tables("sgd", [table], [(ids, 4, 8, grads, 1)], [0.5])
