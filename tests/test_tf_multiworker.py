"""tf.distribute.MultiWorkerMirroredStrategy (TensorFlow): two worker
processes on localhost (one CPU replica each) train row-, column-sharded and
replicated ("data") tables, then an EmbeddingCollection and key-sharded
hash layers (tests/multiworker_sparse.py), in the strategy's custom loop
exactly like one device on the global batches, infer like it, save files
that load on one device, and a worker whose peer dies fails with an error
in bounded time.

Keras's ``fit`` does not run under MultiWorkerMirroredStrategy (Keras 3,
https://github.com/keras-team/keras/issues/20585), so the workers train with
``strategy.run`` over ``experimental_distribute_dataset``. Each worker is a
fresh subprocess (this file's ``__main__``: the strategy must exist before
TensorFlow runs anything) and prints its results as JSON; both cases run in
the same pair of processes.
"""

import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from tests.subprocess_results import free_ports

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="tf.distribute runs on the TensorFlow backend only",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, DIM, GLOBAL, STEPS, TOL = 21, 4, 8, 4, 1e-5
WORKERS, TIMEOUT = 2, 60  # collective timeout (seconds): a busy machine
# name: (sharding, optimizer, combiner); 21 rows leave a padding row.
LAYERS = {
    "row_sgd": ("row", "sgd", None),
    "row_adagrad": ("row", "adagrad", "sum"),
    "column_adam": ("column", "adam", None),
    "column_adagrad": ("column", "adagrad", "mean"),
    "data_adagrad": ("data", "adagrad", "sum"),
}


# ---------------------------------------------------------------- subprocess
def _model():
    import keras_sparse as ks

    keras.utils.set_random_seed(0)  # every worker draws the same tables
    ids = keras.Input((3,), dtype="int32", name="ids")
    features = []
    for name, (sharding, opt, combiner) in LAYERS.items():
        layer = ks.AllToAllDenseEmbedding(
            ROWS, DIM, optimizer=opt, combiner=combiner, sharding=sharding, name=name
        )
        features.append(keras.layers.Flatten()(layer(ids)))
    out = keras.layers.Dense(1, name="head")(keras.layers.Concatenate()(features))
    return keras.Model(ids, out)


def _data(samples=GLOBAL * STEPS):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, (samples, 3)).astype("int32")
    ids[:, 0] = 5  # a row both workers touch in every step
    return ids, rng.normal(size=(samples, 1)).astype("float32")


def _state(model):
    """Each layer's saved state (whole unpadded arrays) and the head's;
    under the strategy a collective (both workers call it)."""
    state = {}
    for name in LAYERS:
        store = {}
        model.get_layer(name).save_own_variables(store)
        state.update({f"{name}/{k}": np.asarray(v) for k, v in store.items()})
    head = model.get_layer("head").get_weights()
    state.update({f"head/{i}": w for i, w in enumerate(head)})
    return state


def _gap(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float(np.abs(a[k].astype(float) - b[k]).max()) for k in a)


def _train_step(strategy, model, optimizer, batch=GLOBAL):
    """The strategy's custom-loop step: each replica's mean-squared error
    summed and divided by the global batch, so the replicas' gradients sum
    to one device's (the sparse update all-gathers them; dense ones are
    all-reduced by the optimizer)."""
    import tensorflow as tf

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            errors = tf.reduce_mean((model(x, training=True) - y) ** 2, axis=-1)
            loss = tf.nn.compute_average_loss(errors, global_batch_size=batch)
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))

    @tf.function
    def step(x, y):
        strategy.run(replica_step, (x, y))

    return step


def _train(strategy, step, steps, on_step=None, data=None, batch=GLOBAL):
    """``steps`` global batches (of ``data`` when given), each split over
    the replicas in order."""
    import tensorflow as tf

    x, y = _data(GLOBAL * steps) if data is None else data
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    options = tf.data.Options()
    policy = tf.data.experimental.AutoShardPolicy.DATA
    options.experimental_distribute.auto_shard_policy = policy
    batches = strategy.experimental_distribute_dataset(dataset.with_options(options))
    for i, (bx, by) in enumerate(batches):
        if on_step is not None:
            on_step(i)
        step(bx, by)


def _apply_plan(strategy):
    """`ks.sharding.apply_plan` under the strategy (tests/test_plan_apply.py
    checks the rest): the planned strategies become the built placements."""
    import keras_sparse as ks

    layers = [
        ks.AllToAllDenseEmbedding(4000, 8, optimizer="adagrad", name="plan_big"),
        ks.AllToAllDenseEmbedding(10, 8, optimizer="adagrad", name="plan_small"),
    ]

    def plan(devices):
        return ks.sharding.plan(
            layers, devices=devices, memory_per_device=200_000,
            strategies=ks.sharding.runnable_strategies(),
        )  # fmt: skip

    out = {}
    with strategy.scope():
        try:
            ks.sharding.apply_plan(plan(4))
        except ValueError as error:
            out["mismatch"] = str(error)
        applied = ks.sharding.apply_plan(plan(WORKERS))
        for layer in layers:
            layer.build()
    for layer in layers:
        out[layer.name] = [applied.strategy(layer.name), repr(layer.placement)]
    return out


def _loop_trainer(strategy, batch):
    """``train(model, x, y)``: the strategy's custom loop over global
    batches of ``batch`` (the head by SGD)."""

    def train(model, x, y):
        with strategy.scope():
            optimizer = keras.optimizers.SGD(0.05)
            optimizer.build(model.trainable_variables)
        step = _train_step(strategy, model, optimizer, batch)
        _train(strategy, step, None, data=(x, y), batch=batch)

    return train


def _sparse_cases(strategy, index, tmp, mark):
    """Collection and key-sharded hash tables (tests/multiworker_sparse.py)
    trained in the same loop."""
    from tests import multiworker_sparse

    train = _loop_trainer(strategy, multiworker_sparse.GLOBAL)
    return multiworker_sparse.run(strategy, train, index, tmp, mark)


def _worker(index, ports, tmp):
    began = time.monotonic()

    def mark(what):  # progress, for the failure log
        wall, cpu = time.monotonic() - began, time.process_time()
        print(f"T {what} {wall:.1f} (cpu {cpu:.1f})", flush=True)

    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    })  # fmt: skip
    import tensorflow as tf

    communication = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=TIMEOUT,
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=communication
    )
    chief = index == 0
    mark("strategy")
    out = {"replicas": strategy.num_replicas_in_sync}

    # One device on the global batches: the reference.
    x, y = _data()
    start = _state(_model())
    reference = _model()
    reference.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=False)
    reference.fit(x, y, batch_size=GLOBAL, shuffle=False, verbose=0)

    mark("reference")
    with strategy.scope():
        model = _model()
        optimizer = keras.optimizers.SGD(0.05)
        optimizer.build(model.trainable_variables)
    out["start"] = _gap(_state(model), start)
    out["shapes"] = {
        f"{name}/{v.name}": [
            list(c.shape) for c in strategy.experimental_local_results(v.value)
        ]
        for name in LAYERS
        for v in model.get_layer(name).weights
        if v.name not in ("sparse_iterations", "sparse_update_anchor")
    }
    mark("built")
    step = _train_step(strategy, model, optimizer)
    _train(strategy, step, STEPS)
    mark("trained")
    trained = _state(model)
    out["moved"] = _gap(trained, start)
    out["trained"] = _gap(trained, _state(reference))
    out["get_weights"] = max(
        float(np.abs(a - b).max())
        for a, b in zip(model.get_weights(), reference.get_weights(), strict=True)
    )

    # Keras's multi-worker convention: every worker saves (the whole tables
    # are all-gathered), the chief to the real path, the others elsewhere.
    # Outside a step the sharded layers all-gather their whole tables.
    x, _ = _data(GLOBAL)
    outside = np.asarray(model(x)) - np.asarray(reference(x))
    out["call_outside_step"] = float(np.abs(outside).max())
    mark("compared")
    path = os.path.join(tmp, "model.keras" if chief else f"worker{index}.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    out["reloaded"] = _gap(_state(loaded), _state(model))
    out["reloaded_placement"] = repr(loaded.get_layer("row_sgd").placement)
    if chief:
        one = keras.models.load_model(path)  # no strategy: one device
        out["one_device"] = _gap(_state(one), _state(reference))
        out["one_device_placement"] = repr(one.get_layer("row_sgd").placement)
        x, _ = _data(3 * GLOBAL)
        predictions = one.predict(x, verbose=0) - reference.predict(x, verbose=0)
        out["one_device_predict"] = float(np.abs(predictions).max())
    mark("saved")
    print("RESULTS " + json.dumps(out), flush=True)
    sparse = _sparse_cases(strategy, index, tmp, mark)
    print("SPARSE " + json.dumps(sparse), flush=True)
    print("PLAN " + json.dumps(_apply_plan(strategy)), flush=True)
    from tests import multiworker_cache

    train = _loop_trainer(strategy, multiworker_cache.GLOBAL)
    cache = multiworker_cache.run(strategy, train, index, mark)
    cache["refused"] = multiworker_cache.refused(strategy, train, index)
    print("CACHE " + json.dumps(cache), flush=True)

    # The dead peer: the other worker exits before its second step.
    def die(step):
        if not chief and step == 1:
            os._exit(3)

    began = time.monotonic()
    try:
        _train(strategy, step, 3, on_step=die)
        dead = {"error": None}
    except Exception as error:  # noqa: BLE001 - the test reads what came
        dead = {"error": f"{type(error).__name__}: {error}"[:2000]}
    dead["seconds"] = time.monotonic() - began
    print("DEAD " + json.dumps(dead), flush=True)
    os._exit(0)  # the strategy's aborted collectives need no shutdown


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3])


# --------------------------------------------------------------------- tests
_CACHE = {}


def _run(tmp):
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, KERAS_BACKEND="tensorflow", PYTHONPATH=path)
    env.pop("TF_CONFIG", None)
    ports = ",".join(map(str, free_ports(WORKERS)))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(i), ports, str(tmp)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for i in range(WORKERS)
    ]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=400))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            outputs.append(proc.communicate())
            outputs[-1] = (outputs[-1][0], outputs[-1][1] + "\n(timed out)")
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def _results(tmp_path_factory):
    """Each worker's parsed lines (one run of the pair for the module)."""
    if not _CACHE:
        runs = _run(tmp_path_factory.mktemp("multiworker"))
        for i, (code, out, err) in enumerate(runs):
            lines = {}
            for line in out.splitlines():
                head, _, rest = line.partition(" ")
                if head in ("RESULTS", "SPARSE", "PLAN", "CACHE", "DEAD"):
                    lines[head] = json.loads(rest)
            lines["returncode"] = code
            lines["log"] = out[-3000:] + err[-3000:]
            _CACHE[i] = lines
    return _CACHE


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    return _results(tmp_path_factory)


def _get(workers, index, key):
    lines = workers[index]
    if key not in lines:
        pytest.fail(f"worker {index} printed no {key}:\n{lines['log']}")
    return lines[key]


@pytest.mark.parametrize("index", range(WORKERS))
def test_each_worker_holds_its_part(workers, index):
    """Row: ceil(21 / 2) rows on each worker; column: dim / 2 columns;
    "data": the whole table. Both workers start as one device."""
    results = _get(workers, index, "RESULTS")
    assert results["replicas"] == WORKERS
    assert results["start"] == 0.0
    for key, shapes in results["shapes"].items():
        expected = {"row": [11, DIM], "column": [ROWS, DIM // 2], "data": [ROWS, DIM]}
        assert shapes == [expected[key.split("_")[0]]], key
    assert len(results["shapes"]) == 10  # 5 tables, 5 slots (adam: 2)


@pytest.mark.parametrize("index", range(WORKERS))
@pytest.mark.parametrize(
    "what", ["trained", "get_weights", "call_outside_step", "reloaded"]
)
def test_training_matches_one_device(workers, index, what):
    """Tables and slots (whole, unpadded, all-gathered on each worker) and
    the head equal one device on the global batches, and so does a call of
    the model outside a step; a reloaded file under the strategy equals the
    trained model."""
    results = _get(workers, index, "RESULTS")
    assert results[what] <= TOL
    assert results["moved"] > 100 * TOL  # the steps did train


def test_saved_file_loads_on_one_device(workers):
    results = _get(workers, 0, "RESULTS")
    assert results["reloaded_placement"] == "TfShardedPlacement('row', devices=2)"
    assert results["one_device_placement"] == "None"
    assert results["one_device"] <= TOL
    assert results["one_device_predict"] <= TOL


@pytest.mark.parametrize("index", range(WORKERS))
def test_plan_applies_under_the_strategy(workers, index):
    """A plan made for the 2 replicas sets the unbuilt layers' sharding,
    which their build places (the big table split, the small replicated);
    a plan for 4 devices is refused."""
    plan = _get(workers, index, "PLAN")
    assert plan["plan_big"] == ["row", "TfShardedPlacement('row', devices=2)"]
    assert plan["plan_small"] == ["data", "None"]
    assert "plan is for 4 devices" in plan["mismatch"]
    assert "runs 2" in plan["mismatch"]


def test_dead_peer_fails_in_bounded_time(workers):
    """Worker 1 exits before its second step: worker 0's step fails with an
    error (no hang) within the collective timeout and some slack."""
    dead = _get(workers, 0, "DEAD")
    assert dead["error"] is not None, "the loop finished without its peer"
    assert dead["seconds"] < TIMEOUT + 30, dead
    assert workers[1]["returncode"] == 3 and workers[0]["returncode"] == 0


# --------------------------------------- collection and hash tables (SPARSE)
# tests/multiworker_sparse.py: an EmbeddingCollection ("table", "row",
# "column", "data" tables) and key-sharded LRU/LFU hash layers
# (admit_after=2, under pressure) trained in the same pair of processes.
COUNTERS = ("hits", "misses", "inserts", "evictions", "rejected_admissions")


@pytest.mark.parametrize("index", range(WORKERS))
def test_collection_and_hash_layers_are_placed_over_the_workers(workers, index):
    """Each worker holds its part of each stack (the "table" stack's block
    of 13 rows holds whole tables; "row": ceil(18 / 2); "column": 2 of 4
    columns; "data": the whole stack) and its replica's hash table shard."""
    results = _get(workers, index, "SPARSE")
    row, column = "TfShardedPlacement('row', devices=2)", "TfShardedPlacement("
    assert results["placements"] == {
        "stack_4_table": row, "stack_4_row": row,
        "stack_4_column": column + "'column', devices=2)", "stack_4_data": "None",
    }  # fmt: skip
    shapes = {"table": [13, 4], "row": [6, 4], "column": [9, 2], "data": [5, 4]}
    for name, parts in results["shapes"].items():
        assert parts == [shapes[name.split("_")[2]]], name
    assert len(results["shapes"]) == 8  # 4 stacks, adagrad: 1 slot each
    assert results["hash_placement"] == "TfKeyPlacement(devices=2)"
    assert results["local_shards"] == [index]


@pytest.mark.parametrize("index", range(WORKERS))
def test_collection_and_hash_training_matches_one_device(workers, index):
    """Collection tables and slots, each hash layer's records key by key
    (rows, values, slots, scores), pending admission counts and clock, and
    the head equal one device to 1e-5, the hash shards under pressure (LRU
    and LFU evict, admit_after=2 rejects); the workers' counters sum to
    the one-device 2-shard table's."""
    results = _get(workers, index, "SPARSE")
    assert results["trained"] <= TOL
    reference = results["reference_stats"]
    for name, counters in reference.items():
        assert counters["evictions"] > 0 and counters["rejected_admissions"] > 0
        summed = {
            k: sum(_get(workers, i, "SPARSE")["stats"][name][k] for i in range(WORKERS))
            for k in COUNTERS
        }
        assert summed == counters, name


@pytest.mark.parametrize("index", range(WORKERS))
@pytest.mark.parametrize("what", ["call_outside_step", "predict"])
def test_collection_and_hash_inference_matches_one_device(workers, index, what):
    """A plain call in inference mode (outside a step: whole tables and
    every worker's keys are gathered) and ``model.predict`` (each replica
    in its step) equal one device on trained, evicted, rejected and unseen
    keys, and count nothing."""
    results = _get(workers, index, "SPARSE")
    assert results["predict_error"] is None
    assert results[what] <= TOL
    assert results["inference_keeps_stats"] is True


@pytest.mark.parametrize("index", range(WORKERS))
def test_collection_and_hash_save_reloads_under_the_strategy(workers, index):
    """Every worker saves (the hash records are gathered from the workers);
    loaded under the strategy, each worker takes its parts and shards, and
    the state equals the trained one (saved after the inference above, so
    inference changed no record)."""
    results = _get(workers, index, "SPARSE")
    assert results["reloaded"] == 0.0
    assert results["reloaded_placements"] == [
        "TfShardedPlacement('row', devices=2)",
        "TfKeyPlacement(devices=2)",
    ]
    assert results["reloaded_call"] <= TOL


def test_collection_and_hash_file_loads_on_one_device(workers):
    """The chief's file on one device: the collection equals the reference;
    the hash keys are re-placed in one table of the same capacity (a few
    whose buckets filled up are dropped) with the reference's records, and
    predictions on samples without the dropped keys equal it."""
    one = _get(workers, 0, "SPARSE")["one_device"]
    assert one["placement"] == "None"
    assert one["collection"] <= TOL
    assert one["hash"] <= TOL
    assert max(one["dropped"].values()) <= 8
    assert one["compared_samples"] >= 16
    assert one["call"] <= TOL


# ------------------------------- a key-sharded hash layer over stores (SPARSE)
# tests/multiworker_sparse.py's "stored" layer: 128 rows (64 per worker's
# shard) over a host store per worker, ~200 keys; the reference is one
# device holding every key (no store).
@pytest.mark.parametrize("index", range(WORKERS))
def test_each_worker_caches_its_shard_over_its_own_store(workers, index):
    """Each worker's shard evicts keys down to its own store and fills
    them back; its export (table and store) equals the reference's records
    of the keys the shard owns, key by key (values, slots, scores)."""
    results = _get(workers, index, "SPARSE")
    stats = results["stored_stats"]
    assert stats["evictions"] >= 20 and stats["fills"] >= 10, stats
    assert stats["write_backs"] == stats["evictions"], stats
    assert stats["overflows"] == 0, stats
    assert results["stored_export"] <= TOL
    sizes = [_get(workers, i, "SPARSE")["stored_stats"] for i in range(WORKERS)]
    keys = sum(s["size"] + s["store_size"] for s in sizes)
    assert keys == results["stored_keys"]


@pytest.mark.parametrize("index", range(WORKERS))
def test_stored_layer_infers_saves_and_reloads_like_one_device(workers, index):
    """With the stored layer in the model, the checks above hold for it
    too: the saved records (gathered from every worker's table and store)
    equal one device's, inference reads evicted keys from their owners'
    stores and counts nothing, and the file reloads under the strategy."""
    results = _get(workers, index, "SPARSE")
    assert results["trained"] <= TOL
    assert results["predict_error"] is None
    assert results["call_outside_step"] <= TOL and results["predict"] <= TOL
    assert results["stored_inference_keeps_stats"] is True
    assert results["stored_reads"] > 0
    assert results["reloaded"] == 0.0 and results["reloaded_call"] <= TOL


def test_stored_layer_file_loads_on_one_device(workers):
    """The chief's file on one device: the stored layer keeps every key
    (in its table or its store) with the reference's records."""
    assert _get(workers, 0, "SPARSE")["one_device"]["stored"] <= TOL


# ------------------------------------------- tables with cache_rows (CACHE)
# tests/multiworker_cache.py: two 3000-id tables (SGD, Adagrad) and a
# collection's table (Adagrad), each cached in 200 rows over a host store in
# each worker; the reference is the same model without ``cache_rows`` under
# the strategy.
CACHED_KEYS = {
    "sgd": ["0", "steps"],
    "adagrad": ["0", "1", "steps"],
    "coll": ["a:embeddings", "a:slot_accumulator", "sparse_iterations"],
}


@pytest.mark.parametrize("index", range(WORKERS))
@pytest.mark.parametrize("table", sorted(CACHED_KEYS))
def test_a_cached_table_trains_in_each_worker_as_the_whole_table(workers, index, table):
    """Every id's values and slots and the step count equal the uncached
    table's bit for bit, and so do predictions (which count nothing); rows
    went down to the store and came back; both workers' copies (state,
    cache variables, cached ids, counters) are identical, from seeds drawn
    differently."""
    from tests import multiworker_cache

    result = _get(workers, index, "CACHE")[table]
    stats = result["stats"]
    assert stats["fills"] > 0 and stats["write_backs"] > 0, stats
    assert stats["evictions"] == stats["write_backs"], stats
    assert result["keys"] == CACHED_KEYS[table]
    assert result["steps"] == multiworker_cache.STEPS
    assert result["moved"] > 100 * TOL  # the steps did train
    assert result["exact"] == 0.0, result
    assert _get(workers, index, "CACHE")["predict"] == 0.0
    assert result["inference_keeps_stats"] is True
    other = _get(workers, 1 - index, "CACHE")[table]
    assert result["digest"] == other["digest"]


@pytest.mark.parametrize("index", range(WORKERS))
def test_cached_copies_that_differ_are_refused(workers, index):
    """A seed per worker: the first step fails in every worker with a
    table's error, the caches unchanged."""
    message, unchanged = _get(workers, index, "CACHE")["refused"]
    assert message.startswith("Layer '"), message
    assert "`cache_rows` under MultiWorkerMirroredStrategy with 2 workers" in message
    assert "copies differ" in message and "chief's seed" in message, message
    assert unchanged
