"""Tables with ``cache_rows`` trained by torch.distributed processes under
DistributedDataParallel (PyTorch, 2 gloo processes) train as the same
tables without a cache under the same processes.

Each process holds a copy of a 20-row cache of a 300-id table over its
own store (`keras_sparse.layers.row_storage.cache_processes`); batches of
16 ids spread over the 300 keep filling and writing back rows. The
reference is the same model without ``cache_rows`` in the same processes,
from the same table (the cached layer's, drawn from an unseeded
initializer: one seed for both processes) and head; every id's values and
optimizer slots (after a flush) must match, and the two processes' copies
must be identical. Copies that differ (a layer built before
init_process_group, a disk folder two processes share) are refused in the
step, before the cache changes, and so is training outside DDP.

Each process is a subprocess running this file's ``__main__``.
"""

import os
import sys

import keras
import numpy as np
import pytest

from tests import cached_tables
from tests.subprocess_results import free_ports
from tests.subprocess_results import launch_ranks
from tests.subprocess_results import wait_ranks

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="torch.distributed runs on the PyTorch backend only",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE, BATCH, STEPS, WORLD, TOL = 20, 8, 10, 2, 1e-6
CASES = [("dense", "sgd"), ("dense", "adagrad"), ("collection", "sgd")]
CASES += [("collection", "adagrad")]


# ---------------------------------------------------------------- subprocess
def _data():
    return cached_tables.data(BATCH, STEPS)


def _model(kind, optimizer, cache, seed=3):
    keras.utils.set_random_seed(seed)
    return cached_tables.build(kind, optimizer, cache)


def _train(model, call, kind, rank):
    import torch

    x, y = _data()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)
    for start in range(0, len(y), BATCH):
        lo = start + rank * BATCH // WORLD
        part = slice(lo, lo + BATCH // WORLD)
        xs = {k: torch.as_tensor(v[part]) for k, v in x.items()}
        optimizer.zero_grad()
        out = call(xs["a"] if kind == "dense" else xs, training=True)
        loss = torch.mean((out - torch.as_tensor(y[part])) ** 2)
        loss.backward()
        optimizer.step()


def _case(kind, optimizer, rank, out):
    from torch.nn.parallel import DistributedDataParallel

    import keras_sparse as ks

    store = "host"
    if optimizer == "adagrad" and kind == "dense":
        store = ks.store.Disk(os.path.join(out, f"rank{rank}"))
    # Each process draws other seeds: the stores share one all the same.
    cached = {"cache_rows": CACHE, "store": store}
    model, layer = _model(kind, optimizer, cached, seed=3 + rank)
    plain, plain_layer = _model(kind, optimizer, {})
    if kind == "dense":
        plain_layer.embeddings.assign(layer.get_weights()[0])
    else:
        plain_layer.set_table("a", layer.get_table("a"))
    plain.get_layer("out").set_weights(model.get_layer("out").get_weights())
    for m in (model, plain):
        _train(m, DistributedDataParallel(m), kind, rank)
    cache = layer.row_cache if kind == "dense" else layer.table_caches["a"]
    stats = cache.stats()
    got, want = cached_tables.state(kind, layer), cached_tables.state(kind, plain_layer)
    result = {f"got/{k}": v for k, v in got.items()}
    result.update({f"want/{k}": v for k, v in want.items()})
    result["fills"] = np.array(stats["fills"])
    result["write_backs"] = np.array(stats["write_backs"])
    result["head"] = model.get_layer("out").get_weights()[0]
    result["plain_head"] = plain.get_layer("out").get_weights()[0]
    return result


def _refusals(rank, out, early):
    """The errors of copies that differ: ``early`` built before
    init_process_group (its own seed), a disk folder both processes share;
    each with whether the cache stayed empty."""
    from torch.nn.parallel import DistributedDataParallel

    import keras_sparse as ks

    shared = ks.store.Disk(os.path.join(out, "shared"))
    model, layer = _model("dense", "sgd", {"cache_rows": CACHE, "store": shared})
    found = {}
    for key, (m, emb) in (("early", early), ("shared", (model, layer))):
        try:
            _train(m, DistributedDataParallel(m), "dense", rank)
            found[key] = np.array("trained")
        except ValueError as error:
            found[key] = np.array(f"{error} [size={emb.row_cache.slot_map.size}]")
    # Outside DDP each process would train on its own part: refused.
    model, layer = _model("dense", "sgd", {"cache_rows": CACHE, "store": "host"})
    try:
        _train(model, model, "dense", rank)
        found["no_ddp"] = np.array("trained")
    except RuntimeError as error:
        found["no_ddp"] = np.array(f"{error} [size={layer.row_cache.slot_map.size}]")
    return found


def _run_rank(rank, port, out):
    import datetime

    import torch.distributed as dist

    cached = {"cache_rows": CACHE, "store": "host"}
    early = _model("dense", "sgd", cached, seed=rank)  # a store of its own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timeout)
    result = {}
    try:
        for kind, optimizer in CASES:
            for k, v in _case(kind, optimizer, rank, out).items():
                result[f"{kind}-{optimizer}:{k}"] = v
        result.update(_refusals(rank, out, early))
    finally:
        dist.destroy_process_group()
    np.savez(os.path.join(out, f"r{rank}.npz"), **result)


if __name__ == "__main__":
    _run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


# --------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_cache")
    wait_ranks(launch_ranks(__file__, WORLD, free_ports(1)[0], out))
    return [dict(np.load(out / f"r{r}.npz")) for r in range(WORLD)]


@pytest.mark.parametrize("kind,optimizer", CASES)
def test_cached_table_equals_the_table_without_a_cache(ranks, kind, optimizer):
    prefix = f"{kind}-{optimizer}:"
    for result in ranks:
        assert int(result[prefix + "fills"]) > 3 * CACHE
        assert int(result[prefix + "write_backs"]) > 2 * CACHE
        names = cached_tables.entries(result, prefix)
        assert len(names) >= 2, names
        for name in names:
            np.testing.assert_allclose(
                result[f"{prefix}got/{name}"], result[f"{prefix}want/{name}"],
                atol=TOL, rtol=0, err_msg=name,
            )  # fmt: skip
        np.testing.assert_allclose(
            result[prefix + "head"], result[prefix + "plain_head"], atol=TOL
        )


def test_the_processes_copies_are_identical(ranks):
    cached_tables.assert_copies_identical(ranks)


def test_copies_that_differ_are_refused_before_the_cache_changes(ranks):
    for result in ranks:
        where = "torch.distributed with 2 processes"
        cached_tables.assert_copies_refused(result, "early", where)
        message = str(result["no_ddp"])
        assert "'ids'" in message and "DistributedDataParallel" in message
        assert message.endswith("[size=0]"), message
