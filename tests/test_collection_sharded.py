"""EmbeddingCollection tables sharded table-, row- and column-wise on
TensorFlow (MirroredStrategy over 2 logical CPUs) and PyTorch (2 gloo
processes): each device holds its part of each stack (a "table" stack's
block holds whole tables), training and predictions equal one device, the
per-table saves load back under the strategy and on one device.

One collection holds two "table" tables (placed on different devices), two
"row" tables (one stack), a "column" and a "data" table. TensorFlow runs in
a fresh subprocess (logical devices must exist before TensorFlow starts);
PyTorch runs rank 0 in the test process and rank 1 in a subprocess, both
this file's ``__main__``.
"""

import json
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.helpers import replica_shapes

BACKEND = keras.backend.backend()
pytestmark = pytest.mark.skipif(
    BACKEND not in ("tensorflow", "torch"),
    reason="MirroredStrategy / torch.distributed sharding (JAX: test_sharding_table)",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIM, BATCH, SAMPLES, TOL = 4, 8, 32, 1e-5
# name: (rows, combiner, sharding, ids per sample (None: one id, no axis))
TABLES = {
    "ta": (13, "sum", "table", 3),
    "tb": (7, None, "table", None),
    "row": (11, "mean", "row", 2),
    "row2": (6, None, "row", None),
    "col": (9, None, "column", None),
    "data": (5, None, "data", None),
}
# The planner puts the larger "table" table on device 0, the other on 1:
# blocks of B = 13 rows. 11 + 6 "row" rows are padded to 18.
PARTS = {
    "stack_4_table": (13, DIM),
    "stack_4_row": (9, DIM),
    "stack_4_column": (9, DIM // 2),
    "stack_4_data": (5, DIM),
}


# ---------------------------------------------------------------- shared
def _model(**table_args):
    import keras_sparse as ks

    def seeded(i):
        return keras.initializers.RandomUniform(-0.5, 0.5, seed=i)

    tables, inputs = {}, {}
    for i, (name, (rows, combiner, sharding, width)) in enumerate(TABLES.items()):
        args = dict(combiner=combiner, sharding=sharding)
        args.update(table_args.get(name, {}))
        tables[name] = ks.TableConfig(
            rows, args.pop("dim", DIM), embeddings_initializer=seeded(i), **args
        )
        shape = () if width is None else (width,)
        inputs[name] = keras.Input(shape, dtype="int32", name=name)
    optimizer = table_args.get("optimizer", ks.optimizers.Adagrad(0.1))
    out = ks.EmbeddingCollection(tables, optimizer=optimizer, name="coll")(inputs)
    joined = keras.layers.Concatenate()([out[n] for n in TABLES])
    head = keras.layers.Dense(1, kernel_initializer=seeded(99), name="head")
    return keras.Model(inputs, head(joined))


def _data(samples=SAMPLES):
    rng = np.random.default_rng(0)
    x = {}
    for name, (rows, _, _, width) in TABLES.items():
        shape = (samples,) if width is None else (samples, width)
        x[name] = rng.integers(0, rows, shape).astype("int32")
    x["ta"][:, 0] = 12  # a row every device reads in every step
    return x, rng.normal(size=(samples, 1)).astype("float32")


def _state(model):
    """The collection's saved state (per table, whole) and the head."""
    store = {}
    model.get_layer("coll").save_own_variables(store)
    state = {k: np.asarray(v, "float64") for k, v in store.items()}
    for i, w in enumerate(model.get_layer("head").get_weights()):
        state[f"head/{i}"] = np.asarray(w, "float64")
    return state


def _gap(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _moved(start, trained):
    """The least any table's rows moved in training."""
    keys = [k for k in start if k.endswith(":embeddings")]
    assert len(keys) == len(TABLES), keys
    return min(float(np.abs(start[k] - trained[k]).max()) for k in keys)


def _blocks(parts, state):
    """How far each device's part of the "table" stack is from its whole
    tables (device 0: "ta"; device 1: "tb", then zero padding)."""
    ta, tb = state["ta:embeddings"], state["tb:embeddings"]
    first, second = (np.asarray(p, "float64") for p in parts)
    return max(
        float(np.abs(first - ta).max()),
        float(np.abs(second[:7] - tb).max()),
        float(np.abs(second[7:]).max()),
    )


def _error(fn):
    try:
        fn()
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _refusals():
    """Built where the tables are sharded: a "column" table whose width
    does not divide, and a collection without a sparse optimizer."""
    return {
        "dim": _error(lambda: _model(col={"dim": 3})),
        "dense": _error(lambda: _model(optimizer=None)),
    }


# ------------------------------------------------------------ TensorFlow
def _tf_fit(model, x, y):
    model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=False)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return model


def _tf_main():
    import tempfile

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    tmp = tempfile.mkdtemp()
    x, y = _data()
    with tf.device("/cpu:0"):
        start = _state(_model())
        reference = _tf_fit(_model(), x, y)
        reference.save(os.path.join(tmp, "one.keras"))
    want = _state(reference)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = {"moved": _moved(start, want)}
    with strategy.scope():
        model = _model()
        layer = model.get_layer("coll")
        out["start"] = _gap(_state(model), start)
        out["placements"] = {s.name: repr(s.placement) for s in layer.stacks}
        out["offsets"] = {s.name: s.offsets for s in layer.stacks}
        out["shapes"] = replica_shapes(strategy, layer)
        _tf_fit(model, x, y)
        state = _state(model)
        out["fit"] = _gap(state, want)
        stack = layer.stack_variables("stack_4_table")[0]
        parts = strategy.experimental_local_results(stack.value)
        out["blocks"] = _blocks([p.numpy() for p in parts], state)
        predicted = model.predict(x, verbose=0)
        want_predicted = reference.predict(x, verbose=0)
        out["predict"] = float(np.abs(predicted - want_predicted).max())
        path = os.path.join(tmp, "sharded.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        out["reloaded"] = _gap(_state(loaded), state)
        out["reloaded_predict"] = float(
            np.abs(loaded.predict(x, verbose=0) - predicted).max()
        )
        out["reloaded_placements"] = [
            repr(s.placement) for s in loaded.get_layer("coll").stacks
        ]
        from_one = keras.models.load_model(os.path.join(tmp, "one.keras"))
        out["from_one_device"] = _gap(_state(from_one), want)
        out["errors"] = _refusals()
    with tf.device("/cpu:0"):
        to_one = keras.models.load_model(path)
        out["to_one_device"] = _gap(_state(to_one), state)
        out["to_one_device_placements"] = [
            repr(s.placement) for s in to_one.get_layer("coll").stacks
        ]
        out["to_one_device_predict"] = float(
            np.abs(to_one.predict(x, verbose=0) - predicted).max()
        )
    print("RESULTS " + json.dumps(out))


# ---------------------------------------------------------------- PyTorch
def _halves(rank, world):
    """Rank ``rank``'s sample range of each global batch."""
    half = BATCH // world
    return [(s + rank * half, s + (rank + 1) * half) for s in range(0, SAMPLES, BATCH)]


def _torch_train(model, call, x, y, rank, world):
    """Each rank its half of every batch (one process: ``world`` 1, the
    whole batch; the mean loss equals the mean of the halves' means)."""
    import torch

    call = call or model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)
    for lo, hi in _halves(rank, world):
        optimizer.zero_grad()
        batch = {k: torch.as_tensor(v[lo:hi]) for k, v in x.items()}
        loss = ((call(batch, training=True) - torch.as_tensor(y[lo:hi])) ** 2).mean()
        loss.backward()
        optimizer.step()
    return model


def _torch_predict(model, x, rank=0, world=1):
    import torch

    n = SAMPLES // world
    batch = {k: torch.as_tensor(v[rank * n : (rank + 1) * n]) for k, v in x.items()}
    return model(batch, training=False).detach().numpy()


def _torch_rank(rank, port, out):
    """Rank ``rank`` of 2: trains, predicts, saves and reloads; returns
    its results (arrays) and errors."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        x, y = _data()
        model = _model()
        layer = model.get_layer("coll")
        result = {f"start/{k}": v for k, v in _state(model).items()}
        result.update(
            {f"shape/{v.name}": np.array(v.shape) for v in layer.weights
             if v.name.startswith("stack_")}
        )  # fmt: skip
        info = {
            "placements": {s.name: repr(s.placement) for s in layer.stacks},
            "offsets": {s.name: s.offsets for s in layer.stacks},
        }
        _torch_train(model, DistributedDataParallel(model), x, y, rank, 2)
        state = _state(model)
        result.update({f"fit/{k}": v for k, v in state.items()})
        result["block"] = layer.stack_variables("stack_4_table")[0].numpy()
        result["pred"] = _torch_predict(model, x, rank, 2)
        path = os.path.join(out, f"r{rank}.keras")
        model.save(path)  # every process saves (the stacks are gathered)
        loaded = keras.models.load_model(path)
        result["reloaded"] = _torch_predict(loaded, x, rank, 2)
        info["reloaded"] = _gap(_state(loaded), state)
        from_one = keras.models.load_model(os.path.join(out, "one.keras"))
        result["from_one"] = _torch_predict(from_one, x, rank, 2)
        info["errors"] = _refusals()
    finally:
        dist.destroy_process_group()
    return result, info


def _torch_main(rank, port, out):
    result, info = _torch_rank(rank, port, out)
    np.savez(os.path.join(out, f"r{rank}.npz"), **result)
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    if sys.argv[1] == "tensorflow":
        _tf_main()
    else:
        _torch_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])


# ------------------------------------------------------------------ tests
def _env():
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, KERAS_BACKEND=BACKEND, PYTHONPATH=path)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CACHE = {}


def _tf_results():
    if not _CACHE:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "tensorflow"],
            capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300,
        )  # fmt: skip
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
        if proc.returncode == 0 and lines:
            _CACHE["tf"] = json.loads(lines[-1][len("RESULTS ") :])
        else:  # reported by every test, without running the cases again
            _CACHE["failure"] = proc.stdout[-3000:] + proc.stderr[-3000:]
    if "failure" in _CACHE:
        pytest.fail(_CACHE["failure"])
    return _CACHE["tf"]


def _torch_results(tmp_path_factory):
    """``(reference results, [(arrays, info) of ranks 0 and 1], one
    process's load of rank 0's file)``."""
    if "torch" in _CACHE:
        return _CACHE["torch"]
    out = tmp_path_factory.mktemp("collection")
    x, y = _data()
    reference = _torch_train(_model(), None, x, y, 0, 1)
    reference.save(str(out / "one.keras"))  # before the ranks read it
    ref = {
        "start": _state(_model()),
        "fit": _state(reference),
        "pred": _torch_predict(reference, x),
    }
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "torch", "1", str(port), str(out)],
        env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    try:
        ranks = [_torch_rank(0, port, str(out))]
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.update({k: v})
        try:
            log = proc.communicate(timeout=120)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, log[-4000:]
    with open(out / "r1.json") as f:
        ranks.append((dict(np.load(out / "r1.npz")), json.load(f)))
    alone = _torch_predict(keras.models.load_model(str(out / "r0.keras")), x)
    _CACHE["torch"] = (ref, ranks, alone)
    return _CACHE["torch"]


def _part(result, prefix):
    n = len(prefix)
    return {k[n:]: v for k, v in result.items() if k.startswith(prefix)}


@pytest.fixture
def results(tmp_path_factory):
    """One dict per backend: the numbers and strings the tests check."""
    if BACKEND == "tensorflow":
        return _tf_results()
    ref, ranks, alone = _torch_results(tmp_path_factory)
    fit = {k: v for k, v in ref["fit"].items()}
    got = [_part(r, "fit/") for r, _ in ranks]
    info = ranks[0][1]
    pred = np.concatenate([r["pred"] for r, _ in ranks])
    out = {
        "moved": _moved(ref["start"], fit),
        "start": max(_gap(_part(r, "start/"), ref["start"]) for r, _ in ranks),
        "fit": max(_gap(g, fit) for g in got),
        "placements": info["placements"],
        "offsets": info["offsets"],
        "shapes": {
            k: [list(r[f"shape/{k}"]) for r, _ in ranks]
            for k in _part(ranks[0][0], "shape/")
        },
        "blocks": _blocks([r["block"] for r, _ in ranks], got[0]),
        "predict": float(np.abs(pred - ref["pred"]).max()),
        "reloaded": max(i["reloaded"] for _, i in ranks),
        "reloaded_predict": float(
            np.abs(np.concatenate([r["reloaded"] for r, _ in ranks]) - pred).max()
        ),
        "from_one_device_predict": float(
            np.abs(np.concatenate([r["from_one"] for r, _ in ranks]) - pred).max()
        ),
        "to_one_device_predict": float(np.abs(alone - pred).max()),
        "errors": info["errors"],
        "errors_1": ranks[1][1]["errors"],
    }
    return out


def _placement_name():
    return "TfShardedPlacement" if BACKEND == "tensorflow" else "TorchShardedPlacement"


def test_stacks_and_their_placements(results):
    """A stack per strategy; "table" and "row" stacks are row-sharded."""
    assert results["offsets"] == {
        "stack_4_table": {"ta": 0, "tb": 13},
        "stack_4_row": {"row": 0, "row2": 11},
        "stack_4_column": {"col": 0},
        "stack_4_data": {"data": 0},
    }
    placements = results["placements"]
    assert placements["stack_4_data"] == "None"
    for stack, strategy in [("table", "row"), ("row", "row"), ("column", "column")]:
        found = placements[f"stack_4_{stack}"]
        assert found.startswith(f"{_placement_name()}('{strategy}', devices=2"), found


def test_each_device_holds_its_part(results):
    shapes = results["shapes"]
    for name, part in PARTS.items():
        for variable in (name, f"{name}_accumulator"):
            assert shapes[variable] == [list(part)] * 2, (variable, shapes[variable])


def test_table_blocks_hold_whole_tables(results):
    """Device 0's block is table "ta", device 1's "tb" then zero rows."""
    assert results["blocks"] == 0.0


def test_training_matches_one_device(results):
    """Every table's rows and accumulator, the step count and the head
    (the tables moved: the comparison is not of untouched values)."""
    assert results["start"] <= TOL
    assert results["moved"] > 0.01
    assert results["fit"] <= TOL


def test_predictions_match_one_device(results):
    assert results["predict"] <= TOL


def test_save_and_load_model_round_trip(results):
    assert results["reloaded"] <= TOL
    assert results["reloaded_predict"] <= TOL
    if BACKEND == "tensorflow":
        assert results["reloaded_placements"] == [
            "TfShardedPlacement('row', devices=2)",
            "TfShardedPlacement('row', devices=2)",
            "TfShardedPlacement('column', devices=2)",
            "None",
        ]


def test_files_move_between_one_device_and_the_devices(results):
    """The sharded model's file loads on one device (full copies) and the
    one-device file loads sharded."""
    assert results["to_one_device_predict"] <= TOL
    if BACKEND == "tensorflow":
        assert results["to_one_device"] <= TOL
        assert set(results["to_one_device_placements"]) == {"None"}
        assert results["from_one_device"] <= TOL
    else:
        assert results["from_one_device_predict"] <= TOL


@pytest.mark.parametrize(
    "case, words",
    [
        ("dim", ["ValueError", "'coll'", "'coll/col'", "dim 3 not divisible by 2",
                 "`sharding`"]),
        ("dense", ["ValueError", "'coll'", "need a sparse optimizer", "`optimizer`"]),
    ],
)  # fmt: skip
def test_refusals_name_the_table_and_the_fix(results, case, words):
    for errors in (results["errors"], results.get("errors_1", results["errors"])):
        error = errors[case]
        assert error is not None, f"{case}: no error"
        for word in words:
            assert word in error, (word, error)
