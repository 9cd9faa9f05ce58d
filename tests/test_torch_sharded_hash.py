"""Key-sharded DistributedHashEmbedding across torch.distributed processes
(PyTorch, 2 and 4 gloo processes): process ``d`` owns the keys with
``owner_of(key, D) == d`` (its table shard, rows, slots, admission and
eviction state).

References (one process on the concatenated batches, weighed as DDP
averages the processes' mean losses, as in tests/test_torch_sharded.py):
under capacity pressure the same layer whose table is a
`ShardedHashTable` of the same ``D`` shards held in one process (each
shard evicts among its own keys, as in the JAX tests), without pressure
the plain one-process layer. Key by key: vectors and slots to 1e-5, the
same rows, scores, admission counts and clock; inference equal; saved files
load in 1, 2 and 4 processes. A killed peer fails the survivor within the
process group's timeout.

Each process is a subprocess running this file's ``__main__``: 4 processes
(the 2-process cases in two groups of 2), the test process being rank 0.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from tests.subprocess_results import wait_ranks

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="torch.distributed key sharding runs on the PyTorch backend only",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIM, BAG, BATCH, STEPS, TOL = 4, 3, 32, 12, 1e-5
# name: (processes, layer arguments); "plain": no capacity pressure, so the
# reference is the plain one-process layer and its file moves between counts.
CASES = {
    "lru2": (2, dict(eviction="lru", optimizer="adagrad", admit_after=2)),
    "lfu2": (2, dict(eviction="lfu", optimizer="adam", admit_after=2)),
    "lru4": (4, dict(eviction="lru", optimizer="adagrad", admit_after=2)),
    "plain2": (2, dict(optimizer="adagrad", admit_after=2, capacity=2048)),
}
STATS = ("hits", "misses", "inserts", "evictions", "rejected_admissions")


# ---------------------------------------------------------------- subprocess
def _model(args):
    import keras_sparse as ks

    keras.utils.set_random_seed(0)
    keys = keras.Input((BAG,), dtype="int64")
    layer = ks.DistributedHashEmbedding(
        DIM, **{"capacity": 256, "combiner": "sum", "name": "hashed", **args}
    )
    return keras.Model(keys, keras.layers.Dense(1, name="head")(layer(keys)))


def _data():
    rng = np.random.default_rng(0)
    ranks = rng.integers(0, 700, (BATCH * STEPS, BAG))
    keys = ranks.astype(np.int64) * 7_919_993_123 + (5 << 33)  # beyond int32
    keys[::3, 0] = keys[0, 0]  # a hot key
    return keys, rng.normal(size=(len(keys), 1)).astype("float32")


def _bounds(start, stop, world):
    return np.linspace(start, stop, world + 1).round().astype(int)


def _train(model, call, rank, world, ranks):
    """``rank`` trains on its slices; ``ranks`` (one process: ``world``)
    weighs the global batch's slices as DDP averages their mean losses."""
    import torch

    x, y = _data()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)
    for start in range(0, len(y), BATCH):
        b = _bounds(start, start + BATCH, world)
        lo, hi = (b[rank], b[rank + 1]) if ranks == 1 else (b[0], b[-1])
        optimizer.zero_grad()
        out = call(torch.as_tensor(x[lo:hi]), training=True)
        err = (out - torch.as_tensor(y[lo:hi])) ** 2
        cuts = [0] if ranks == 1 else list(b[:-1] - lo)
        ends = [hi - lo] if ranks == 1 else list(b[1:] - lo)
        loss = sum(err[a:e].mean() for a, e in zip(cuts, ends)) / len(cuts)
        loss.backward()
        optimizer.step()


def _records(model):
    """The hash layer's saved state (every process's records: a collective),
    records sorted by key, and the head's kernel."""
    store = {}
    model.get_layer("hashed").save_own_variables(store)
    order = np.argsort(store["record_keys"], kind="stable")
    out = {
        k: np.asarray(v)[order] if k.startswith("record_") else np.asarray(v)
        for k, v in store.items()
    }
    out["kernel"] = model.get_layer("head").kernel.numpy()
    return out


def _probe():
    keys = _data()[0][:16].copy()
    keys[8:] += 12345  # never trained: read zeros
    return keys


def _predict(model, rank, world):
    import torch

    probe = _probe()
    b = _bounds(0, len(probe), world)
    out = model(torch.as_tensor(probe[b[rank] : b[rank + 1]]), training=False)
    return out.detach().numpy()


def _run_case(name, rank, world, out, group):
    from torch.nn.parallel import DistributedDataParallel

    from keras_sparse.table import owner_of

    args = CASES[name][1]
    model = _model(args)
    _train(model, DistributedDataParallel(model, process_group=group), rank, world, 1)
    layer = model.get_layer("hashed")
    result = {f"{name}:{k}": v for k, v in _records(model).items()}
    stats = layer.stats()
    result[f"{name}:stats"] = np.array([stats[s] for s in STATS])
    keys = layer.export()["keys"]
    result[f"{name}:owned"] = np.array(bool((owner_of(keys, world) == rank).all()))
    result[f"{name}:shape"] = np.array(layer.embeddings.shape)
    size = layer.table.size
    result[f"{name}:pred"] = _predict(model, rank, world)
    result[f"{name}:size_kept"] = np.array(layer.table.size == size)
    path = os.path.join(out, f"{name}-{_group_of(world)}.keras")
    model.save(path)  # every process: the records are gathered
    loaded = keras.models.load_model(path)
    result[f"{name}:reloaded"] = _predict(loaded, rank, world)
    for k, v in _records(loaded).items():
        result[f"{name}:reloaded:{k}"] = v
    return result


def _refused_initializer():
    """The error of a layer whose initializer has no per-key draw."""
    import keras_sparse as ks

    layer = ks.DistributedHashEmbedding(
        DIM, capacity=64, embeddings_initializer="orthogonal", name="ortho"
    )
    try:
        layer.build((None, BAG))
    except ValueError as error:
        return str(error)
    return "built"


def _outside_ddp():
    """Training a key-sharded layer outside DDP: ``(error, keys held)``;
    the refusal comes before any key is inserted."""
    import keras_sparse as ks

    layer = ks.DistributedHashEmbedding(
        DIM, capacity=64, combiner="sum", optimizer="sgd", name="no_ddp"
    )
    keys = np.arange(1, 1 + 2 * BAG, dtype="int64").reshape(2, BAG)
    layer(keys)  # builds; inference inserts nothing
    try:
        layer(keys, training=True)
    except RuntimeError as error:
        return str(error), layer.table.size
    return "trained", layer.table.size


def _group_of(world):
    import torch.distributed as dist

    return dist.get_rank() // world


def _run_rank(rank, port, out):
    """Rank ``rank`` of 4; the 2-process cases run in two groups of 2."""
    import datetime

    import torch.distributed as dist

    import keras_sparse as ks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timeout)
    try:
        halves = [dist.new_group(r, timeout=timeout) for r in ([0, 1], [2, 3])]
        half, result = halves[rank // 2], {}
        ks.sharding.set_torch_process_group(half)
        for name, (world, _) in CASES.items():
            if world == 2:
                result.update(_run_case(name, rank % 2, 2, out, half))
        result["orthogonal"] = np.array(_refused_initializer())
        error, held = _outside_ddp()
        result["outside_ddp"] = np.array(error)
        result["outside_ddp_keys"] = np.array(held)
        ks.sharding.set_torch_process_group(None)
        result.update(_run_case("lru4", rank, 4, out, None))
        # The file 2 processes wrote, in 4.
        loaded = keras.models.load_model(os.path.join(out, "plain2-0.keras"))
        result["plain2:in4"] = _predict(loaded, rank, 4)
    finally:
        ks.sharding.set_torch_process_group(None)
        dist.destroy_process_group()
    return result


def _dead_peer(rank, port):
    """2 processes train; rank 1 is killed at its third step."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=15)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    model = _model(dict(optimizer="adagrad"))
    ddp = DistributedDataParallel(model)
    for step in range(1000):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        _train(model, ddp, rank, 2, 1)
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "dead":
        _dead_peer(int(sys.argv[2]), int(sys.argv[3]))
        sys.exit(0)
    result = _run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    np.savez(os.path.join(sys.argv[3], f"r{sys.argv[1]}.npz"), **result)


# --------------------------------------------------------------------- tests
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(*args):
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=path)
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *map(str, args)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait(procs, timeout=240):
    return wait_ranks(procs, timeout, check=False)


def _single(name):
    """One process on the global batches: the reference records, stats and
    predictions of case ``name``."""
    from keras_sparse.table import ShardedHashTable

    world, args = CASES[name]
    model = _model(args)
    layer = model.get_layer("hashed")
    if name != "plain2":  # capacity pressure: the same D shards, one process
        table = ShardedHashTable(
            layer.requested_capacity,
            world,
            eviction=layer.eviction,
            admit_after=layer.admit_after,
            device="cpu",
            seed=layer.table_seed,
        )
        assert table.capacity == layer.num_rows
        layer.table = table
    _train(model, model, 0, world, world)
    stats = layer.stats()
    return {
        "records": _records(model),
        "stats": np.array([stats[s] for s in STATS]),
        "pred": _predict(model, 0, 1),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``([results of each rank], {case: reference}, folder of the files)``;
    rank 0 runs here, after the one-process references."""
    out = tmp_path_factory.mktemp("hash")
    port = _free_port()
    procs = [_launch(rank, port, out) for rank in (1, 2, 3)]
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    try:
        single = {name: _single(name) for name in CASES}  # while others start
        ranks = [_run_rank(0, port, out)]
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.update({k: v})
        logs = _wait(procs)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    ranks += [dict(np.load(out / f"r{rank}.npz")) for rank in (1, 2, 3)]
    return ranks, single, out


def _groups(world):
    return [list(range(first, first + world)) for first in range(0, 4, world)]


def _assert_records(got, want, prefix, rows=True):
    """``got[prefix:name]`` equal ``want[name]``: floats to TOL, the rest
    exactly (keys, scores, admission counts, clock, ...)."""
    for name, value in want.items():
        if name == "kernel" or (name == "record_rows" and not rows):
            continue
        here = got[f"{prefix}:{name}"]
        if np.asarray(value).dtype.kind == "f":
            np.testing.assert_allclose(here, value, atol=TOL, err_msg=name)
        else:
            np.testing.assert_array_equal(here, value, err_msg=name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_training_matches_one_process_key_by_key(runs, name):
    ranks, single, _ = runs
    world = CASES[name][0]
    want = single[name]["records"]
    assert len(want["record_keys"]) > 100
    if name != "plain2":  # capacity pressure, with admission
        assert single[name]["stats"][STATS.index("evictions")] > 0
    assert single[name]["stats"][STATS.index("rejected_admissions")] > 0
    assert len(want["admission_keys"]) > 0  # keys seen once wait
    for result in ranks:
        _assert_records(result, want, name, rows=name != "plain2")
        np.testing.assert_allclose(result[f"{name}:kernel"], want["kernel"], atol=TOL)
        assert bool(result[f"{name}:owned"])  # its shard holds its keys only
        rows = -(-want["table_capacity"] // world)
        assert tuple(result[f"{name}:shape"]) == (rows, DIM)
    for group in _groups(world):  # the shards' counters add up
        total = sum(ranks[r][f"{name}:stats"] for r in group)
        np.testing.assert_array_equal(total, single[name]["stats"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_inference_and_reload_match_one_process(runs, name):
    ranks, single, _ = runs
    world = CASES[name][0]
    for group in _groups(world):
        for what in ("pred", "reloaded"):
            got = np.concatenate([ranks[r][f"{name}:{what}"] for r in group])
            np.testing.assert_allclose(got, single[name]["pred"], atol=TOL)
    for result in ranks:
        assert bool(result[f"{name}:size_kept"])  # inference inserts nothing
        want = dict(single[name]["records"])
        pending = want.pop("admission_keys"), want.pop("admission_sightings")
        reloaded = f"{name}:reloaded"
        _assert_records(result, want, reloaded, rows=name != "plain2")
        # Pending admission counts: a full pending table (its cap: the
        # shard's rows) may drop a few on load, as one process's does.
        keys = result[f"{reloaded}:admission_keys"]
        at = np.searchsorted(pending[0], keys)
        np.testing.assert_array_equal(pending[0][at], keys)
        np.testing.assert_array_equal(
            pending[1][at], result[f"{reloaded}:admission_sightings"]
        )
        assert len(keys) >= 0.9 * len(pending[0])
        if name == "plain2":
            assert len(keys) == len(pending[0])


def test_file_of_two_processes_loads_in_one_and_in_four(runs):
    ranks, single, out = runs
    model = keras.models.load_model(out / "plain2-0.keras")
    want = single["plain2"]
    np.testing.assert_allclose(_predict(model, 0, 1), want["pred"], atol=TOL)
    got = {f"one:{k}": v for k, v in _records(model).items()}
    _assert_records(got, want["records"], "one", rows=False)
    four = np.concatenate([r["plain2:in4"] for r in ranks])
    np.testing.assert_allclose(four, single["plain2"]["pred"], atol=TOL)


def test_an_initializer_without_a_per_key_draw_is_refused(runs):
    for result in runs[0]:
        message = str(result["orthogonal"])
        assert "'ortho'" in message and "Orthogonal" in message, message
        assert "RandomUniform" in message, message


def test_training_outside_ddp_raises_before_inserting_keys(runs):
    for result in runs[0]:
        message = str(result["outside_ddp"])
        assert "'no_ddp'" in message and "DistributedDataParallel" in message
        assert int(result["outside_ddp_keys"]) == 0


def test_a_killed_peer_fails_the_survivor_in_bounded_time():
    """Rank 1 is SIGKILLed mid-training; rank 0 exits non-zero within the
    process group's timeout (15 s) plus start-up, naming the layer."""
    port = _free_port()
    procs = [_launch("dead", rank, port) for rank in (0, 1)]
    start = time.monotonic()
    logs = _wait(procs, timeout=120)
    took = time.monotonic() - start
    assert procs[1].returncode == -signal.SIGKILL, logs[1][-2000:]
    assert procs[0].returncode not in (0, None), logs[0][-2000:]
    assert "step 1" in logs[0]  # it trained before the peer died
    assert "Layer 'hashed'" in logs[0] and "peer process" in logs[0], logs[0][-3000:]
    assert took < 100
