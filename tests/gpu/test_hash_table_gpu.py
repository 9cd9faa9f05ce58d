"""The CPU conformance suite re-run against the CuPy table (device="gpu")."""

import pathlib
import sys

import pytest

from tests.gpu.gpu_layers import require_cuda

cp = require_cuda()

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from test_hash_table import *  # noqa: E402,F401,F403  (same test functions, GPU fixture below)


@pytest.fixture
def device():
    return "gpu"


def test_gpu_matches_cpu_rows():
    import numpy as np

    from keras_sparse.table import HashTable

    rng = np.random.default_rng(0)
    keys = rng.integers(-(2**63), 2**63 - 1, 5000, dtype=np.int64)
    cpu = HashTable(8192, device="cpu", eviction="lru")
    gpu = HashTable(8192, device="gpu", eviction="lru")
    for i in range(0, 5000, 1000):
        a = cpu.lookup_or_insert(keys[i : i + 1000]).rows
        b = gpu.lookup_or_insert(cp.asarray(keys[i : i + 1000])).rows
        assert isinstance(b, cp.ndarray)
        np.testing.assert_array_equal(a, b.get())
    np.testing.assert_array_equal(cpu.lookup(keys), gpu.lookup(keys).get())


PATHS = ["insert_call", "grid_call", "evict_rounds", "per_round"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("admit_after", [1, 2])
def test_gpu_matches_cpu_under_eviction(eviction, admit_after, path, monkeypatch):
    """A full table taking large Zipf batches (duplicates, many eviction
    rounds per call, some overflows): the CUDA table's rows, new rows,
    evicted keys and rows (in order), counters and stored state equal the
    CPU twin's call by call: with the whole call in one ks_insert_calls
    launch (batches up to 64K keys), in one cooperative ks_insert_grid
    launch on every block (larger batches; here the one-block limit is set
    below the batches), and on the multi-launch path with the rounds in one
    ks_evict_rounds launch and with the per-round CuPy code."""
    import numpy as np

    from keras_sparse.table import HashTable
    from keras_sparse.table import cupy_table
    from keras_sparse.table import insert_call
    from keras_sparse.table.array_table import ArrayTable

    fused = path != "per_round"
    if path == "grid_call":
        monkeypatch.setattr(insert_call, "MAX_KEYS", 64)
        if admit_after > 1:
            pytest.skip("admission tables take the multi-launch path")
    elif path != "insert_call":
        monkeypatch.setattr(insert_call, "MAX_KEYS", 0)
        monkeypatch.setattr(insert_call, "GRID_ROUTE", False)
    monkeypatch.setattr(cupy_table, "_FUSED_EVICT_MAX", 1 << 16 if fused else 0)
    per_round_calls = []
    generic = ArrayTable._evict_rounds

    def spy(self, *args):
        per_round_calls.append(type(self).__name__)
        return generic(self, *args)

    monkeypatch.setattr(ArrayTable, "_evict_rounds", spy)

    rng = np.random.default_rng(7)
    kw = dict(eviction=eviction, admit_after=admit_after, bucket_size=8)
    cpu = HashTable(1024, device="cpu", **kw)
    gpu = HashTable(1024, device="gpu", **kw)
    for step in range(13):
        n = 900 if step % 4 == 3 else 300  # some batches nearly fill the table
        keys = (rng.zipf(1.1, n) % 50000).astype(np.int64) * 7919
        if step == 12:  # 1000 distinct new keys: their buckets fill up (overflows)
            keys = np.arange(1, 1001, dtype=np.int64) * -104729
        # Every key seen admit_after times per call: the same pressure
        # (exact admission admits no key seen fewer times).
        keys = np.tile(keys, admit_after)
        a = cpu.lookup_or_insert(keys)
        b = gpu.lookup_or_insert(cp.asarray(keys))
        for name in ("rows", "new_rows", "evicted_keys", "evicted_rows"):
            np.testing.assert_array_equal(
                getattr(a, name), getattr(b, name).get(), err_msg=f"{name} @{step}"
            )
        assert cpu.stats() == gpu.stats(), step
    assert cpu.stats()["evictions"] > 400
    assert cpu.stats()["overflows"] > 10
    # The CPU twin always runs the rounds in NumPy; the CUDA table only on
    # the multi-launch path with its one-launch eviction kernel off.
    assert ("CupyTable" in per_round_calls) == (path == "per_round")
    for x, y in zip(cpu.export(), gpu.export()):
        np.testing.assert_array_equal(x, y.get())


@pytest.mark.skipif(
    not getattr(cp, "EMULATED", False), reason="counts come from the emulated CuPy"
)
@pytest.mark.parametrize("kw", [dict(eviction="lru"), dict(eviction="lfu")], ids=str)
@pytest.mark.parametrize("route", ["block", "grid"])
def test_insert_call_is_one_launch_and_one_sync(kw, route, monkeypatch):
    """Embedding-sized batches take one kernel launch and one host read per
    lookup_or_insert, however many placement and eviction rounds they need
    (the multi-launch path needs a host sync per round); so do batches above
    the one-block limit (one cooperative launch on every block)."""
    import numpy as np

    from keras_sparse.table import HashTable
    from keras_sparse.table import insert_call

    if route == "grid":
        monkeypatch.setattr(insert_call, "MAX_KEYS", 1000)

    table = HashTable(4096, device="gpu", bucket_size=8, **kw)
    rng = np.random.default_rng(0)
    counts = []
    for _ in range(6):  # fills the table, then evicts
        keys = cp.asarray((rng.zipf(1.1, 4096) % 12000).astype(np.int64))
        before = dict(cp.stats)
        table.lookup_or_insert(keys)
        counts.append({k: cp.stats[k] - before[k] for k in ("syncs", "kernels")})
    assert table.stats()["evictions"] > 0
    assert counts == [{"syncs": 1, "kernels": 1}] * 6


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_step_rows_match_the_cpu_table_and_defer_the_counts(eviction):
    """``step_rows`` (a training step's rows, no host sync) gives the rows of
    the CPU twin's ``lookup_or_insert_fresh`` on the used keys, -1 at
    padding, ``fresh`` at each new row's first position only; the counts,
    read later by ``stats()``, equal the twin's."""
    import numpy as np

    from keras_sparse.table import HashTable

    kw = dict(eviction=eviction, bucket_size=8)
    cpu = HashTable(1024, device="cpu", **kw)
    gpu = HashTable(1024, device="gpu", **kw)
    assert HashTable(512, device="cpu").step_rows(np.zeros(3, np.int64)) is None
    # Exact admission counts live in a second table: the multi-launch path.
    counted = HashTable(512, device="gpu", admit_after=2)
    assert counted.step_rows(cp.zeros(3, cp.int64)) is None
    full_fails_at_once = HashTable(512, device="gpu", eviction=None)
    assert full_fails_at_once.step_rows(cp.zeros(3, cp.int64)) is None
    rng = np.random.default_rng(3)
    syncs = getattr(cp, "stats", {}).get("syncs")
    for _ in range(8):
        keys = (rng.zipf(1.05, 700) % 20000).astype(np.int64) * 7919
        use = rng.random(700) < 0.9
        res, fresh = cpu.lookup_or_insert_fresh(keys[use])
        want_rows = np.full(700, -1, np.int64)
        want_rows[use] = res.rows
        want_fresh = np.zeros(700, bool)
        at = np.flatnonzero(use)[fresh]
        _, first = np.unique(want_rows[at], return_index=True)
        want_fresh[at[first]] = True
        rows, got_fresh = gpu.step_rows(cp.asarray(keys), cp.asarray(use))
        np.testing.assert_array_equal(rows.get(), want_rows)
        np.testing.assert_array_equal(got_fresh.get(), want_fresh)
    if syncs is not None:  # emulated: the reads above are the only syncs
        assert cp.stats["syncs"] == syncs + 16
    assert gpu.stats() == cpu.stats() and cpu.stats()["evictions"] > 0
    for x, y in zip(cpu.export(), gpu.export()):
        np.testing.assert_array_equal(x, y.get())


@pytest.mark.parametrize(
    "max_keys,teams", [(None, None), (300, None), (100, None), (100, 2), (300, 2)]
)
def test_step_rows_together_is_one_launch_equal_to_separate_tables(
    max_keys, teams, monkeypatch
):
    """`step_rows_together` maps several tables' keys in one kernel launch
    (one block per table) with no host sync, and each table ends exactly as
    the CPU twin fed its own slice: rows, fresh flags, counts, entries.
    Tables differ in policy, admission, bucket size and batch length. With
    the one-block limit lowered (``max_keys``), the tables above it run one
    after another in one grid launch: two launches when some tables stay
    below the limit, one when none does. With ``teams``, the grid launch's
    teams of blocks run those tables side by side, each in its own
    workspace."""
    import numpy as np

    from keras_sparse.table import HashTable
    from keras_sparse.table import insert_call
    from keras_sparse.table import launches
    from keras_sparse.table import step_rows_together

    if max_keys:
        monkeypatch.setattr(insert_call, "MAX_KEYS", max_keys)
    monkeypatch.setattr(launches, "GRID_TEAMS", teams)
    launches = 2 if max_keys == 300 else 1

    kws = [
        dict(capacity=512, eviction="lru", bucket_size=8),
        dict(capacity=256, eviction="lfu", bucket_size=4),
        dict(capacity=1024, eviction="lru", seed=5),
    ]
    cpus = [HashTable(device="cpu", **kw) for kw in kws]
    gpus = [HashTable(device="gpu", **kw) for kw in kws]
    lengths = [400, 250, 900]
    bounds = list(zip(np.cumsum([0] + lengths[:-1]), np.cumsum(lengths)))
    rng = np.random.default_rng(11)
    counts = getattr(cp, "stats", None)
    for _ in range(6):
        keys = (rng.zipf(1.1, sum(lengths)) % 5000).astype(np.int64) * 104729
        use = rng.random(sum(lengths)) < 0.9
        out = (cp.empty(len(keys), cp.int32), cp.empty(len(keys), cp.bool_))
        before = dict(counts) if counts else None
        got = step_rows_together(gpus, cp.asarray(keys), cp.asarray(use), bounds, out)
        if counts:
            assert counts["kernels"] - before["kernels"] == launches
            assert counts["syncs"] == before["syncs"]
        assert got == []
        for cpu, (a, b) in zip(cpus, bounds):
            k, u = keys[a:b], use[a:b]
            res, fresh = cpu.lookup_or_insert_fresh(k[u])
            want = np.full(b - a, -1, np.int64)
            want[u] = res.rows
            want_fresh = np.zeros(b - a, bool)
            at = np.flatnonzero(u)[fresh]
            _, first = np.unique(want[at], return_index=True)
            want_fresh[at[first]] = True
            np.testing.assert_array_equal(out[0][a:b].get(), want)
            np.testing.assert_array_equal(out[1][a:b].get(), want_fresh)
    for cpu, gpu in zip(cpus, gpus):
        assert gpu.stats() == cpu.stats()
        for x, y in zip(cpu.export(), gpu.export()):
            np.testing.assert_array_equal(x, y.get())
    assert cpus[0].stats()["evictions"] > 0 and cpus[1].stats()["evictions"] > 0
    if max_keys:
        # A team's calls run one after another in one workspace, sized for
        # the largest call; the first grid table lends one per team.
        fused = [insert_call.FusedInsert.of(t._impl) for t in gpus]
        on_grid = [n > max_keys for n in lengths]
        first = on_grid.index(True)
        need = max(insert_call.workspace_words(n) for n in lengths if n > max_keys)
        assert fused[first].workspace.shape[0] >= need
        others = fused[first].__dict__.get("_team_workspaces") or []
        assert len(others) == (teams or 1) - 1
        assert all(w.shape[0] >= need for w in others)
        for i in range(first + 1, len(gpus)):
            if on_grid[i]:
                assert fused[i].workspace.shape[0] == 0
        return
    # Left to the caller, in order: a CPU table, a table's second
    # appearance, eviction=None; the others still share one launch.
    strict = HashTable(512, device="gpu", eviction=None)
    other = HashTable(64, device="gpu")
    mixed = [cpus[0], gpus[0], gpus[0], strict, other]
    bounds = [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)]
    keys = cp.arange(20, dtype=cp.int64)
    out = (cp.full(20, -7, cp.int32), cp.zeros(20, cp.bool_))
    before = dict(counts) if counts else None
    assert step_rows_together(mixed, keys, None, bounds, out) == [0, 2, 3]
    if counts:
        assert counts["kernels"] - before["kernels"] == 1
    rows = out[0].get()
    assert (rows[:4] == -7).all() and (rows[8:16] == -7).all()
    assert (rows[4:8] >= 0).all() and (rows[16:] >= 0).all()
    assert strict.stats()["size"] == 0


def test_step_rows_run_on_one_team_when_the_device_has_no_room(monkeypatch):
    """Side-by-side teams need a workspace each: when the device cannot
    hold the extra ones, the step's large calls run one after another on
    one team, with the same results."""
    import numpy as np

    from keras_sparse.table import HashTable
    from keras_sparse.table import insert_call
    from keras_sparse.table import launches
    from keras_sparse.table import step_rows_together

    monkeypatch.setattr(insert_call, "MAX_KEYS", 50)
    monkeypatch.setattr(launches, "GRID_TEAMS", 2)
    empty = insert_call.cp.empty
    need, asked = insert_call.workspace_words(100), []

    def scarce(shape, *args, **kwargs):
        if isinstance(shape, tuple) and shape[1:] == (need,):
            asked.append(shape)
            raise MemoryError("out of memory (a test's device)")
        return empty(shape, *args, **kwargs)

    monkeypatch.setattr(insert_call.cp, "empty", scarce)
    cpus = [HashTable(128, device="cpu", eviction="lru") for _ in range(2)]
    gpus = [HashTable(128, device="gpu", eviction="lru") for _ in range(2)]
    keys = np.random.default_rng(3).integers(0, 300, 200).astype(np.int64)
    out = (cp.empty(200, cp.int32), cp.empty(200, cp.bool_))
    bounds = [(0, 100), (100, 200)]
    assert step_rows_together(gpus, cp.asarray(keys), None, bounds, out) == []
    assert asked == [(1, need)]
    for cpu, (a, b) in zip(cpus, bounds):
        np.testing.assert_array_equal(
            out[0][a:b].get(), cpu.lookup_or_insert(keys[a:b]).rows
        )
    for cpu, gpu in zip(cpus, gpus):
        assert gpu.stats() == cpu.stats()


@pytest.mark.parametrize("eviction,teams", [("lru", None), ("lfu", None), ("lru", 2)])
def test_step_rows_of_more_keys_than_rows(eviction, teams, monkeypatch):
    """A step batch of more keys than the table has rows runs on the grid
    and reads back whether it failed (one host sync): with at most
    ``capacity`` distinct keys its rows equal the CPU twin's; with more, it
    raises the twin's BatchTooLargeError and leaves the table as it was
    (also when the failing call ran on the launch's second team)."""
    import numpy as np

    from keras_sparse.table import BatchTooLargeError
    from keras_sparse.table import HashTable
    from keras_sparse.table import launches
    from keras_sparse.table import step_rows_together

    monkeypatch.setattr(launches, "GRID_TEAMS", teams)

    kw = dict(capacity=64, eviction=eviction, bucket_size=8)
    cpu, gpu = HashTable(device="cpu", **kw), HashTable(device="gpu", **kw)
    keep = HashTable(device="gpu", **kw)  # fits: its call stands
    rng = np.random.default_rng(5)
    counts = getattr(cp, "stats", None)
    for _ in range(3):
        keys = rng.integers(0, 40, 200).astype(np.int64) * 31  # <= 40 distinct
        res, fresh = cpu.lookup_or_insert_fresh(keys)
        out = (cp.empty(200, cp.int32), cp.empty(200, cp.bool_))
        before = dict(counts) if counts else None
        got = step_rows_together([gpu], cp.asarray(keys), None, [(0, 200)], out)
        assert got == []
        if counts:
            assert counts["kernels"] - before["kernels"] == 1
            assert counts["syncs"] - before["syncs"] == 1
        np.testing.assert_array_equal(out[0].get(), res.rows)
    assert gpu.stats() == cpu.stats()
    wide = np.arange(100, dtype=np.int64) * 7  # 100 distinct keys, 64 rows
    keep_cpu = HashTable(device="cpu", **kw)
    again = np.tile(wide[:10], 7)  # more keys than rows, 10 distinct: fits
    keep_cpu.lookup_or_insert(again)  # `keep`'s call in the failing launch
    with pytest.raises(BatchTooLargeError, match="100 distinct admitted keys"):
        cpu.lookup_or_insert(wide)  # `gpu`'s call in that launch
    state = [a.get() for a in gpu.export()]
    keys = cp.asarray(np.concatenate([again, wide]))
    out = (cp.empty(170, cp.int32), cp.empty(170, cp.bool_))
    with pytest.raises(BatchTooLargeError, match="100 distinct admitted keys"):
        step_rows_together([keep, gpu], keys, None, [(0, 70), (70, 170)], out)
    for x, y in zip(state, gpu.export()):
        np.testing.assert_array_equal(x, y.get())
    assert gpu.stats() == cpu.stats()
    assert keep.stats() == keep_cpu.stats() and keep.stats()["size"] == 10
    with pytest.raises(BatchTooLargeError, match="100 distinct admitted keys"):
        cpu.lookup_or_insert(wide)
    with pytest.raises(BatchTooLargeError, match="100 distinct admitted keys"):
        gpu.lookup_or_insert(cp.asarray(wide))
    assert gpu.stats() == cpu.stats()
    # Each pair goes on alike after the failed calls (clocks and scores
    # included: a failed call advances its table's clock, as the CPU twin's).
    for a_table, b_table in ((cpu, gpu), (keep_cpu, keep)):
        for _ in range(3):
            keys = rng.integers(0, 300, 60).astype(np.int64)
            a = a_table.lookup_or_insert(keys)
            b = b_table.lookup_or_insert(cp.asarray(keys))
            np.testing.assert_array_equal(a.rows, b.rows.get())
            np.testing.assert_array_equal(a.evicted_keys, b.evicted_keys.get())
        for x, y in zip(a_table.export(), b_table.export()):
            np.testing.assert_array_equal(x, y.get())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "kw",
    [
        dict(eviction="lru"),
        dict(eviction="lfu", admit_after=2),
        dict(eviction="lru", admit_after=3),
    ],
    ids=["lru", "lfu-admit2", "lru-admit3"],
)
def test_random_call_sequences_match_the_cpu_table(seed, kw):
    """Random sequences of every table call (inserts with implicit, repeated
    and old explicit steps, lookups, erases that leave holes, imports at
    given rows and with scores above the clock, training-step calls with
    padding) give the CUDA table the CPU twin's results call by call."""
    import numpy as np

    from keras_sparse.table import HashTable

    rng = np.random.default_rng(seed)
    cpu = HashTable(256, device="cpu", bucket_size=8, **kw)
    gpu = HashTable(256, device="gpu", bucket_size=8, **kw)

    def same(a, b, what):
        np.testing.assert_array_equal(np.asarray(a), b.get(), err_msg=what)

    universe = rng.integers(-(2**62), 2**62, 600)
    for i in range(40):
        op = rng.choice(["insert", "insert", "insert", "step", "erase", "import"])
        keys = universe[(rng.zipf(1.3, rng.integers(1, 200)) - 1) % 600]
        what = f"call {i}: {op}"
        if op == "insert":
            step = [None, None, 5, cpu._impl.clock][rng.integers(4)]
            a = cpu.lookup_or_insert(keys, step=step)
            b = gpu.lookup_or_insert(cp.asarray(keys), step=step)
            for name in ("rows", "new_rows", "evicted_keys", "evicted_rows"):
                same(getattr(a, name), getattr(b, name), f"{what} {name}")
        elif op == "step":
            use = rng.random(keys.shape[0]) < 0.8
            res, fresh = cpu.lookup_or_insert_fresh(keys[use])
            got = gpu.step_rows(cp.asarray(keys), cp.asarray(use))
            if got is None:  # admission: the multi-launch call instead
                assert gpu.admit_after > 1
                rows = np.full(keys.shape[0], -1, np.int64)
                res_gpu, _ = gpu.lookup_or_insert_fresh(cp.asarray(keys[use]))
                rows[use] = res_gpu.rows.get()
                rows = cp.asarray(rows)
            else:
                rows = got[0]
            want = np.full(keys.shape[0], -1, np.int64)
            want[use] = res.rows
            same(want, rows, what)
        elif op == "erase":
            assert cpu.erase(keys) == gpu.erase(cp.asarray(keys)), what
        else:
            live, rows, _ = cpu.export()
            if live.shape[0] == 0:
                continue
            pick = rng.random(live.shape[0]) < 0.3
            cpu.erase(live[pick])
            gpu.erase(cp.asarray(live[pick]))
            if rng.random() < 0.5:  # back at their rows: holes may remain
                cpu.import_(live[pick], rows=rows[pick])
                gpu.import_(cp.asarray(live[pick]), rows=cp.asarray(rows[pick]))
            else:  # placed anew, with scores above the clock
                scores = np.full(int(pick.sum()), cpu._impl.clock + 50, np.int64)
                a = cpu.import_(live[pick], scores=scores)
                b = gpu.import_(cp.asarray(live[pick]), scores=cp.asarray(scores))
                same(a.rows, b.rows, what)
        same(
            cpu.lookup(universe, count=False),
            gpu.lookup(cp.asarray(universe), count=False),
            what,
        )
        assert cpu.stats() == gpu.stats(), what
    for x, y in zip(cpu.export(), gpu.export()):
        np.testing.assert_array_equal(x, y.get())


def test_step_rows_together_failing_before_the_launch_leaves_tables_untouched(
    monkeypatch,
):
    """A failure while the launch is prepared (here: the second table's
    record, as an out-of-memory error would) leaves every table as if it
    never saw the call: the next calls equal those of tables that did not."""
    import numpy as np

    from keras_sparse.table import HashTable
    from keras_sparse.table import insert_call
    from keras_sparse.table import step_rows_together

    kws = [dict(capacity=256, eviction="lru"), dict(capacity=256, eviction="lfu")]
    tried = [HashTable(device="gpu", **kw) for kw in kws]
    clean = [HashTable(device="gpu", **kw) for kw in kws]
    rng = np.random.default_rng(3)
    bounds = [(0, 200), (200, 400)]

    def step(tables, keys):
        out = (cp.empty(400, cp.int32), cp.empty(400, cp.bool_))
        assert step_rows_together(tables, cp.asarray(keys), None, bounds, out) == []
        return out[0].get(), out[1].get()

    for _ in range(3):
        keys = (rng.zipf(1.2, 400) % 600).astype(np.int64)
        step(tried, keys)
        step(clean, keys)
    # Every record, on views or on pointers, is built by record_at.
    record = insert_call.FusedInsert.record_at
    calls = []

    def failing_record(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 2:
            raise MemoryError("out of device memory")
        return record(self, *args, **kwargs)

    monkeypatch.setattr(insert_call.FusedInsert, "record_at", failing_record)
    with pytest.raises(MemoryError):
        step(tried, (rng.zipf(1.2, 400) % 600).astype(np.int64))
    assert len(calls) == 2
    monkeypatch.setattr(insert_call.FusedInsert, "record_at", record)
    for _ in range(4):
        keys = (rng.zipf(1.2, 400) % 600).astype(np.int64)
        for got, want in zip(step(tried, keys), step(clean, keys)):
            np.testing.assert_array_equal(got, want)
    for a, b in zip(tried, clean):
        assert a.stats() == b.stats()
        for x, y in zip(a.export(), b.export()):
            np.testing.assert_array_equal(x.get(), y.get())
