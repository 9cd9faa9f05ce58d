"""torch DistributedDataParallel (PyTorch): sparse-optimizer layers trained
by 2 gloo processes on CPU end with the weights one process gets from the
concatenated batches (row regularizer included); DistributedHashEmbedding
and a multi-process run without DDP raise clear errors.

Each process is a subprocess running this file's ``__main__``: it trains
every case with a plain torch loop (the way Keras models train under DDP)
and saves its final weights; the test process meanwhile trains the same
cases alone on the whole batches.
"""

import json
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.subprocess_results import wait_ranks

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="DistributedDataParallel runs on the PyTorch backend only",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, STEPS, TOL = 8, 6, 1e-5
# (optimizer, combiner) of an AllToAllDenseEmbedding, or a collection, or a
# layer with a row regularizer (its penalty covers a process's rows only).
CASES = [
    ("sgd", None),
    ("adagrad", "sum"),
    ("adam", "sum"),
    ("collection", None),
    ("regularized", "sum"),
]


# ---------------------------------------------------------------- subprocess
def _model(optimizer, combiner):
    import keras_sparse as ks

    keras.utils.set_random_seed(0)
    if optimizer == "collection":
        tables = {
            "a": ks.TableConfig(40, 4, combiner="sum"),
            "b": ks.TableConfig(30, 2),
        }
        inputs = {"a": keras.Input((3,), dtype="int32", name="a")}
        inputs["b"] = keras.Input((2,), dtype="int32", name="b")
        out = ks.EmbeddingCollection(tables, optimizer="adam", name="emb")(inputs)
        flat = [keras.layers.Flatten()(out[n]) for n in ("a", "b")]
        x = keras.layers.Concatenate()(flat)
    else:
        regularized = optimizer == "regularized"
        inputs = keras.Input((3,), dtype="int32")
        emb = ks.AllToAllDenseEmbedding(
            40,
            4,
            combiner=combiner,
            optimizer="sgd" if regularized else optimizer,
            embeddings_regularizer="l2" if regularized else None,
            name="emb",
        )
        x = keras.layers.Flatten()(emb(inputs))
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


def _data(collection, samples):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 30, (samples, 3)).astype("int32")
    ids[:, 0] = 5  # a row every process touches in every step
    x = {"a": ids, "b": ids[:, 1:]} if collection else ids
    return x, rng.normal(size=(samples, 1)).astype("float32")


def _local_slices(samples, rank, world):
    """This process's slice of each global batch (rank order)."""
    for start in range(0, samples, BATCH):
        stop = min(start + BATCH, samples)
        bounds = np.linspace(start, stop, world + 1).round().astype(int)
        yield slice(bounds[rank], bounds[rank + 1])


def _train(model, call, x, y, rank, world):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)
    for part in _local_slices(len(y), rank, world):
        xs = keras.tree.map_structure(lambda a, p=part: torch.as_tensor(a[p]), x)
        optimizer.zero_grad()
        loss = torch.mean((call(xs, training=True) - torch.as_tensor(y[part])) ** 2)
        loss = loss + sum(model.losses)  # the layers' added losses
        loss.backward()
        optimizer.step()


def _train_case(case, samples, rank, world):
    from torch.nn.parallel import DistributedDataParallel

    optimizer, combiner = case
    model = _model(optimizer, combiner)
    call = DistributedDataParallel(model) if world > 1 else model
    x, y = _data(optimizer == "collection", samples)
    _train(model, call, x, y, rank, world)
    return {v.path: np.asarray(keras.ops.convert_to_numpy(v)) for v in model.weights}


def _caught(fn):
    try:
        fn()
    except (RuntimeError, NotImplementedError) as error:
        return str(error)
    return None


def _hash_case(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    import keras_sparse as ks

    ids = keras.Input((3,), dtype="int64")
    # "data": one key map per process (the default "auto" key-shards the
    # layer across the processes, tests/test_torch_sharded_hash.py).
    emb = ks.DistributedHashEmbedding(
        4, capacity=64, optimizer="sgd", sharding="data", name="hashed"
    )
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))
    x, y = _data(False, BATCH * world)
    error = _caught(
        lambda: _train(model, DistributedDataParallel(model), x, y, rank, world)
    )
    # The refusal comes before the layer changes anything.
    steps = int(keras.ops.convert_to_numpy(emb.sparse_iterations))
    return f"{error} [size={emb.table.size} steps={steps}]"


def _no_ddp_case(rank, world):
    model = _model("sgd", None)
    x, y = _data(False, BATCH * world)
    error = _caught(lambda: _train(model, model, x, y, rank, world))
    layer = model.get_layer("emb")
    steps = int(keras.ops.convert_to_numpy(layer.sparse_iterations))
    return f"{error} [steps={steps}]"


def _train_all(rank, world):
    """Final weights of every case, keyed "case:variable path"."""
    weights = {}
    for case in CASES:
        for name, value in _train_case(case, BATCH * STEPS, rank, world).items():
            weights[f"{case[0]}-{case[1]}:{name}"] = value
    # A last global batch of 5 splits 3/2: DDP then averages unequal means
    # (unlike one process), so only the processes' copies are compared.
    for name, value in _train_case(("adagrad", "sum"), 21, rank, world).items():
        weights[f"uneven:{name}"] = value
    return weights


def _main(rank, world, port, out):
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A peer that died fails the survivor's collectives within a minute.
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    weights = _train_all(rank, world)
    errors = {"no_ddp": _no_ddp_case(rank, world), "hash": _hash_case(rank, world)}
    dist.destroy_process_group()
    np.savez(os.path.join(out, f"rank{rank}.npz"), **weights)
    with open(os.path.join(out, f"errors{rank}.json"), "w") as f:
        json.dump(errors, f)


if __name__ == "__main__":
    _main(*(int(a) for a in sys.argv[1:4]), sys.argv[4])


# --------------------------------------------------------------------- tests
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(rank, world, port, out):
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=path)
    args = [sys.executable, os.path.abspath(__file__), str(rank), str(world)]
    return subprocess.Popen(
        args + [str(port), str(out)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(weights, errors) of ranks 0 and 1 of 2 processes, weights of 1 process."""
    out = tmp_path_factory.mktemp("ddp")
    port = _free_port()
    procs = [_launch(rank, 2, port, out) for rank in (0, 1)]
    try:
        single = _train_all(0, 1)  # meanwhile, here: one process, whole batches
    except BaseException:
        for p in procs:
            p.kill()
        raise
    wait_ranks(procs, timeout=240)
    ranks = []
    for rank in (0, 1):
        with open(out / f"errors{rank}.json") as f:
            ranks.append((dict(np.load(out / f"rank{rank}.npz")), json.load(f)))
    return ranks, single


def _gaps(a, b, prefix):
    keys = [k for k in a if k.startswith(prefix + ":")]
    assert any("embeddings" in k or "data" in k for k in keys), keys
    return {k: float(np.abs(a[k] - b[k]).max()) for k in keys}


@pytest.mark.parametrize("optimizer,combiner", CASES)
def test_two_processes_match_one(runs, optimizer, combiner):
    ((rank0, _), (rank1, _)), single = runs
    prefix = f"{optimizer}-{combiner}"
    for rank in (rank0, rank1):
        bad = {k: v for k, v in _gaps(rank, single, prefix).items() if v > TOL}
        assert not bad, bad


def test_uneven_last_batch_keeps_copies_identical(runs):
    ((rank0, _), (rank1, _)), _ = runs
    assert max(_gaps(rank0, rank1, "uneven").values()) == 0.0


def test_hash_embedding_raises(runs):
    for _, errors in runs[0]:
        message = errors["hash"]
        assert "'hashed'" in message and "DistributedDataParallel" in message
        assert "sharding='key'" in message, message
        assert message.endswith("[size=0 steps=0]"), message


def test_training_without_ddp_raises(runs):
    for _, errors in runs[0]:
        message = errors["no_ddp"]
        assert "'emb'" in message and "DistributedDataParallel" in message
        assert message.endswith("[steps=0]"), message
