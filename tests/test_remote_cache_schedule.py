"""The remote-row cache schedule (`plan_remote_cache`) replayed by an
independent dict simulator with scalar row versions: every read of every
step sees the row's latest version, one place holds it at each step, caches
stay within their capacity, and after a flush the owners hold every row's
latest version; byte counts recomputed from the moves."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from keras_sparse.data import locality_assignment
from keras_sparse.data import plan_remote_cache
from keras_sparse.data import zipf_ids

pytestmark = pytest.mark.backend_independent


def replay(batches, owner, capacity, plan, flush_after=(), final_flush=True):
    """Replays ``plan`` on row versions; returns the hits, transfers
    (holder to reader) and evictions (pushes of rows no one reads then)."""
    d = len(batches[0])
    latest, at_owner = {}, {}  # id -> version (0: never trained)
    cache = [dict() for _ in range(d)]  # device -> {id: version}
    hits = transfers = evictions = 0
    for t, (step, sp) in enumerate(zip(batches, plan.steps)):
        for dev, i in zip(sp.pushes.device.tolist(), sp.pushes.ids.tolist()):
            assert owner(i) != dev and i in cache[dev], (t, dev, i)
            at_owner[i] = cache[dev].pop(i)
        pulls = zip(sp.pulls.device.tolist(), sp.pulls.ids.tolist())
        for (dev, i), src in zip(pulls, sp.pulls.source.tolist()):
            holders = [k for k, c in enumerate(cache) if i in c]
            assert owner(i) != dev and src != dev
            assert holders == ([] if src == owner(i) else [src]), (t, dev, i)
            if src == owner(i):
                cache[dev][i] = at_owner.get(i, 0)
            else:
                cache[dev][i] = cache[src].pop(i)
                transfers += 1
        # The moves before a step happen together: check after all of them.
        assert all(len(c) <= capacity for c in cache), t
        readers = {}
        for dev, ids in enumerate(step):
            for i in set(int(k) for k in np.asarray(ids).reshape(-1) if k >= 0):
                readers.setdefault(i, []).append(dev)
        hit = {
            (dev, i) for dev, i in zip(sp.hits.device.tolist(), sp.hits.ids.tolist())
        }
        pulled = set(zip(sp.pulls.device.tolist(), sp.pulls.ids.tolist()))
        remote = set(zip(sp.remote.device.tolist(), sp.remote.ids.tolist()))
        # The schedule covers each read exactly once.
        wanted = {(dev, i) for i, devs in readers.items() for dev in devs}
        remote_reads = {(dev, i) for dev, i in wanted if owner(i) != dev}
        assert hit | pulled | remote == remote_reads
        assert len(hit) + len(pulled) + len(remote) == len(remote_reads)
        assert not pulled - remote_reads  # a pull is read at its step
        trained_at = {}
        for i, devs in readers.items():
            v = latest.get(i, 0)
            for dev in devs:
                if (dev, i) in hit or (dev, i) in pulled:
                    assert devs == [dev]  # cached rows have one reader
                    assert cache[dev][i] == v, (t, dev, i)
                    trained_at[i] = dev
                else:
                    assert i not in cache[dev]
                    assert at_owner.get(i, 0) == v, (t, dev, i)
                    trained_at.setdefault(i, None)
        hits += len(hit)
        evictions += len(set(sp.pushes.ids.tolist()) - set(readers))
        for i, dev in trained_at.items():  # BSP: one update per row and step
            latest[i] = latest.get(i, 0) + 1
            if dev is None:
                at_owner[i] = latest[i]
            else:
                cache[dev][i] = latest[i]
        for i, v in latest.items():  # one place holds the latest version
            places = [c for c in cache if i in c]
            assert len(places) <= 1
            newest = places[0][i] if places else at_owner.get(i, 0)
            assert newest == v and (not places or at_owner.get(i, 0) < v)
        for dev, i in zip(sp.flushes.device.tolist(), sp.flushes.ids.tolist()):
            at_owner[i] = cache[dev].pop(i)
        if t in flush_after or (final_flush and t == len(batches) - 1):
            assert not any(cache), t
        # Bytes by sender, from the moves.
        sent = np.zeros(d, np.int64)
        o_b = 4 * 4  # the owner sends a vector (dim 4, float32)
        r_b = plan.remote_read_bytes - o_b  # the reader: id, id + gradient
        for dev, i in remote:
            sent[dev] += r_b
            sent[owner(i)] += o_b
        for src in (
            sp.pushes.device.tolist()
            + sp.pulls.source.tolist()
            + sp.flushes.device.tolist()
        ):
            sent[src] += plan.row_bytes
        np.testing.assert_array_equal(sent, sp.bytes)
    if final_flush:
        assert all(at_owner.get(i, 0) == v for i, v in latest.items())
    return hits, transfers, evictions


def _batches(rng, steps, d, per_device, ids, owner_of, routed, mode):
    """Per step, per device id arrays: samples of 2 ids split into blocks,
    Keras' contiguous split or locality routing. ``mode``: uniform ids (-1:
    padding), Zipf ids, or "sticky": block ``k``'s first ids are one row
    (rows may repeat over blocks) that moves to the next block every 2
    steps, its second ids half padding."""
    out = []
    pools = rng.integers(0, ids, d)
    for t in range(steps):
        b = per_device * d
        if mode == "zipf":
            x = zipf_ids(2 * b, ids, 1.2, rng).reshape(b, 2)
        else:
            x = rng.integers(-1, ids, (b, 2))
        if mode == "sticky":
            x[:, 0] = np.roll(pools, t // 2)[np.arange(b) // per_device]
            x[:, 1] = rng.integers(-ids, ids, b)
        if routed and mode != "sticky":  # routing would break the stickiness
            owners = [np.where(x >= 0, owner_of(np.maximum(x, 0)), -1)]
            x = x[locality_assignment(owners, d)]
        out.append(list(x.reshape(d, -1)))
    return out


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    steps=st.integers(2, 8),
    d=st.integers(1, 4),
    per_device=st.integers(1, 5),
    ids=st.integers(1, 24),
    capacity=st.integers(0, 4),
    slots=st.integers(0, 2),
    lookahead=st.sampled_from([None, 0, 1, 3]),
    routed=st.booleans(),
    mode=st.sampled_from(["sticky", "sticky", "zipf", "uniform"]),
    hashed=st.booleans(),
    flushes=st.sets(st.integers(0, 6), max_size=2),
    final_flush=st.booleans(),
)
def test_replayed_schedule_reads_latest_versions(
    seed, steps, d, per_device, ids, capacity, slots, lookahead, routed, mode,
    hashed, flushes, final_flush,
):  # fmt: skip
    rng = np.random.default_rng(seed)
    if hashed:  # any id -> owner function (a key-sharded table's owners)
        perm = rng.integers(0, d, ids)
        owner_of = lambda a: perm[np.asarray(a, np.int64)]  # noqa: E731
        owner = owner_of
    else:  # row-sharded: row // ceil(rows / D)
        rps = -(-ids // d)
        owner_of = lambda a: np.asarray(a, np.int64) // rps  # noqa: E731
        owner = ids
    batches = _batches(rng, steps, d, per_device, ids, owner_of, routed, mode)
    if hashed:  # 64-bit keys: key = id * 2**57 + 1
        batches = [[np.where(a >= 0, a * 2**57 + 1, -1) for a in s] for s in batches]
        owner = lambda k: perm[(np.asarray(k, np.int64) - 1) >> 57]  # noqa: E731
        owner_of = owner
    plan = plan_remote_cache(
        batches, owner, capacity, dim=4, slots=slots, lookahead=lookahead,
        flush_after=flushes, final_flush=final_flush,
    )  # fmt: skip
    hits, _, _ = replay(
        batches, lambda i: int(owner_of(np.array([i]))[0]), capacity, plan,
        flush_after=flushes, final_flush=final_flush,
    )  # fmt: skip
    assert plan.counts["hits"] == hits
    assert plan.bytes.shape == plan.baseline_bytes.shape == (steps, d)
    if capacity == 0:  # no cache: the normal path, byte for byte
        np.testing.assert_array_equal(plan.bytes, plan.baseline_bytes)


def test_cache_cuts_bytes_with_eviction_and_transfers():
    """Each device keeps reading its own 6 remote rows (the hot sets move to
    the next device at step 6) among random ids: rows stay on their readers
    (hits), caches of 4 rows evict, rows move between holders; fewer bytes
    than the normal path, still exact."""
    rng = np.random.default_rng(1)
    d, ids = 4, 400
    hot = rng.permutation(ids)[: 6 * d].reshape(d, 6)
    batches = []
    for t in range(12):
        sets = np.roll(hot, t // 6, axis=0)
        batches.append(
            [np.concatenate([sets[k], rng.integers(0, ids, 4)]) for k in range(d)]
        )
    plan = plan_remote_cache(batches, ids, 4, dim=4, flush_after=[8])
    hits, transfers, evictions = replay(
        batches, lambda i: i // (ids // d), 4, plan, [8]
    )
    assert hits > 50 and transfers > 0 and evictions > 0
    assert plan.saved_fraction > 0.2
    assert plan.seconds > 0 and plan.seconds_per_batch == plan.seconds / 12


def test_hand_made_schedules():
    """Shared reads go through the owner; rows move holder to holder; no
    look-ahead, no cache."""
    # Row 0 (owner 0): device 1 caches it; at step 2 devices 1 and 2 read it
    # (pushed back first, both read through the owner); then device 2 alone.
    batches = [[[], [0], []], [[], [0], []], [[], [0], [0]]] + [[[], [], [0]]] * 3
    plan = plan_remote_cache(batches, 3, 1, dim=4, slots=0)
    s = plan.steps
    assert s[0].pulls.of(1).tolist() == [0] and s[1].hits.of(1).tolist() == [0]
    assert s[2].pushes.of(1).tolist() == [0]
    assert sorted(s[2].remote.device.tolist()) == [1, 2]
    assert s[3].pulls.of(2).tolist() == [0] and s[3].pulls.source.tolist() == [0]
    assert s[5].flushes.of(2).tolist() == [0]
    replay(batches, lambda i: i, 1, plan)

    # Device 1 then device 2 read row 0 (owner 0) for three steps each: the
    # row moves from 1 to 2 directly. Without look-ahead nothing is cached.
    batches = [[[], [0], []]] * 3 + [[[], [], [0]]] * 3
    plan = plan_remote_cache(batches, 3, 2, dim=4)
    assert plan.steps[3].pulls.source.tolist() == [1]
    assert plan.steps[3].pushes.ids.size == 0
    assert plan.counts == dict(hits=4, pulls=2, pushes=0, remote=0, flushes=1)
    replay(batches, lambda i: i, 2, plan)
    blind = plan_remote_cache(batches, 3, 2, dim=4, lookahead=0)
    assert blind.counts["hits"] == 0
    np.testing.assert_array_equal(blind.bytes, blind.baseline_bytes)


def test_errors_name_the_argument():
    cases = [
        (dict(remote_cache_rows=-1), "remote_cache_rows` must be an integer >= 0"),
        (dict(dim=0), "`dim` must be an integer >= 1"),
        (dict(lookahead=-2), "`lookahead` must be None or an integer >= 0"),
        (dict(owner=lambda a: a * 0 + 5), r"device in \[0, 2\)"),
        (dict(batches=[[[0], [1]], [[0]]]), "one id array per device"),
        (dict(batches=[[[0.5], [1]]]), "must hold integer ids"),
    ]
    for kwargs, match in cases:
        args = dict(batches=[[[0], [1]]], owner=2, remote_cache_rows=1, dim=4)
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            plan_remote_cache(**args)


def test_benchmark_rows_reproduce_the_routing_counts():
    """benchmarks/embedding_scheduling.py at a tiny size: its per-position
    column is the routing code's count, the distinct count is never above
    it, and the cache rows report the schedule's hits."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import embedding_scheduling as bench

    from keras_sparse.data.routing import exchanged_bytes
    from keras_sparse.data.routing import remote_id_bytes

    batch, steps = 256, 2
    tables = bench.sessions(batch, steps)
    rows = bench.run("s", tables, batch, steps, lookahead=4)
    labels = [r[1] for r in rows]
    assert labels[:2] == ["no routing", "locality routing"] and len(rows) == 8
    owners = [ids[:batch] // -(-n // 8) for _, n, _, ids in tables]
    cost = [remote_id_bytes(dim) for _, _, dim, _ in tables]
    first = exchanged_bytes(owners, 8, cost)
    later = [ids[batch:] // -(-n // 8) for _, n, _, ids in tables]
    per_step = (first + exchanged_bytes(later, 8, cost)) / 2 / 2**20
    assert rows[0][2] == f"{per_step:.2f}"
    for r in rows:
        assert float(r[3]) <= float(r[2])  # distinct <= per position
    assert all(r[7] == "0" for r in rows[:2]) and int(rows[-1][7]) > 0
