"""Tables with ``cache_rows`` under a Keras distribution over 2 JAX processes
x 4 CPU devices (gloo) train as the same tables without a cache under the
same distribution.

Each process holds a copy of a 40-row cache of a 300-id table over its own
store (`keras_sparse.layers.row_storage.cache_jax_processes`); global
batches of 16 samples spread over the 300 ids keep filling and writing
back rows. The reference is the same model without ``cache_rows`` in the
same processes, from the same table and head; every id's values, optimizer
slots and step count (after a flush) must match exactly, predictions too,
and the two processes' copies must be identical. An unseeded initializer
gets one seed in both processes; copies that differ (seeds that differ, a
disk folder both share) are refused before ``fit`` takes the state.

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
    keras.backend.backend() != "jax", reason="JAX processes"
)

CACHE, BATCH, STEPS, WORLD = 40, 16, 12, 2
CASES = [("dense", "sgd"), ("dense", "adagrad"), ("collection", "adagrad")]


# ---------------------------------------------------------------- subprocess
def _local(array, rank):
    """This process's half of every global batch of ``array``."""
    steps = array.reshape(-1, BATCH, *array.shape[1:])
    half = BATCH // WORLD
    return steps[:, rank * half : (rank + 1) * half].reshape(-1, *array.shape[1:])


def _train(kind, optimizer, cache, start, rank):
    """``(state, inference loss, layer, start)`` of a model trained on this
    process's part of the batches from ``start`` (None: the model's own)."""
    keras.utils.set_random_seed(3)
    model, layer = cached_tables.build(kind, optimizer, cache)
    model.compile(optimizer="sgd", loss="mse")
    start = cached_tables.start_from(model, layer, kind, start)
    x, y = cached_tables.data(BATCH, STEPS)
    x = {k: _local(v, rank) for k, v in x.items()}
    x = x["a"] if kind == "dense" else x
    half = BATCH // WORLD
    model.fit(x, _local(y, rank), batch_size=half, shuffle=False, verbose=0)
    # Inference: Keras' predict cannot fetch outputs spanning processes,
    # evaluate's loss (a compiled read-only step) can.
    probe, target = cached_tables.data(BATCH, STEPS, seed=1)
    probe = {k: _local(v, rank) for k, v in probe.items()}
    probe = probe["a"] if kind == "dense" else probe
    loss = model.evaluate(probe, _local(target, rank), batch_size=half, verbose=0)
    return cached_tables.state(kind, layer), np.array(loss), layer, start


def _case(kind, optimizer, rank, out):
    import keras_sparse as ks

    store = "host"
    if optimizer == "adagrad" and kind == "dense":
        store = ks.store.Disk(os.path.join(out, f"rank{rank}"))
    cached = {"cache_rows": CACHE, "store": store}
    got, got_pred, layer, start = _train(kind, optimizer, cached, None, rank)
    stats = layer.stats() if kind == "dense" else layer.stats("a")
    want, want_pred, _, _ = _train(kind, optimizer, {}, start, rank)
    result = {f"got/{k}": v for k, v in got.items()}
    result.update({f"want/{k}": v for k, v in want.items()})
    result.update(got_pred=got_pred, want_pred=want_pred)
    for stat in ("fills", "write_backs", "evictions"):
        result[stat] = np.array(stats[stat])
    return result


def _copies(rank, out):
    """A table drawn from an unseeded initializer after a global seed that
    differs per process (one seed for both: `shared_seed`), and the errors
    of copies that differ (seeded initializers of other seeds, a disk
    folder both processes share) and of a batch with an id out of range in
    one process's part; each with whether the cache stayed empty."""
    import keras_sparse as ks

    found = {}
    keras.utils.set_random_seed(10 + rank)
    layer = ks.AllToAllDenseEmbedding(
        300, 4, optimizer="sgd", cache_rows=CACHE, name="unseeded"
    )
    layer.build((None, 2))
    found["unseeded"] = layer.get_weights()[0]
    differ = {"embeddings_initializer": keras.initializers.RandomUniform(seed=rank)}
    shared = {"store": ks.store.Disk(os.path.join(out, "shared"))}
    x, y = cached_tables.data(BATCH, 1)
    for key, extra in (("seeds", differ), ("shared", shared)):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((2,), dtype="int32")
        emb = ks.AllToAllDenseEmbedding(
            300, 4, combiner="sum", optimizer="sgd", cache_rows=CACHE,
            name="ids", **extra,
        )  # fmt: skip
        model = keras.Model(inputs, keras.layers.Dense(1)(emb(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        try:
            model.fit(_local(x["a"], rank), _local(y, rank), verbose=0)
            found[key] = np.array("trained")
        except ValueError as error:
            found[key] = np.array(f"{error} [size={emb.row_cache.slot_map.size}]")
    # An id out of range in process 1's part only: both processes refuse it.
    bad = _local(x["a"], rank).copy()
    bad[1, 0] = 300 if rank == 1 else 0
    keras.utils.set_random_seed(3)
    model, layer = cached_tables.build("dense", "sgd", {"cache_rows": CACHE})
    model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(bad, _local(y, rank), batch_size=BATCH // WORLD, verbose=0)
        found["bad_batch"] = np.array("trained")
    except ValueError as error:
        found["bad_batch"] = np.array(f"{error} [size={layer.stats()['size']}]")
    model, layer = cached_tables.build("dense", "sgd", {"cache_rows": CACHE})
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    try:
        model.fit(_local(x["a"], rank), _local(y, rank), verbose=0)
        found["eager"] = np.array("trained")
    except ValueError as error:
        found["eager"] = np.array(f"{error} [size={layer.stats()['size']}]")
    return found


def _run_rank(rank, port, out):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", WORLD, rank, initialization_timeout=120
    )
    devices = jax.devices()
    assert len(devices) == 8 and jax.process_count() == WORLD
    dist = keras.distribution.DataParallel(devices=devices)
    dist.auto_shard_dataset = False  # each process passes its own part
    keras.distribution.set_distribution(dist)
    result = {}
    try:
        for kind, optimizer in CASES:
            for k, v in _case(kind, optimizer, rank, out).items():
                result[f"{kind}-{optimizer}:{k}"] = v
        result.update(_copies(rank, out))
    finally:
        np.savez(os.path.join(out, f"r{rank}.npz"), **result)
        jax.distributed.shutdown()


if __name__ == "__main__":
    _run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


# --------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("jax_processes_cache")
    procs = launch_ranks(__file__, WORLD, free_ports(1)[0], out, backend="jax")
    wait_ranks(procs, timeout=400)
    return [dict(np.load(out / f"r{r}.npz")) for r in range(WORLD)]


@pytest.mark.parametrize("kind,optimizer", CASES)
def test_cached_table_equals_the_table_without_a_cache(ranks, kind, optimizer):
    prefix = f"{kind}-{optimizer}:"
    for result in ranks:
        # Rows went down to the store and came back: the cache was small.
        assert int(result[prefix + "evictions"]) >= 100
        assert int(result[prefix + "fills"]) > 3 * CACHE
        assert int(result[prefix + "write_backs"]) > 2 * CACHE
        names = cached_tables.entries(result, prefix)
        assert len(names) >= 2 + (optimizer == "adagrad"), names
        for name in names:
            value = result[f"{prefix}want/{name}"]
            if kind == "collection" and name.startswith("b:"):
                # Table "b" shares a stack with "a" only in the reference,
                # so its updates are summed in another order.
                np.testing.assert_allclose(
                    result[f"{prefix}got/{name}"], value, atol=1e-7, err_msg=name
                )
            else:
                np.testing.assert_array_equal(
                    result[f"{prefix}got/{name}"], value, err_msg=name
                )
        # Inference reads the ids the cache does not hold from the store.
        np.testing.assert_allclose(
            result[prefix + "got_pred"], result[prefix + "want_pred"], atol=1e-7
        )


def test_the_processes_copies_are_identical(ranks):
    cached_tables.assert_copies_identical(ranks, ends=("_pred",))


def test_an_unseeded_initializer_draws_one_table_in_every_process(ranks):
    first, second = (r["unseeded"] for r in ranks)
    assert first.shape == (300, 4) and np.abs(first).max() > 0
    np.testing.assert_array_equal(first, second)


def test_copies_that_differ_are_refused_before_the_cache_changes(ranks):
    for result in ranks:
        where = "a Keras distribution with 2 JAX processes"
        seeds = cached_tables.assert_copies_refused(result, "seeds", where)
        assert "jax.distributed.initialize" in seeds, seeds


def test_a_batch_one_process_holds_wrong_is_refused_in_every_process(ranks):
    """Each process checks the whole global batch before the step: a
    process left alone in the step would wait for the other."""
    for result in ranks:
        message = str(result["bad_batch"])
        assert "Layer 'ids'" in message and "id 300 is out of range" in message
        assert message.endswith("[size=0]"), message


def test_eager_training_is_refused_before_the_cache_changes(ranks):
    for result in ranks:
        message = str(result["eager"])
        assert "Layer 'ids'" in message and "compiled steps only" in message
        assert message.endswith("[size=0]"), message
