"""keras_sparse.data.prefetch: exactness, sources, errors, shutdown, leaks."""

import threading
import time

import keras
import numpy as np
import pytest

from keras_sparse.data import prefetch
from keras_sparse.data.prefetch import PrefetchError
from keras_sparse.layers import DistributedHashEmbedding
from keras_sparse.ops import dense_row_updates

N, BATCH = 192, 24


def _model(capacity=64, admit_after=1, eviction="lru", init="uniform"):
    keras.utils.set_random_seed(7)
    a = keras.Input((3,), dtype="int32", name="a")
    wa = keras.Input((3,), name="wa")
    b = keras.Input((), dtype="int32", name="b")
    d = keras.Input((2,), name="d")
    ea = DistributedHashEmbedding(
        4, capacity=capacity, combiner="mean", optimizer="adagrad",
        admit_after=admit_after, eviction=eviction, embeddings_initializer=init,
        name="ea",
    )(a, weights=wa)  # fmt: skip
    eb = DistributedHashEmbedding(
        4, capacity=capacity, optimizer="sgd", embeddings_initializer=init,
        name="eb",
    )(b)  # fmt: skip
    h = keras.layers.Concatenate()([ea, eb, d])
    out = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(h))
    model = keras.Model({"a": a, "wa": wa, "b": b, "d": d}, out)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _data(n=N, seed=0, vocab=300):
    rng = np.random.default_rng(seed)
    x = {
        "a": rng.integers(0, vocab, (n, 3)).astype(np.int32),
        "wa": (rng.random((n, 3)) > 0.2).astype(np.float32),  # 0 = padding
        "b": rng.integers(0, vocab, (n,)).astype(np.int32),
        "d": rng.normal(size=(n, 2)).astype(np.float32),
    }
    y = rng.normal(size=(n, 1)).astype(np.float32)
    return x, y


def _state(model):
    out = {}
    for i, w in enumerate(model.weights):  # by position: layer names differ
        out[f"{i}:{w.name}"] = np.array(keras.ops.convert_to_numpy(w))
    for layer in model.layers:
        if isinstance(layer, DistributedHashEmbedding):
            keys, rows, _ = layer.table.export()
            order = np.argsort(keys)
            out[layer.name + "/table"] = (keys[order], rows[order])
    return out


def _assert_same(s1, s2):
    assert s1.keys() == s2.keys()
    for k in s1:
        if isinstance(s1[k], tuple):
            for a, b in zip(s1[k], s2[k]):
                np.testing.assert_array_equal(a, b, err_msg=k)
        else:
            np.testing.assert_array_equal(s1[k], s2[k], err_msg=k)


def _worker_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ks-prefetch")]


def _wait_no_workers(timeout=20.0):
    end = time.time() + timeout
    while _worker_threads() and time.time() < end:
        time.sleep(0.05)
    return _worker_threads()


_REFERENCES = {}


def _route():
    """JAX's update route (the compiled call or XLA's: `xla_route`), whose
    float rounding differs: a reference is kept per route."""
    if keras.backend.backend() != "jax":
        return None
    from keras_sparse.ops.jax import native_rows as jax_native_rows

    return jax_native_rows.FUSED_OPTIMIZERS, jax_native_rows.PREFETCH_GATHER


def _reference(epochs=2, **kw):
    key = (epochs, tuple(sorted(kw.items())), keras.backend.backend(), _route())
    if key not in _REFERENCES:
        _REFERENCES[key] = _train_reference(epochs, **kw)
    return _REFERENCES[key]


def _train_reference(epochs, **kw):
    x, y = _data()
    model = _model(**kw)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return _state(model)


@pytest.mark.parametrize("threads,capacity", [(1, 1), (4, 2)])
def test_fit_bit_identical_under_eviction(threads, capacity):
    # 300 + 300 keys through 64-row tables: constant eviction and reuse.
    ref = _reference(capacity=64)
    x, y = _data()
    model = _model(capacity=64)
    with prefetch(
        (x, y), model, batch_size=BATCH, threads=threads, capacity=capacity
    ) as stage:
        model.fit(stage, epochs=2, verbose=0)
        stats = stage.stats()
    assert stats["batches"] == 2 * (N // BATCH)
    assert model.get_layer("ea").stats()["evictions"] > 0
    _assert_same(ref, _state(model))
    assert not _wait_no_workers()


@pytest.mark.usefixtures("xla_route")  # the compiled call dedups by itself
def test_step_uses_the_stage_segments_and_works_without_them(monkeypatch):
    import sys

    prefetch_module = sys.modules["keras_sparse.data.prefetch_engine"]
    # The segments serve the sparse route; a step with as many ids as rows
    # would update the whole table without them (`dense_row_updates`).
    monkeypatch.setattr(dense_row_updates, "FORCE_DENSE_ROUTE", False)
    ref = _reference(capacity=64)
    x, y = _data()
    model = _model(capacity=64)
    with prefetch((x, y), model, batch_size=BATCH, dedup=False) as stage:
        model.fit(stage, epochs=2, verbose=0)
    _assert_same(ref, _state(model))  # codes alone: the step sorts
    # Wrong segments (every position in one) must change the training: the
    # step takes the stage's segments instead of sorting.
    monkeypatch.setattr(
        prefetch_module,
        "host_segments",
        lambda codes, scratch=None, rows=None: np.zeros(np.shape(codes), np.int32),
    )
    model = _model(capacity=64)
    with prefetch((x, y), model, batch_size=BATCH) as stage:
        model.fit(stage, epochs=2, verbose=0)
    changed = _state(model)
    assert any(
        not np.array_equal(ref[k], changed[k])
        for k in ref
        if not isinstance(ref[k], tuple)
    )


def test_stages_with_different_layouts_cannot_share_a_layer():
    x, y = _data()
    model = _model()
    with prefetch((x, y), model, batch_size=BATCH):
        with pytest.raises(ValueError, match="laid out differently"):
            prefetch((x, y), model, batch_size=BATCH, dedup=False, training=False)
        assert model.get_layer("ea").prepared_form is not None  # untouched
        with prefetch((x, y), model, batch_size=BATCH, training=False) as val:
            assert val.stats()["batches"] == 0
    assert model.get_layer("ea").prepared_form is None


def _wide_model(fields=5, capacity=32):
    """``fields`` single-key hash layers (own tables) + dense features."""
    keras.utils.set_random_seed(11)
    inputs, parts = {}, []
    for f in range(fields):
        k = keras.Input((), dtype="int32", name=f"k{f}")
        inputs[f"k{f}"] = k
        parts.append(
            DistributedHashEmbedding(
                3, capacity=capacity, optimizer="adagrad", name=f"e{f}"
            )(k)
        )
    d = keras.Input((2,), name="d")
    inputs["d"] = d
    h = keras.layers.Concatenate()(parts + [d])
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _wide_data(fields=5, n=N, seed=3):
    rng = np.random.default_rng(seed)
    # Vocabularies of 100 to 1600 keys through 64-row tables: every layer
    # evicts (and reuses rows) at its own rate.
    x = {
        f"k{f}": rng.integers(0, 100 << f, (n,)).astype(np.int32) for f in range(fields)
    }
    x["d"] = rng.normal(size=(n, 2)).astype(np.float32)
    return x, rng.normal(size=(n, 1)).astype(np.float32)


@pytest.mark.parametrize("threads,capacity", [(1, 1), (3, 3), (8, 6)])
def test_per_layer_ordering_many_threads_identical(threads, capacity):
    """Layers' table calls overlap across threads and batches, each table's
    calls stay in batch order: same weights and tables as the raw path."""
    x, y = _wide_data()
    ref_model = _wide_model()
    ref_model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    ref = _state(ref_model)
    model = _wide_model()
    with prefetch(
        (x, y), model, batch_size=BATCH, threads=threads, capacity=capacity
    ) as stage:
        model.fit(stage, epochs=2, verbose=0)
    for f in range(5):
        assert model.get_layer(f"e{f}").stats()["evictions"] > 0
    _assert_same(ref, _state(model))
    assert not _wait_no_workers()


def test_table_calls_run_per_layer_in_batch_order_and_overlap():
    """Each layer sees its batches in order; different layers run at once."""
    x, y = _wide_data(fields=4)
    model = _wide_model(fields=4)
    calls, lock = [], threading.Lock()

    def spy(layer):
        inner = layer.map_host_keys

        def wrapped(keys, use, insert, **kw):
            t0 = time.perf_counter()
            time.sleep(0.01)  # long enough for another thread to start
            out = inner(keys, use, insert, **kw)
            with lock:
                calls.append((layer.name, np.array(keys).reshape(-1), t0,
                              time.perf_counter()))  # fmt: skip
            return out

        layer.map_host_keys = wrapped

    for f in range(4):
        spy(model.get_layer(f"e{f}"))
    with prefetch((x, y), model, batch_size=BATCH, threads=4, capacity=4) as s:
        s.on_epoch_begin()
        for _ in range(len(s)):
            s[0]
        s.on_epoch_end()
    for f in range(4):
        mine = [c for c in calls if c[0] == f"e{f}"]
        assert len(mine) == N // BATCH
        for i, c in enumerate(sorted(mine, key=lambda c: c[2])):
            np.testing.assert_array_equal(c[1], x[f"k{f}"][i * BATCH : (i + 1) * BATCH])
    overlap = any(
        a[0] != b[0] and a[2] < b[3] and b[2] < a[3]
        for i, a in enumerate(calls)
        for b in calls[i + 1 :]
    )
    assert overlap, "no two layers' table calls ever ran at the same time"


def test_layers_sharing_a_table_keep_one_call_order():
    """Two layers given one table object take turns on it in feed order."""
    x, y = _wide_data(fields=3)

    def shared():
        model = _wide_model(fields=3)
        model.get_layer("e1").table = model.get_layer("e0").table
        return model

    ref_model = shared()
    ref_model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model = shared()
    first = model.get_layer("e0")
    inner = first.map_host_keys

    def slow(*args, **kw):  # would let e1 overtake e0 if their turns were separate
        time.sleep(0.005)
        return inner(*args, **kw)

    first.map_host_keys = slow
    with prefetch((x, y), model, batch_size=BATCH, threads=4) as stage:
        model.fit(stage, epochs=1, verbose=0)
    _assert_same(_state(ref_model), _state(model))


def test_fit_identical_with_admission_and_lfu():
    ref = _reference(capacity=128, admit_after=2, eviction="lfu")
    x, y = _data()
    model = _model(capacity=128, admit_after=2, eviction="lfu")
    with prefetch((x, y), model, batch_size=BATCH, threads=3) as stage:
        model.fit(stage, epochs=2, verbose=0)
    _assert_same(ref, _state(model))


def _zipf_model():
    keras.utils.set_random_seed(1)
    ids = keras.Input((4,), dtype="int32")
    emb = DistributedHashEmbedding(
        8, capacity=256, combiner="mean", optimizer="adagrad", name="zipf"
    )(ids)
    model = keras.Model(ids, keras.layers.Dense(1)(emb))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _zipf_data(n=256):
    # Skewed ids: every batch repeats new keys at many positions.
    rng = np.random.default_rng(0)
    x = (rng.zipf(1.3, (n, 4)) % 1000).astype(np.int32)
    return x, rng.normal(size=(n, 1)).astype(np.float32)


def test_a_new_row_is_flagged_fresh_once_per_batch():
    """Duplicates of a new key share its row and reset it from one position:
    several drawn vectors scattered onto one row leave it to the scatter's
    unspecified order (PyTorch's varies from run to run)."""
    x, y = _zipf_data()
    model = _zipf_model()
    with prefetch((x, y), model, batch_size=128, dedup=False) as stage:
        stage.on_epoch_begin()
        codes = np.asarray(keras.ops.convert_to_numpy(stage[0][0])).reshape(-1)
        stage.on_epoch_end()
    fresh_rows = -2 - codes[codes <= -2]
    keys = x[:128].reshape(-1)
    assert len(fresh_rows) == len(np.unique(keys))  # an empty table before
    assert len(np.unique(fresh_rows)) == len(fresh_rows)
    assert len(fresh_rows) < len(keys)  # the batch does repeat new keys
    first = np.sort(np.unique(keys, return_index=True)[1])
    np.testing.assert_array_equal(np.flatnonzero(codes <= -2), first)


def test_staged_fit_is_reproducible_run_after_run():
    """The same staged fit, repeated, equals plain fit every time (PyTorch:
    20 runs per thread count; its scatter order varies under load)."""
    x, y = _zipf_data()
    ref = _zipf_model()
    ref.fit(x, y, batch_size=128, shuffle=False, verbose=0)
    want = _state(ref)
    runs = 20 if keras.backend.backend() == "torch" else 1
    for threads in (1, 4):
        for _ in range(runs):
            model = _zipf_model()
            with prefetch((x, y), model, batch_size=128, threads=threads) as stage:
                model.fit(stage, verbose=0)
            _assert_same(want, _state(model))


def test_raw_path_restored_and_inference_stage_matches():
    x, y = _data()
    model = _model(capacity=128)
    with prefetch((x, y), model, batch_size=BATCH) as stage:
        model.fit(stage, epochs=1, verbose=0)
        assert model.get_layer("ea").prepared_form is not None
    assert model.get_layer("ea").prepared_form is None
    raw_pred = model.predict(x, batch_size=BATCH, verbose=0)
    raw_loss = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    size = model.get_layer("ea").table.size
    with prefetch(
        x, model, batch_size=BATCH, training=False, deterministic=False
    ) as stage:
        pred = model.predict(stage, verbose=0)
    with prefetch((x, y), model, batch_size=BATCH, training=False) as stage:
        loss = model.evaluate(stage, verbose=0)
    np.testing.assert_array_equal(raw_pred, pred)
    np.testing.assert_allclose(raw_loss, loss, rtol=1e-6)
    assert model.get_layer("ea").table.size == size  # read-only lookups


def test_validation_stage_during_fit():
    x, y = _data()
    xv, yv = _data(48, seed=1)
    model = _model(capacity=128)
    with (
        prefetch((x, y), model, batch_size=BATCH) as train,
        prefetch((xv, yv), model, batch_size=BATCH, training=False) as val,
    ):
        hist = model.fit(train, validation_data=val, epochs=2, verbose=0)
    assert len(hist.history["val_loss"]) == 2
    assert np.isfinite(hist.history["val_loss"]).all()


def _batches(x, y):
    return [
        ({k: v[i : i + BATCH] for k, v in x.items()}, y[i : i + BATCH])
        for i in range(0, N, BATCH)
    ]


class _Seq(keras.utils.PyDataset):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


def _sources():
    x, y = _data()
    batches = _batches(x, y)
    out = {
        "arrays_y_kwarg": (x, {"y": y}),
        "callable_generator": (lambda: iter(batches), {"steps": N // BATCH}),
        "list": (batches, {}),
        "pydataset": (_Seq(batches), {}),
    }
    import tensorflow as tf

    out["tf_data"] = (
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
        {},
    )
    try:
        import torch.utils.data as tud

        class _DS(tud.Dataset):
            def __len__(self):
                return N

            def __getitem__(self, i):
                return {k: v[i] for k, v in x.items()}, y[i]

        out["torch_loader"] = (tud.DataLoader(_DS(), batch_size=BATCH), {})
    except ImportError:  # pragma: no cover
        pass
    return out


@pytest.mark.parametrize(
    "name",
    ["arrays_y_kwarg", "callable_generator", "list", "pydataset", "tf_data",
     "torch_loader"],
)  # fmt: skip
def test_sources_train_identically(name):
    sources = _sources()
    if name not in sources:
        pytest.skip(f"{name} unavailable")
    source, kwargs = sources[name]
    ref = _reference(epochs=1, capacity=128)
    model = _model(capacity=128)
    with prefetch(source, model, batch_size=BATCH, threads=2, **kwargs) as stage:
        assert len(stage) == N // BATCH
        model.fit(stage, epochs=1, verbose=0)
    _assert_same(ref, _state(model))


def test_one_shot_generator_single_epoch_and_steps():
    x, y = _data()
    model = _model(capacity=128)
    gen = (b for b in _batches(x, y))
    with prefetch(gen, model, steps=N // BATCH) as stage:
        model.fit(stage, epochs=1, verbose=0)
    ref = _reference(epochs=1, capacity=128)
    _assert_same(ref, _state(model))


def test_worker_error_surfaces_with_cause():
    x, y = _data()
    batches = _batches(x, y)

    def broken():
        for i, b in enumerate(batches):
            if i == 3:
                raise ZeroDivisionError("boom in the source")
            yield b

    model = _model(capacity=128)
    before = len(_worker_threads())
    with pytest.raises(Exception) as info:
        with prefetch(broken, model, steps=len(batches), threads=2) as stage:
            model.fit(stage, epochs=1, verbose=0)
    chain, err = [], info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    text = " ".join(f"{type(e).__name__}: {e}" for e in chain)
    assert "boom in the source" in text
    assert "Worker traceback" in text and "in broken" in text
    if keras.backend.backend() != "tensorflow":  # tf.data re-wraps errors
        err = next(e for e in chain if isinstance(e, PrefetchError))
        assert isinstance(err.original, ZeroDivisionError)
        assert err.original.__traceback__ is not None
    assert len(_wait_no_workers()) <= before


def test_bad_keys_error_in_worker():
    x, y = _data()
    x = dict(x, a=x["a"].astype(np.float32))  # float keys are rejected
    model = _model(capacity=128)
    stage = prefetch((x, y), model, batch_size=BATCH)
    stage.on_epoch_begin()
    with pytest.raises(PrefetchError) as info:
        stage[0]
    assert isinstance(info.value.__cause__, TypeError)
    stage.close()
    assert not _wait_no_workers()


class _StopAfter(keras.callbacks.Callback):
    def __init__(self, n, exc=None):
        super().__init__()
        self.n, self.exc = n, exc

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 >= self.n:
            if self.exc is not None:
                raise self.exc
            self.model.stop_training = True


def test_exception_in_fit_shuts_down_and_rolls_back():
    x, y = _data()
    model = _model(capacity=512)
    start = time.time()
    with pytest.raises(RuntimeError, match="stop here"):
        with prefetch((x, y), model, batch_size=BATCH, threads=3, capacity=4) as stage:
            model.fit(
                stage, epochs=1, verbose=0,
                callbacks=[_StopAfter(2, RuntimeError("stop here"))],
            )  # fmt: skip
    assert not _wait_no_workers()
    assert time.time() - start < 120
    assert stage.closed
    layer = model.get_layer("eb")
    trained = int(keras.ops.convert_to_numpy(layer.sparse_iterations))
    # Only keys of trained batches may keep rows: rows handed out by batches
    # looked up ahead of the step were erased on close.
    seen = set(x["b"][: trained * BATCH].tolist())
    keys = set(layer.table.export()[0].tolist())
    assert keys <= seen
    if trained < N // BATCH:
        assert stage.stats()["erased_keys"] > 0 or keys == seen


def test_early_stopping_and_no_leaks_across_fits():
    x, y = _data()
    model = _model(capacity=128)
    baseline = threading.active_count()
    for _ in range(2):
        with prefetch((x, y), model, batch_size=BATCH, threads=2) as stage:
            model.fit(stage, epochs=3, verbose=0, callbacks=[_StopAfter(3)])
        assert not _wait_no_workers()
    # Without a context manager: threads stop at the end of each pass, and
    # `passes` closes the stage.
    stage = prefetch((x, y), model, batch_size=BATCH, passes=2)
    model.fit(stage, epochs=2, verbose=0)
    assert stage.closed and model.get_layer("ea").prepared_form is None
    assert not _wait_no_workers()
    assert threading.active_count() <= baseline + 1


def _new_stage_threads(before):
    return [t for t in _worker_threads() if t not in before]


def _gone_within(before, seconds):
    end = time.perf_counter() + seconds
    while _new_stage_threads(before) and time.perf_counter() < end:
        time.sleep(0.01)
    return _new_stage_threads(before)


@pytest.mark.parametrize("how", ["event", "queue"])
def test_close_returns_promptly_while_the_source_blocks(how):
    import queue

    if how == "event":
        gate = threading.Event()
        block, release = gate.wait, gate.set
    else:
        gate = queue.Queue()
        block, release = gate.get, lambda: gate.put(None)
    x, y = _data()
    batch = _batches(x, y)[0]
    entered, finished = threading.Event(), threading.Event()

    def blocking():
        try:
            yield batch
            entered.set()
            block()  # inside the stage's next(): Python cannot interrupt it
            yield batch
        finally:
            finished.set()

    before = set(threading.enumerate())
    stage = prefetch(blocking, _model(capacity=128), steps=4, threads=2)
    stage.on_epoch_begin()
    stage[0]
    assert entered.wait(10.0)
    start = time.perf_counter()
    stage.close()
    assert time.perf_counter() - start < 1.0
    # Workers are gone; the feeder, stuck in the source, is a daemon (it
    # cannot keep the process alive) and the only thread left.
    left = _new_stage_threads(before)
    assert [t.name for t in left] == ["ks-prefetch-feeder"]
    assert left[0].daemon
    release()
    assert not _gone_within(before, 1.0)
    assert finished.wait(1.0)  # the feeder closed the source's generator


@pytest.mark.parametrize("closed_by", ["with", "nothing"])
@pytest.mark.parametrize("failing", ["source", "worker"])
def test_threads_end_within_a_second_after_a_failed_fit(failing, closed_by):
    x, y = _data()
    batches = _batches(x, y)
    bad_x = dict(batches[2][0], a=batches[2][0]["a"].astype(np.float32))

    def broken():
        yield from batches[:2]
        if failing == "source":
            raise ZeroDivisionError("boom in the source")
        yield bad_x, batches[2][1]  # float keys: the table call raises
        yield from batches[3:]

    model = _model(capacity=128)
    before = set(threading.enumerate())
    stage = prefetch(broken, model, steps=len(batches), threads=3)
    match = "boom in the source" if failing == "source" else "keys must be"
    with pytest.raises(Exception, match=match):
        if closed_by == "with":
            with stage:
                model.fit(stage, epochs=1, verbose=0)
        else:
            model.fit(stage, epochs=1, verbose=0)
    assert not _gone_within(before, 1.0)
    stage.close()


def test_garbage_collection_closes():
    import gc

    x, y = _data()
    model = _model(capacity=128)
    stage = prefetch((x, y), model, batch_size=BATCH, threads=2)
    stage.on_epoch_begin()
    stage[0]
    assert _worker_threads()
    del stage
    gc.collect()
    assert not _wait_no_workers()
    assert model.get_layer("ea").prepared_form is None


def test_subclassed_model_needs_feature_map():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = DistributedHashEmbedding(
                4, capacity=64, combiner="sum", optimizer="sgd", name="emb"
            )
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.emb(x["k"]))

    rng = np.random.default_rng(0)
    x = {"k": rng.integers(0, 50, (64, 2)).astype(np.int32)}
    y = np.zeros((64, 1), np.float32)
    model = Sub()
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="feature_map"):
        prefetch((x, y), model, batch_size=16)
    with prefetch((x, y), model, batch_size=16, feature_map={"emb": "k"}) as stage:
        model.fit(stage, epochs=1, verbose=0)
        assert stage.stats()["table_s"] > 0


def test_prefetch_docstring_example():
    import doctest
    import importlib

    module = importlib.import_module("keras_sparse.data.prefetch")
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


def test_transfer_copies_in_workers_and_trains_identically():
    # transfer=True copies each prepared batch to the backend's device in the
    # workers (JAX: jax.Array, PyTorch: torch.Tensor); training is unchanged.
    backend = keras.backend.backend()
    ref = _reference(capacity=64)
    x, y = _data()
    with prefetch(
        (x, y), _model(capacity=64), batch_size=BATCH, training=False, transfer=True
    ) as peek:
        peek.on_epoch_begin()
        bx, by = peek[0][:2]
        peek.on_epoch_end()
    if backend == "jax":
        import jax

        assert isinstance(bx["a"], jax.Array) and isinstance(by, jax.Array)
    elif backend == "torch":
        import torch

        assert isinstance(bx["a"], torch.Tensor) and isinstance(by, torch.Tensor)
    else:  # tf.data makes its own tensors: nothing to copy
        assert isinstance(bx["a"], np.ndarray)
    model = _model(capacity=64)
    with prefetch((x, y), model, batch_size=BATCH, threads=2, transfer=True) as st:
        model.fit(st, epochs=2, verbose=0)
    _assert_same(ref, _state(model))


def test_transfer_compiles_the_step_once():
    # Device copies must look to jit like NumPy inputs (uncommitted); a
    # committed copy changed the input shardings and recompiled the step in
    # the first two fits.
    if keras.backend.backend() != "jax":
        pytest.skip("jit compilation counting is JAX-specific")
    import logging

    import jax

    compiled = []

    class Count(logging.Handler):
        def emit(self, record):
            if "compilation of jit(train_step)" in record.getMessage():
                compiled.append(record.getMessage())

    handler = Count(logging.WARNING)
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    x, y = _data()
    model = _model(capacity=64)
    try:
        with jax.log_compiles(True):
            with prefetch((x, y), model, batch_size=BATCH, transfer=True) as st:
                for _ in range(3):
                    model.fit(st, epochs=1, verbose=0)
    finally:
        logger.removeHandler(handler)
    assert len(compiled) == 1, compiled


def test_transfer_bad_value_rejected():
    x, y = _data()
    model = _model()
    with pytest.raises(ValueError, match="prefetch: `transfer` must be"):
        prefetch((x, y), model, batch_size=BATCH, transfer="gpu")
