"""Key-sharded hash layers over row stores across torch.distributed
processes (PyTorch, 2 gloo processes): each process's table shard is a
cache of a few rows over its own store, and training equals one process
holding every key (no store), key by key.

The reference is one process on the concatenated batches (weighed as DDP
averages the processes' mean losses, as in tests/test_torch_sharded_hash.py)
with a capacity no key is evicted from; the sharded layers hold 64 rows
(32 per process) for ~300 keys, so every shard keeps evicting keys down to
its store and filling them back. Every key's record (vector, optimizer
slots, LRU/LFU score) must match, and so must predictions (keys without a
row are read from their owners' stores) and the saved file, reloaded in
the two processes and in one. A table with ``cache_rows`` built before
the processes' group is refused.

Each process is a subprocess running this file's ``__main__``; the test
process computes the reference meanwhile.
"""

import os
import sys

import keras
import numpy as np
import pytest

from tests.subprocess_results import free_ports
from tests.subprocess_results import launch_ranks
from tests.subprocess_results import wait_ranks

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="torch.distributed key sharding runs on the PyTorch backend only",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIM, FIELDS, BATCH, STEPS, WORLD, TOL = 4, 2, 32, 10, 2, 1e-5
# name: (optimizer, eviction); one row-wise optimizer, LRU and LFU.
LAYERS = {
    "sgd": ("sgd", "lru"),
    "adagrad": ("adagrad", "lfu"),
    "rowwise": ("rowwise_adagrad", "lru"),
}


# ---------------------------------------------------------------- subprocess
def _data():
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, 301) ** 0.9  # Zipf-like: a long tail evicts
    ranks = rng.choice(300, size=(BATCH * STEPS, FIELDS), p=p / p.sum())
    keys = ranks.astype(np.int64) * 7_919_993_123 + (5 << 33)
    return keys, rng.normal(size=(len(keys), 1)).astype("float32")


def _model(capacity, stores):
    """Every layer on the same keys; ``stores``: layer name -> its store."""
    import keras_sparse as ks

    keras.utils.set_random_seed(0)
    keys = keras.Input((FIELDS,), dtype="int64")
    features = [
        ks.DistributedHashEmbedding(
            DIM, capacity=capacity, combiner="sum", optimizer=optimizer,
            eviction=eviction, store=stores.get(name), name=name,
            embeddings_initializer="random_normal",
        )(keys)
        for name, (optimizer, eviction) in LAYERS.items()
    ]  # fmt: skip
    out = keras.layers.Dense(1, name="head")(keras.layers.Concatenate()(features))
    return keras.Model(keys, out)


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
    """Every layer's saved records (every process's: a collective) by key,
    and the head's kernel."""
    out = {"kernel": keras.ops.convert_to_numpy(model.get_layer("head").kernel)}
    for name in LAYERS:
        saved = {}
        model.get_layer(name).save_own_variables(saved)
        order = np.argsort(saved["record_keys"], kind="stable")
        for k, v in saved.items():
            if k.startswith("record_") and k != "record_rows":
                out[f"{name}/{k}"] = np.asarray(v)[order]
    return out


def _predict(model, rank, world):
    import torch

    probe = _data()[0][: 2 * BATCH]
    b = _bounds(0, len(probe), world)
    out = model(torch.as_tensor(probe[b[rank] : b[rank + 1]]), training=False)
    return out.detach().cpu().numpy()


def _run_rank(rank, port, out):
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import keras_sparse as ks

    # Built alone, trained across the processes: refused in the step.
    ids = keras.Input((FIELDS,), dtype="int64")
    cached = ks.AllToAllDenseEmbedding(
        300, DIM, cache_rows=32, optimizer="sgd", combiner="sum", name="early"
    )
    early = keras.Model(ids, keras.layers.Dense(1)(cached(ids)))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timeout)
    try:
        try:
            DistributedDataParallel(early)(_data()[0][:4] % 300, training=True)
            refused_in_step = "trained"
        except ValueError as error:
            refused_in_step = str(error)
        stores = {"sgd": "host", "adagrad": "host"}
        stores["rowwise"] = ks.store.Disk(os.path.join(out, f"rowwise{rank}"))
        model = _model(64, stores)
        _train(model, DistributedDataParallel(model), rank, WORLD, 1)
        result = {f"stats/{n}": model.get_layer(n).stats() for n in LAYERS}
        result = {
            f"{k}/{s}": np.array(v[s])
            for k, v in result.items()
            for s in ("evictions", "fills", "write_backs", "overflows")
        }
        result["dense_cache_step"] = np.array(refused_in_step)
        result.update(_records(model))
        for name in LAYERS:  # this process's keys: its table's and store's
            result[f"export/{name}"] = np.sort(model.get_layer(name).export()["keys"])
        result["pred"] = _predict(model, rank, WORLD)
        path = os.path.join(out, "sharded.keras")
        model.save(path)  # every process: the records are gathered
        loaded = keras.models.load_model(path)
        result["reloaded_pred"] = _predict(loaded, rank, WORLD)
        result.update({f"reloaded/{k}": v for k, v in _records(loaded).items()})
        try:
            ks.AllToAllDenseEmbedding(
                300, DIM, cache_rows=32, optimizer="sgd", name="cached"
            ).build()
            result["dense_cache"] = np.array("built")
        except ValueError as error:
            result["dense_cache"] = np.array(str(error))
    finally:
        dist.destroy_process_group()
    np.savez(os.path.join(out, f"r{rank}.npz"), **result)


if __name__ == "__main__":
    _run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


# --------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``([results of each rank], reference records, reference predictions,
    folder)``; the reference trains here while the processes run."""
    out = tmp_path_factory.mktemp("stores")
    procs = launch_ranks(__file__, WORLD, free_ports(1)[0], out)
    try:
        reference = _model(4096, {})
        _train(reference, reference, 0, WORLD, WORLD)
        want, want_pred = _records(reference), _predict(reference, 0, 1)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    wait_ranks(procs)
    ranks = [dict(np.load(out / f"r{r}.npz")) for r in range(WORLD)]
    return ranks, want, want_pred, out


def _assert_records(got, want, prefix=""):
    names = {k[len(prefix) :] for k in got if k.startswith(prefix)}
    names = {k for k in names if "/record_" in k and k.split("/")[0] in LAYERS}
    assert names == {k for k in want if "/record_" in k}
    for name, value in want.items():
        here = got[prefix + name]
        if np.asarray(value).dtype.kind == "f":
            np.testing.assert_allclose(here, value, atol=TOL, err_msg=name)
        else:
            np.testing.assert_array_equal(here, value, err_msg=name)


def test_each_process_caches_its_shard_over_its_own_store(runs):
    ranks = runs[0]
    for name in LAYERS:
        for result in ranks:  # each shard evicts and fills its own keys
            assert int(result[f"stats/{name}/evictions"]) >= 20
            assert int(result[f"stats/{name}/fills"]) >= 5
            assert int(result[f"stats/{name}/overflows"]) == 0
            evicted = result[f"stats/{name}/evictions"]
            assert int(result[f"stats/{name}/write_backs"]) == int(evicted)


def test_training_equals_one_process_holding_every_key(runs):
    """Keys, values, slots and scores of every layer (tables and stores),
    and the head, for SGD, Adagrad (LFU) and RowWiseAdagrad (disk store)."""
    ranks, want, _, _ = runs
    for result in ranks:
        _assert_records(result, want)


def test_each_process_exports_its_shards_table_and_store_keys(runs):
    from keras_sparse.table import owner_of

    ranks, want, _, _ = runs
    for name in LAYERS:
        keys = [r[f"export/{name}"] for r in ranks]
        for rank, mine in enumerate(keys):
            assert (owner_of(mine, WORLD) == rank).all()
        got = np.sort(np.concatenate(keys))
        np.testing.assert_array_equal(got, want[f"{name}/record_keys"])


def test_predictions_read_evicted_keys_from_their_owners_stores(runs):
    ranks, _, want_pred, _ = runs
    got = np.concatenate([r["pred"] for r in ranks])
    np.testing.assert_allclose(got, want_pred, atol=TOL)


def test_saved_file_holds_every_row_in_two_processes_and_in_one(runs):
    ranks, want, want_pred, out = runs
    got = np.concatenate([r["reloaded_pred"] for r in ranks])
    np.testing.assert_allclose(got, want_pred, atol=TOL)
    for result in ranks:
        _assert_records(result, want, "reloaded/")
    one = keras.models.load_model(out / "sharded.keras")
    np.testing.assert_allclose(_predict(one, 0, 1), want_pred, atol=TOL)
    _assert_records(_records(one), want)


def test_a_cached_dense_table_built_alone_is_refused_across_processes(runs):
    """A table with ``cache_rows`` built in each process before
    init_process_group holds a store of its own seed in each: refused in
    the step (tests/test_torch_ddp_cache.py trains the ones built after)."""
    for result in runs[0]:
        message = str(result["dense_cache_step"])
        assert "'early'" in message and "`cache_rows`" in message, message
        assert "torch.distributed with 2 processes" in message, message
        assert "copies differ" in message, message
        assert str(result["dense_cache"]) == "built"
