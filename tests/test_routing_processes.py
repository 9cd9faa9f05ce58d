"""Locality routing across processes: each process's stage places its samples
among its own replicas (a 2-process layout faked in one process)."""

import types

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.data import local_replicas as local_lib
from keras_sparse.data.routing import exchanged_bytes
from keras_sparse.data.routing import locality_assignment

ROWS, R, B = 800, 8, 128  # rows per shard: 100; owner of id i: i // 100


def _ids(batches, seed=0):
    """``batches`` batches of B ids, 16 of each owner per batch, shuffled."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batches):
        owners = rng.permutation(np.repeat(np.arange(R), B // R))
        out.append(owners * (ROWS // R) + rng.integers(0, ROWS // R, B))
    return np.concatenate(out).astype(np.int32)


@pytest.mark.backend_independent
def test_assignment_over_local_replicas_places_their_samples_on_them():
    ids = _ids(1)
    owners = [ids[:, None] // (ROWS // R)]
    local = (4, 5, 6, 7)
    perm = locality_assignment(owners, R, [1], local=local)
    assert sorted(perm.tolist()) == list(range(B))
    # Block q (32 samples) goes to replica local[q]: every sample owned
    # there fits (16 each), so each lands on its owner.
    holder = np.empty(B, np.int64)
    holder[perm] = np.repeat(local, B // len(local))
    mine = owners[0][:, 0] >= 4
    np.testing.assert_array_equal(holder[mine], owners[0][mine, 0])
    # The bytes counted against that placement (independently: a loop).
    want = sum(int(o != h) for o, h in zip(owners[0][:, 0], holder))
    assert exchanged_bytes(owners, R, [1], perm, local) == want == B - mine.sum()
    unrouted = np.repeat(local, B // len(local))
    want = sum(int(o != h) for o, h in zip(owners[0][:, 0], unrouted))
    assert exchanged_bytes(owners, R, [1], local=local) == want
    with pytest.raises(ValueError, match=r"`local` replicas.*\[0, 8\)"):
        locality_assignment(owners, R, local=(7, 8))


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX processes")
def test_stage_of_process_one_of_two_routes_over_its_own_replicas(monkeypatch):
    """Process 1 of 2 with 8 replicas: its batch is split over replicas 4-7,
    so each of its samples whose id one of them owns is placed there."""
    import jax

    monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
    monkeypatch.setattr(jax, "process_count", lambda *a, **k: 2)
    keras.utils.set_random_seed(0)
    ids = keras.Input((), dtype="int32", name="ids")
    emb = ks.AllToAllDenseEmbedding(ROWS, 4, optimizer="adagrad", name="emb")(ids)
    model = keras.Model(ids, keras.layers.Dense(1)(emb))
    x = _ids(2)
    y = x.astype(np.float32)[:, None]  # tells each sample's id after routing
    stage = ks.data.prefetch((x, y), model, batch_size=B, route="locality", replicas=R)
    local = np.repeat([4, 5, 6, 7], B // 4)
    try:
        stage.on_epoch_begin()
        for i in range(len(stage)):
            bx, by = stage[i][:2]
            got = np.asarray(by)[:, 0].astype(np.int64)
            np.testing.assert_array_equal(np.asarray(bx), got)  # moved together
            np.testing.assert_array_equal(np.sort(got), np.sort(x[i * B : (i + 1) * B]))
            owner = got // (ROWS // R)
            mine = owner >= 4
            np.testing.assert_array_equal(local[mine], owner[mine])
        stats = stage.stats()
    finally:
        stage.close()
    # Half the samples are owned by the other process's replicas: remote.
    assert stats["bytes_routed"] == len(x) // 2 * ks.data.routing.remote_id_bytes(4)
    with pytest.raises(ValueError, match="`replicas` to be a multiple of 2; got 5"):
        ks.data.prefetch((x, y), model, batch_size=B, route="locality", replicas=5)


def _fake_distribution(processes, batch_axis="batch"):
    """A 2-D mesh (batch 4 x model 2) whose devices live on ``processes``."""
    devices = np.array(
        [types.SimpleNamespace(process_index=p) for p in processes], dtype=object
    ).reshape(4, 2)
    mesh = types.SimpleNamespace(axis_names=("batch", "model"), devices=devices)
    return types.SimpleNamespace(device_mesh=mesh, batch_dim_name=batch_axis)


@pytest.mark.backend_independent
@pytest.mark.parametrize(
    "processes, me, want",
    [
        ([0, 0, 0, 0, 1, 1, 1, 1], 1, (2, 3)),  # contiguous halves
        ([0, 0, 1, 1, 0, 0, 1, 1], 0, (0, 2)),  # interleaved along batch
    ],
)
def test_local_replicas_are_the_mesh_positions_of_the_process(
    monkeypatch, processes, me, want
):
    monkeypatch.setattr(local_lib, "process_layout", lambda: (me, 2))
    dist = _fake_distribution(processes)
    monkeypatch.setattr(keras.distribution, "distribution", lambda: dist)
    assert local_lib.local_replicas(4) == want
    # No mesh of that many batch positions: equal blocks by process index.
    assert local_lib.local_replicas(6) == tuple(range(3 * me, 3 * me + 3))
    with pytest.raises(ValueError, match="`replicas` to be a multiple of 2; got 5"):
        local_lib.local_replicas(5)
    monkeypatch.setattr(local_lib, "process_layout", lambda: (0, 1))
    assert local_lib.local_replicas(4) is None  # one process: every replica
