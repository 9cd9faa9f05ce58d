"""Models and data of the tests of tables with ``cache_rows`` on several
devices or processes (`test_sharded_dense_cache.py`,
`test_tf_mirrored_cache.py`, `test_torch_ddp_cache.py`): a 300-id table
"a" (cached or not) beside a 50-id table "b", and a one-unit head named
"out", so that a cached table can be compared with the same table wholly
on the devices."""

import keras
import numpy as np

VOCAB, DIM = 300, 4


def data(batch, steps, seed=0):
    """``(x, y)``: ``batch * steps`` samples of "a" (2 ids) and "b"."""
    rng = np.random.default_rng(seed)
    x = {
        "a": rng.integers(0, VOCAB, size=(batch * steps, 2)).astype("int32"),
        "b": rng.integers(0, 50, size=(batch * steps, 1)).astype("int32"),
    }
    return x, rng.normal(size=(batch * steps, 1)).astype("float32")


def sparse_optimizer(name):
    import keras_sparse as ks

    return {"sgd": ks.optimizers.SGD(0.3), "adagrad": ks.optimizers.Adagrad(0.1)}[name]


def build(kind, optimizer, cache):
    """``(model, layer)``, not compiled: an `AllToAllDenseEmbedding` "ids"
    of "a" (``kind="dense"``) or an `EmbeddingCollection` "f" of "a" and
    "b" (``kind="collection"``); ``cache``: "a"'s ``cache_rows``/``store``
    arguments (empty: no cache)."""
    import keras_sparse as ks

    if kind == "dense":
        inputs = keras.Input((2,), dtype="int32")
        layer = ks.AllToAllDenseEmbedding(
            VOCAB, DIM, combiner="sum", optimizer=sparse_optimizer(optimizer),
            name="ids", **cache,
        )  # fmt: skip
        out = layer(inputs)
    else:
        configs = {
            "a": ks.TableConfig(VOCAB, DIM, combiner="sum", **cache),
            "b": ks.TableConfig(50, DIM, combiner="sum"),
        }
        layer = ks.EmbeddingCollection(
            configs, optimizer=sparse_optimizer(optimizer), name="f"
        )
        inputs = {"a": keras.Input((2,), dtype="int32", name="a")}
        inputs["b"] = keras.Input((1,), dtype="int32", name="b")
        out = keras.layers.Concatenate()([v for _, v in sorted(layer(inputs).items())])
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(out)), layer


def start_from(model, layer, kind, start):
    """Sets table "a" and the head to ``start`` (None: reads them), and
    returns it: the cached and uncached models start alike."""
    if start is None:
        table = layer.get_weights()[0] if kind == "dense" else layer.get_table("a")
        start = (table, model.get_layer("out").get_weights())
    elif kind == "dense":
        layer.embeddings.assign(start[0])
    else:
        layer.set_table("a", start[0])
    model.get_layer("out").set_weights(start[1])
    return start


def state(kind, layer):
    """``{entry: array}``: the whole tables (rows and slots) of ``layer``,
    a cached table's rows flushed down to its store first."""
    if kind == "collection":
        saved = {}
        layer.save_own_variables(saved)
        return {k: np.asarray(v) for k, v in saved.items()}
    if layer.row_cache is not None:
        layer.flush_store()
        *tables, steps = layer.get_weights()
    else:
        variables = [layer.embeddings, *layer.slots.values()]
        tables = [keras.ops.convert_to_numpy(v) for v in variables]
        steps = keras.ops.convert_to_numpy(layer.sparse_iterations)
    return {**{str(i): t for i, t in enumerate(tables)}, "steps": np.asarray(steps)}


def entries(result, prefix):
    """The names of the ``{prefix}got/<name>`` entries of one process's
    ``result``, checked to be those of its ``{prefix}want/<name>`` ones."""
    got = {k[len(prefix) + 4 :] for k in result if k.startswith(prefix + "got/")}
    want = {k[len(prefix) + 5 :] for k in result if k.startswith(prefix + "want/")}
    assert got == want, (got, want)
    return sorted(want)


def assert_copies_identical(ranks, ends=(":head",)):
    """Every process's trained tables (``:got/`` entries) and the entries
    ending in ``ends`` equal the first process's, bit for bit."""
    first, *others = ranks
    keys = [k for k in first if ":got/" in k or k.endswith(tuple(ends))]
    assert len(keys) >= 8
    for other in others:
        for key in keys:
            np.testing.assert_array_equal(first[key], other[key], err_msg=key)


def assert_copies_refused(result, differ, where):
    """``result[differ]`` (copies that differ) and ``result["shared"]`` (a
    disk folder two processes share): each the error of table "ids" under
    ``where`` (e.g. "torch.distributed with 2 processes"), raised before
    the cache changed (``[size=0]``). Returns the first message."""
    differ, shared = str(result[differ]), str(result["shared"])
    for message in (differ, shared):
        assert "Layer 'ids'" in message and "`cache_rows`" in message, message
        assert where in message, message
        assert message.endswith("[size=0]"), message
    assert "copies differ" in differ, differ
    assert "folder of its own" in shared and "rank" in shared, shared
    return differ
