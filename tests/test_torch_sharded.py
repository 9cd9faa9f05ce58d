"""Tables sharded across torch.distributed processes (PyTorch): row and
column sharding over 2 and 4 gloo processes, trained by a torch loop over
the DistributedDataParallel model, end with the tables, slots and dense
weights of one process trained on the global batches (DDP's averaging of
the processes' mean losses); each process holds only its part; inference,
``model.save`` / ``load_model`` and files moving between 1, 2 and 4
processes give the one-process predictions; refused cases raise clear
errors.

Each process is a subprocess running this file's ``__main__`` (as in
tests/test_torch_ddp.py): 2 processes first, then 4 (which load the files
of the 2); the test process meanwhile trains the cases alone.
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
    reason="torch.distributed sharding runs on the PyTorch backend only",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, DIM, BATCH, TOL = 41, 8, 8, 1e-5
# (strategy, optimizer, samples): 21 samples end on an uneven batch of 5.
CASES = {
    2: [("row", "sgd", 48), ("column", "adagrad", 48), ("row", "adam", 21)],
    4: [("row", "adagrad", 48), ("column", "adam", 21)],
}


# ---------------------------------------------------------------- subprocess
def _model(strategy, optimizer):
    import keras_sparse as ks

    keras.utils.set_random_seed(0)
    ids = keras.Input((3,), dtype="int32")
    emb = ks.AllToAllDenseEmbedding(
        ROWS, DIM, combiner="sum", optimizer=optimizer, sharding=strategy, name="emb"
    )
    return keras.Model(ids, keras.layers.Dense(1, name="head")(emb(ids)))


def _data(samples):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, (samples, 3)).astype("int32")
    ids[:, 0] = 5  # a row every process touches in every step
    ids[0, 1] = ROWS - 1  # the last row (next to a part's padding)
    return ids, rng.normal(size=(samples, 1)).astype("float32")


def _bounds(start, stop, world):
    return np.linspace(start, stop, world + 1).round().astype(int)


def _train(model, call, x, y, rank, world, ranks):
    """``rank`` trains on its slices; ``ranks`` (one process: ``world``)
    weighs the global batch's slices as DDP averages their mean losses."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)
    for start in range(0, len(y), BATCH):
        b = _bounds(start, min(start + BATCH, len(y)), world)
        lo, hi = (b[rank], b[rank + 1]) if ranks == 1 else (b[0], b[-1])
        optimizer.zero_grad()
        err = (
            call(torch.as_tensor(x[lo:hi]), training=True) - torch.as_tensor(y[lo:hi])
        ) ** 2
        cuts = [0] if ranks == 1 else list(b[:-1] - lo)
        ends = [hi - lo] if ranks == 1 else list(b[1:] - lo)
        loss = sum(err[a:e].mean() for a, e in zip(cuts, ends)) / len(cuts)
        loss.backward()
        optimizer.step()


def _state(model):
    """The layer's saved state (whole, unpadded tables) and the head."""
    store = {}
    model.get_layer("emb").save_own_variables(store)
    head = model.get_layer("head")
    store.update(kernel=head.kernel.numpy(), bias=head.bias.numpy())
    return {k: np.asarray(v) for k, v in store.items()}


def _predict(model, rank, world):
    import torch

    x, _ = _data(16)
    b = _bounds(0, 16, world)
    out = model(torch.as_tensor(x[b[rank] : b[rank + 1]]), training=False)
    return out.detach().numpy()


def _caught(fn):
    try:
        fn()
    except (ValueError, RuntimeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _refusals(rank, world):
    import keras_sparse as ks

    def layer(**kw):
        args = dict(optimizer="adagrad", sharding="column", name="bad")
        ks.AllToAllDenseEmbedding(ROWS, **{**args, **kw}).build()

    def collection():
        # (sharded collections: tests/test_collection_sharded.py)
        tables = {"a": ks.TableConfig(ROWS, DIM)}
        ks.EmbeddingCollection(tables, optimizer=None, sharding="row", name="col")(
            {"a": np.zeros((2, 1), "int32")}
        )

    def no_ddp():
        model = _model("row", "sgd")
        x, y = _data(BATCH)
        _train(model, model, x, y, rank, world, 1)

    return {
        "dim": _caught(lambda: layer(output_dim=3)),
        "rowwise": _caught(lambda: layer(output_dim=DIM, optimizer="rowwise_adagrad")),
        "constraint": _caught(
            lambda: layer(output_dim=DIM, embeddings_constraint="non_neg")
        ),
        "dense": _caught(lambda: layer(output_dim=DIM, optimizer=None, sharding="row")),
        "collection": _caught(collection),
        "table": _caught(lambda: layer(output_dim=DIM, sharding="table")),
        "no_ddp": _caught(no_ddp),
    }


def _run_case(case, rank, world, out, group=None):
    from torch.nn.parallel import DistributedDataParallel

    strategy, optimizer, samples = case
    key = f"{strategy}-{optimizer}-{world}"
    model = _model(strategy, optimizer)
    x, y = _data(samples)
    ddp = DistributedDataParallel(model, process_group=group)
    with _counted_exchanges() as calls:
        _train(model, ddp, x, y, rank, world, 1)
    result = {f"{key}:{k}": v for k, v in _state(model).items()}
    result[f"{key}:exchanges"] = np.array(len(calls))
    result[f"{key}:floats"] = np.array(sum(calls))
    result[f"{key}:shape"] = np.array(model.get_layer("emb").embeddings.shape)
    result[f"{key}:pred"] = _predict(model, rank, world)
    # Every process saves (the tables are all-gathered); each group of 2
    # to its own file.
    path = os.path.join(out, f"{key}-{_group_of(world)}.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    result[f"{key}:reloaded"] = _predict(loaded, rank, world)
    model.save_weights(path.replace(".keras", ".weights.h5"))
    fresh = _model(strategy, optimizer)  # untrained: the load replaces all
    fresh.load_weights(path.replace(".keras", ".weights.h5"))
    result[f"{key}:weights"] = _predict(fresh, rank, world)
    return result


class _counted_exchanges:
    """Counts the ``all_to_all_single`` calls made inside the block."""

    def __enter__(self):
        import torch.distributed as dist

        self.calls, self.real = [], dist.all_to_all_single

        def counted(out, sent, *args, **kwargs):
            # Rows and gradients are the float exchanges: their elements.
            self.calls.append(sent.numel() if sent.is_floating_point() else 0)
            return self.real(out, sent, *args, **kwargs)

        dist.all_to_all_single = counted
        return self.calls

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_to_all_single = self.real


def _wrapped_case(rank, group, ignore):
    """The row-sgd model inside a plain torch module, which DDP asks for the
    parameters to ignore instead of the Keras model; ``ignore``: tell it
    with `torch_sharded_parameter_names`. Returns (state, error)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import keras_sparse as ks

    class Wrapper(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x, training=None):
            return self.model(x, training=training)

    model = _model("row", "sgd")
    module = Wrapper(model)
    if ignore:
        names = ks.sharding.torch_sharded_parameter_names(module)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, names
        )
    ddp = DistributedDataParallel(module, process_group=group)
    x, y = _data(48)
    error = _caught(lambda: _train(model, ddp, x, y, rank, 2, 1))
    return _state(model), error


def _group_of(world):
    import torch.distributed as dist

    return dist.get_rank() // world


def _load_other(out, rank, world, saved_by):
    """Predictions here of each file ``saved_by`` processes wrote."""
    result = {}
    for case in CASES[saved_by]:
        key = f"{case[0]}-{case[1]}-{saved_by}"
        model = keras.models.load_model(os.path.join(out, f"{key}-0.keras"))
        result[f"{key}:in{world}"] = _predict(model, rank, world)
    return result


def _run_rank(rank, port, out):
    """Rank ``rank`` of 4 processes; the 2-process cases run in two groups
    of 2 (ranks 0-1 and 2-3, named for the tables by
    `set_torch_process_group`). Returns ``(results, errors)``."""
    import datetime

    import torch.distributed as dist

    import keras_sparse as ks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A dead peer fails the others' exchanges within a minute (the tables'
    # own group takes the default group's timeout).
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timeout)
    try:
        halves = [dist.new_group(r, timeout=timeout) for r in ([0, 1], [2, 3])]
        half, result = halves[rank // 2], {}
        ks.sharding.set_torch_process_group(half)
        for case in CASES[2]:
            result.update(_run_case(case, rank % 2, 2, out, half))
        errors = _refusals(rank % 2, 2)
        errors["wrapped"] = _wrapped_case(rank % 2, half, False)[1]
        state, errors["helper"] = _wrapped_case(rank % 2, half, True)
        result.update({f"wrapped:{k}": v for k, v in state.items()})
        ks.sharding.set_torch_process_group(None)
        for case in CASES[4]:
            result.update(_run_case(case, rank, 4, out))
        result.update(_load_other(out, rank, 4, 2))
        ks.sharding.set_torch_process_group(half)
        result.update(_load_other(out, rank % 2, 2, 4))
    finally:
        ks.sharding.set_torch_process_group(None)
        dist.destroy_process_group()
    return result, errors


if __name__ == "__main__":
    result, errors = _run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    np.savez(os.path.join(sys.argv[3], f"r{sys.argv[1]}.npz"), **result)
    with open(os.path.join(sys.argv[3], f"errors{sys.argv[1]}.json"), "w") as f:
        json.dump(errors, f)


# --------------------------------------------------------------------- tests
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out, port):
    """Ranks 1 to 3 (the test process is rank 0)."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=path)
    script = os.path.abspath(__file__)
    return [
        subprocess.Popen(
            [sys.executable, script, str(rank), str(port), str(out)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (1, 2, 3)
    ]


def _wait(procs):
    wait_ranks(procs, timeout=240)


def _single(world):
    """One process on the global batches: state and predictions per case."""
    result = {}
    for strategy, optimizer, samples in CASES[world]:
        key = f"{strategy}-{optimizer}-{world}"
        model = _model(strategy, optimizer)
        x, y = _data(samples)
        _train(model, model, x, y, 0, world, world)
        result.update({f"{key}:{k}": v for k, v in _state(model).items()})
        result[f"{key}:pred"] = _predict(model, 0, 1)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``([(results, errors) of each rank], one-process results, folder of
    the files)``; rank 0 runs here, after the one-process reference."""
    out = tmp_path_factory.mktemp("sharded")
    port = _free_port()
    procs = _launch(out, port)
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    try:
        single = {**_single(2), **_single(4)}  # while the others start
        ranks = [_run_rank(0, port, out)]
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.update({k: v})
        _wait(procs)
    for rank in (1, 2, 3):
        with open(out / f"errors{rank}.json") as f:
            ranks.append((dict(np.load(out / f"r{rank}.npz")), json.load(f)))
    return ranks, single, out


def _groups(world):
    """The ranks of each group of ``world`` processes."""
    return [list(range(first, first + world)) for first in range(0, 4, world)]


def _all_cases():
    return [(world, case) for world in (2, 4) for case in CASES[world]]


@pytest.mark.parametrize("world,case", _all_cases())
def test_training_matches_one_process(runs, world, case):
    ranks, single, _ = runs
    key = f"{case[0]}-{case[1]}-{world}"
    names = [k for k in single if k.startswith(key + ":") and not k.endswith("pred")]
    assert {f"{key}:0", f"{key}:kernel"} <= set(names)  # the table, the head
    if case[1] != "sgd":
        assert any(":slot_" in k for k in names), names
    for result, _ in ranks:
        gaps = {k: float(np.abs(result[k] - single[k]).max()) for k in names}
        assert max(gaps.values()) <= TOL, gaps
        assert result[f"{key}:0"].shape == (ROWS, DIM)  # whole and unpadded


def test_model_inside_a_torch_module_needs_the_names_ddp_ignores(runs):
    """Without them DDP gives every process rank 0's part: the first training
    call raises; with them the model trains as the Keras model does."""
    ranks, single, _ = runs
    for result, errors in ranks:
        message = errors["wrapped"]
        assert message is not None and "'emb'" in message, message
        assert "torch_sharded_parameter_names" in message, message
        assert errors["helper"] is None, errors["helper"]
        for name in ("0", "kernel"):
            got, want = result[f"wrapped:{name}"], single[f"row-sgd-2:{name}"]
            np.testing.assert_allclose(got, want, atol=TOL)


@pytest.mark.parametrize("world,case", _all_cases())
def test_each_process_holds_its_part(runs, world, case):
    ranks, _, _ = runs
    key = f"{case[0]}-{case[1]}-{world}"
    part = (-(-ROWS // world), DIM) if case[0] == "row" else (ROWS, DIM // world)
    for result, _ in ranks:
        assert tuple(result[f"{key}:shape"]) == part


def _gathered(ranks, world, name):
    """``name``'s predictions of each group of ``world``, in rank order."""
    return [np.concatenate([ranks[r][0][name] for r in g]) for g in _groups(world)]


@pytest.mark.parametrize("world,case", _all_cases())
def test_inference_save_and_load_in_the_processes(runs, world, case):
    ranks, single, _ = runs
    key = f"{case[0]}-{case[1]}-{world}"
    for what in ("pred", "reloaded", "weights"):
        for got in _gathered(ranks, world, f"{key}:{what}"):
            np.testing.assert_allclose(got, single[f"{key}:pred"], atol=TOL)


def _reference_exchanges(world, case):
    """All-to-alls a training run needs: per step ids (with their counts),
    rows and gradients, and once more for the ids past a block's capacity;
    the capacity every process keeps is a quarter above the last step's
    largest block (at most the most ids a process sent), kept while that
    block is over half of it."""
    strategy, _, samples = case
    x, _ = _data(samples)
    part, capacity, total = -(-ROWS // world), 0, 0
    for start in range(0, samples, BATCH):
        b = _bounds(start, min(start + BATCH, samples), world)
        # Each process sends its distinct ids once.
        ids = [np.unique(x[b[r] : b[r + 1]]) for r in range(world)]
        if strategy == "row":
            blocks = [np.bincount(i // part, minlength=world) for i in ids]
            need = max(int(c.max()) for c in blocks)
        else:  # every process's ids go to every process
            need = max(len(i) for i in ids)
        total += 3 + (need > capacity)
        if need > capacity or 2 * need < capacity:
            capacity = min(max(len(i) for i in ids), -(-need * 5 // 4))
    return total


@pytest.mark.parametrize("world,case", _all_cases())
def test_a_step_exchanges_ids_with_their_counts_in_one_collective(runs, world, case):
    """Three all-to-alls per training step (ids and counts, rows, gradients)
    once a step's ids fit the capacity the previous step agreed."""
    ranks, _, _ = runs
    key = f"{case[0]}-{case[1]}-{world}"
    want = _reference_exchanges(world, case)
    steps = -(-case[2] // BATCH)
    assert want < 4 * steps  # what a separate exchange of counts would take
    for result, _ in ranks:
        assert int(result[f"{key}:exchanges"]) == want


def _distinct_per_step(world, samples):
    """Each step's distinct ids of every process, summed over processes."""
    x, _ = _data(samples)
    total = 0
    for start in range(0, samples, BATCH):
        b = _bounds(start, min(start + BATCH, samples), world)
        total += sum(len(np.unique(x[b[r] : b[r + 1]])) for r in range(world))
    return total


@pytest.mark.parametrize("world,case", _all_cases())
def test_each_process_exchanges_its_distinct_ids_once(runs, world, case):
    """Rows back and gradients out carry one ``dim``-wide row per distinct
    id of each process (id 5 repeats in every sample), summed over a
    group: row sharding's owners serve the ids whole, column sharding's
    every process serves its ``dim / D`` columns of every id."""
    ranks, _, _ = runs
    key = f"{case[0]}-{case[1]}-{world}"
    want = 2 * DIM * _distinct_per_step(world, case[2])
    per_position = 2 * DIM * case[2] * 3
    assert want < per_position
    for group in _groups(world):
        got = sum(int(ranks[r][0][f"{key}:floats"]) for r in group)
        assert got == want, (got, want, per_position)


@pytest.mark.parametrize("capacity", [0, 2, 3, 9])
def test_id_blocks_split_at_the_capacity_rejoin_in_order(capacity):
    """Per-peer blocks cut at ``capacity`` (first exchange) and the rest
    (second) give each peer its ids in their order, whatever the cut."""
    import torch

    from keras_sparse.sharding.torch_sharded_lookup import id_blocks

    want = [[7, 1, 4], [], [2, 9, 9, 5, 0], [6]]
    src = torch.tensor([i for block in want for i in block], dtype=torch.int32)
    counts = torch.tensor([len(block) for block in want])
    starts = torch.cumsum(counts, 0) - counts
    need = int(counts.max())
    first = id_blocks(src, counts, starts, 0, capacity)
    rest = id_blocks(src, counts, starts, capacity, max(need - capacity, 0))
    assert first.shape == (4, capacity)
    joined = torch.cat([first, rest], 1)
    got = [joined[p, : len(block)].tolist() for p, block in enumerate(want)]
    assert got == want
    assert not joined[torch.arange(joined.shape[1]) >= counts[:, None]].any()


@pytest.mark.parametrize("saved_by,loaded_in", [(2, 1), (2, 4), (4, 1), (4, 2)])
def test_files_load_on_any_process_count(runs, saved_by, loaded_in):
    ranks, single, out = runs
    for strategy, optimizer, _ in CASES[saved_by]:
        key = f"{strategy}-{optimizer}-{saved_by}"
        if loaded_in == 1:
            model = keras.models.load_model(out / f"{key}-0.keras")
            found = [_predict(model, 0, 1)]
        else:
            found = _gathered(ranks, loaded_in, f"{key}:in{loaded_in}")
        for got in found:
            np.testing.assert_allclose(got, single[f"{key}:pred"], atol=TOL)


@pytest.mark.parametrize(
    "case,words",
    [
        ("dim", ["'bad'", "output_dim (3)", "2 processes"]),
        ("rowwise", ["'bad'", "rowwise_adagrad", "sharding='row'"]),
        ("constraint", ["'bad'", "embeddings_constraint", "sharding='row'"]),
        ("dense", ["'bad'", "sparse optimizer", "optimizer="]),
        ("collection", ["'col'", "'col/a'", "sparse optimizer", "`optimizer`"]),
        ("no_ddp", ["'emb'", "DistributedDataParallel"]),
        ("table", ["'bad'", "EmbeddingCollection", "'row'"]),
    ],
)
def test_refused_cases_raise_clear_errors(runs, case, words):
    ranks, _, _ = runs
    for _, errors in ranks:
        message = errors[case]
        assert message is not None and all(w in message for w in words), message
