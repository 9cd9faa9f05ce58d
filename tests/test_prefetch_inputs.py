"""Where a hash layer's keys sit in a batch: inputs given as a list, a dict or
a nested structure, and one input feeding several hash layers; with and
without `keras_sparse.data.prefetch`, always equal to plain fit."""

import keras
import numpy as np
import pytest

from keras_sparse.data import prefetch
from keras_sparse.layers import DistributedHashEmbedding
from keras_sparse.layers.hash.prepared_inputs import pack_blocks
from keras_sparse.layers.hash.prepared_inputs import take_blocks
from keras_sparse.layers.hash.prepared_inputs import unpack_prepared

N, BATCH = 72, 24


def _state(model):
    out = [np.array(keras.ops.convert_to_numpy(w)) for w in model.weights]
    for layer in model.layers:
        if isinstance(layer, DistributedHashEmbedding):
            keys, rows, _ = layer.table.export()
            order = np.argsort(keys)
            out += [keys[order], rows[order]]
    return out


def _assert_same(want, got):
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(a, b, err_msg=f"state entry {i}")


def _fit(model, data, y, staged, **stage_kw):
    if staged:
        with prefetch((data, y), model, batch_size=BATCH, **stage_kw) as stage:
            model.fit(stage, verbose=0)
    else:
        model.fit(data, y, batch_size=BATCH, shuffle=False, verbose=0)
    return _state(model)


# ------------------------------------------------- one input, two hash layers
def _shared_model():
    keras.utils.set_random_seed(5)
    ids = keras.Input((3,), dtype="int32", name="ids")
    a = DistributedHashEmbedding(
        4, capacity=64, combiner="mean", optimizer="adagrad", table_seed=1,
        name="a",
    )(ids)  # fmt: skip
    b = DistributedHashEmbedding(
        3, capacity=256, combiner="sum", optimizer="sgd", table_seed=7, name="b"
    )(ids)
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
    model = keras.Model(ids, out)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _shared_data():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 200, (N, 3)).astype(np.int32)  # 'a' evicts, 'b' not
    return x, rng.normal(size=(N, 1)).astype(np.float32)


@pytest.mark.parametrize("dedup", [True, False])
def test_one_input_feeding_two_hash_layers_trains_like_plain_fit(dedup):
    x, y = _shared_data()
    want = _fit(_shared_model(), x, y, staged=False)
    model = _shared_model()
    got = _fit(model, x, y, staged=True, dedup=dedup, threads=3)
    _assert_same(want, got)
    assert model.get_layer("a").stats()["evictions"] > 0
    assert model.get_layer("b").stats()["size"] == len(np.unique(x))


@pytest.mark.parametrize("replicas", [1, 4])
def test_each_layer_takes_its_own_blocks_on_every_replica(replicas):
    # Layer 0: codes alone; layer 1: codes and segments; each replica's part
    # of the batch axis holds its samples of every block.
    rng = np.random.default_rng(0)
    codes0, codes1, segments1 = (rng.integers(0, 99, (8, 3)) for _ in range(3))
    packed = pack_blocks([codes0, codes1, segments1], replicas)
    per = 8 // replicas
    for r, part in enumerate(np.split(packed, replicas)):
        mine = slice(r * per, (r + 1) * per)
        want = np.concatenate([codes0[mine], codes1[mine], segments1[mine]])
        np.testing.assert_array_equal(part, want)
    tensor = keras.ops.convert_to_tensor(packed)
    mine0 = take_blocks(tensor, replicas, 0, 1, 3)
    mine1 = take_blocks(tensor, replicas, 1, 2, 3)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(mine0), codes0)
    got1 = [keras.ops.convert_to_numpy(t) for t in unpack_prepared(mine1, replicas)]
    np.testing.assert_array_equal(got1[0], codes1)
    np.testing.assert_array_equal(got1[1], segments1)


def test_an_input_read_by_a_hash_layer_and_another_layer_is_refused():
    ids = keras.Input((3,), dtype="int32", name="ids")
    hashed = DistributedHashEmbedding(
        4, capacity=64, combiner="sum", optimizer="sgd", name="hashed"
    )(ids)
    plain = keras.layers.Flatten()(keras.layers.Embedding(200, 2, name="plain")(ids))
    model = keras.Model(ids, keras.layers.Concatenate()([hashed, plain]))
    model.compile("sgd", "mse")
    x, y = _shared_data()
    with pytest.raises(
        ValueError, match="input 'ids' feeds hash layer 'hashed'.*'plain'"
    ):
        prefetch((x, y), model, batch_size=BATCH)


# ---------------------------------------------- input structures, wide keys
FORMS = {
    # model inputs from the Input `ids`; the data `x` in the same structure
    "list": (lambda ids: [ids], lambda x: x),  # data as a bare array
    "list_of_list": (lambda ids: [ids], lambda x: [x]),
    "dict": (lambda ids: {"ids": ids}, lambda x: {"ids": x}),
    "nested": (lambda ids: {"g": [ids]}, lambda x: {"g": [x]}),
}


def _form_model(form):
    keras.utils.set_random_seed(3)
    ids = keras.Input((3,), dtype="int64", name="ids")
    emb = DistributedHashEmbedding(
        4, capacity=128, combiner="sum", optimizer="adagrad", name="emb"
    )(ids)
    inputs = ids if form is None else FORMS[form][0](ids)
    model = keras.Model(inputs, keras.layers.Dense(1)(emb))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _wide_keys():
    # Keys equal in their low 32 bits must keep separate rows.
    rng = np.random.default_rng(4)
    low = rng.integers(0, 20, (N, 3))
    x = low + np.int64(2**33) * rng.integers(0, 3, (N, 3))
    return x.astype(np.int64), rng.normal(size=(N, 1)).astype(np.float32)


_BARE = {}


def _bare_reference():
    backend = keras.backend.backend()
    if backend not in _BARE:
        x, y = _wide_keys()
        _BARE[backend] = _fit(_form_model(None), x, y, staged=False)
    return _BARE[backend]


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_model_inputs_as_list_dict_or_nested_train_like_a_bare_input(form, staged):
    x, y = _wide_keys()
    model = _form_model(form)
    got = _fit(model, FORMS[form][1](x), y, staged=staged)
    _assert_same(_bare_reference(), got)
    assert model.get_layer("emb").stats()["size"] == len(np.unique(x))
