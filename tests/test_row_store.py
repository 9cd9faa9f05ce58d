"""Row stores (`keras_sparse.store`) against independent references: a
Python dict of key -> rows for the keyed stores, a NumPy array for the
dense ones; reopening flushed disk stores; errors that change nothing."""

import doctest
import itertools
import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import keras_sparse as ks
from keras_sparse.store import DenseDiskStore
from keras_sparse.store import DenseHostStore
from keras_sparse.store import Disk
from keras_sparse.store import DiskStore
from keras_sparse.store import FieldSpec
from keras_sparse.store import Host
from keras_sparse.store import HostStore
from keras_sparse.store import RowStore
from keras_sparse.store import StoreFormatError
from keras_sparse.store import dense_store
from keras_sparse.store import host_rows
from keras_sparse.store import key_index
from keras_sparse.store import mapped_rows
from keras_sparse.table.keys import hash_keys

pytestmark = pytest.mark.backend_independent


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """No Keras here: the conftest's per-test Keras reset (a garbage
    collection, ~0.5 s a test) has nothing to reset."""
    yield


FIELDS = (FieldSpec("values", 3, "float32"), FieldSpec("score", 1, "int64"))
EXTREME = [-(2**63), 2**63 - 1, 0, -1, 1, -2, 2**62]


def _one_home_keys(count, bits=6):
    """Keys whose hashes share their top ``bits`` bits: one home position
    in every table of up to 2**bits positions (long probe chains)."""
    candidates = np.arange(1, 200_000, dtype=np.int64)
    homes = (hash_keys(candidates, key_index._SALT) >> np.uint64(64 - bits)).astype(int)
    pick = candidates[homes == np.bincount(homes).argmax()]
    return pick[:count].tolist()


POOL = EXTREME + _one_home_keys(40) + list(range(100, 140))
_folders = itertools.count()


def _rows(keys, tag):
    """Rows that tell keys and writes apart."""
    k = np.asarray(keys, np.int64)
    low = (k % 1000).astype(np.float32)
    return {
        "values": np.stack([low, low + tag, np.full(k.size, tag, np.float32)], 1),
        "score": (k // 7 + tag).reshape(-1, 1),
    }


def _model_rows(model, keys):
    out = {f.name: np.zeros((len(keys), f.width), f.dtype) for f in FIELDS}
    for i, k in enumerate(keys):
        if k in model:
            for name in out:
                out[name][i] = model[k][name]
    return out


def _contents(store):
    out = {}
    for keys, rows in store.chunks(5):
        for i, k in enumerate(keys.tolist()):
            assert k not in out
            out[k] = {name: r[i].copy() for name, r in rows.items()}
    return out


def _check_equal(store, model):
    assert store.size == len(model)
    got = _contents(store)
    assert sorted(got) == sorted(model)
    for k, rows in model.items():
        for name in rows:
            np.testing.assert_array_equal(got[k][name], rows[name])


keys_st = st.lists(st.sampled_from(POOL), max_size=25)
ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.lists(st.sampled_from(POOL), unique=True)),
        st.tuples(st.just("read"), keys_st),
        st.tuples(st.just("erase"), keys_st),
        st.tuples(st.just("contains"), keys_st),
        st.tuples(st.just("chunks"), st.integers(1, 9)),
        st.tuples(st.just("clear"), st.none()),
        st.tuples(st.just("reopen"), st.none()),
    ),
    max_size=25,
)


def _run(store, ops, reopen):
    model = {}
    for step, (op, arg) in enumerate(ops):
        if op == "write":
            rows = _rows(arg, step)
            store.write(np.array(arg, np.int64), rows)
            for i, k in enumerate(arg):
                model[k] = {name: r[i] for name, r in rows.items()}
        elif op == "read":
            found, rows = store.read(np.array(arg, np.int64))
            assert found.tolist() == [k in model for k in arg]
            want = _model_rows(model, arg)
            for name in want:
                assert rows[name].dtype == want[name].dtype
                np.testing.assert_array_equal(rows[name], want[name])
        elif op == "erase":
            held = {k for k in arg if k in model}
            assert store.erase(np.array(arg, np.int64)) == len(held)
            for k in held:
                del model[k]
        elif op == "contains":
            got = store.contains(np.array(arg, np.int64))
            assert got.tolist() == [k in model for k in arg]
        elif op == "chunks":
            seen = []
            for keys, rows in store.chunks(arg):
                assert 0 < keys.size <= arg
                assert all(r.shape[0] == keys.size for r in rows.values())
                seen += keys.tolist()
            assert sorted(seen) == sorted(model)
        elif op == "clear":
            store.clear()
            model.clear()
        elif op == "reopen":
            store = reopen(store)
        assert store.size == len(model)
    _check_equal(store, model)
    return store


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4 rows and files that grow 4 rows at a time: growth and
    reads across blocks happen within a few keys."""
    monkeypatch.setattr(host_rows, "BLOCK_BYTES", 1)
    monkeypatch.setattr(host_rows, "MIN_BLOCK_ROWS", 4)
    monkeypatch.setattr(mapped_rows, "GROW_BYTES", 1)


@settings(max_examples=60, deadline=None)
@given(ops=ops_st, capacity=st.sampled_from([1, 3, 64]))
def test_host_store_matches_a_dict(ops, capacity):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_rows, "BLOCK_BYTES", 1)
        mp.setattr(host_rows, "MIN_BLOCK_ROWS", 4)
        _run(HostStore(FIELDS, initial_capacity=capacity), ops, lambda s: s)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=ops_st)
def test_disk_store_matches_a_dict_across_flush_and_reopen(ops, tmp_path):
    def reopen(store):
        store.close()  # flushes; one open store per folder
        return DiskStore.open(store.path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mapped_rows, "GROW_BYTES", 1)
        path = tmp_path / f"s{next(_folders)}"
        store = _run(DiskStore(path, FIELDS, initial_capacity=1), ops, reopen)
        want = _contents(store)
        store.close()
        with DiskStore.open(path) as again:
            assert again.size == len(want)
            for k, rows in _contents(again).items():
                for name in rows:
                    np.testing.assert_array_equal(rows[name], want[k][name])


def test_growth_far_past_the_initial_capacity(small_blocks):
    """5000 keys in blocks of 4 rows (1250 blocks), a table grown from 16
    positions, erased slots reused: every read matches the dict."""
    rng = np.random.default_rng(0)
    store = HostStore(FIELDS, initial_capacity=1)
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, 5000, endpoint=True))
    rng.shuffle(keys)
    store.write(keys[:10], _rows(keys[:10], 1))
    first = store._rows.blocks["values"][0]
    store.write(keys, _rows(keys, 1))
    # Growth adds blocks: the rows already held are never copied.
    assert store._rows.blocks["values"][0] is first
    assert store.erase(keys[:2000]) == 2000
    slots_before = store._slots
    store.write(keys[:1000], _rows(keys[:1000], 2))
    assert store._slots == slots_before  # freed slots taken again
    found, rows = store.read(keys)
    assert found.tolist() == [True] * 1000 + [False] * 1000 + [True] * 3000
    want = _rows(keys, 1)
    for name in want:
        want[name][:1000] = _rows(keys[:1000], 2)[name]
        want[name][1000:2000] = 0
        np.testing.assert_array_equal(rows[name], want[name])
    assert len(store._rows.blocks["values"]) > 1000


def test_keys_are_any_int64_and_uint64_keep_their_bits():
    store = HostStore(FIELDS)
    keys = np.array([2**63 - 1, -(2**63), -1, 0], np.int64)
    store.write(keys, _rows(keys, 0))
    found, rows = store.read(np.array([2**64 - 1, 2**63], np.uint64))
    assert found.tolist() == [True, True]
    np.testing.assert_array_equal(rows["score"], _rows(keys[[2, 1]], 0)["score"])
    assert not store.contains([5]).any()


@pytest.mark.parametrize("disk", [False, True])
def test_dense_stores_match_a_numpy_array(disk, tmp_path, monkeypatch):
    monkeypatch.setattr(dense_store, "INIT_CHUNK_BYTES", 7 * 20)  # 7 rows a call
    n = 50
    calls = []

    def initializer(first, end):
        calls.append((first, end))
        ids = np.arange(first, end)
        return {"values": np.stack([ids, -ids, ids * 2], 1), "score": ids * 3}

    if disk:
        store = DenseDiskStore(tmp_path / "d", FIELDS, n, initializer)
    else:
        store = DenseHostStore(FIELDS, n, initializer)
    assert calls == [(a, min(a + 7, n)) for a in range(0, n, 7)]
    ids = np.arange(n)
    values = np.stack([ids, -ids, ids * 2], 1).astype(np.float32)
    score = (ids * 3).reshape(-1, 1)
    rng = np.random.default_rng(1)
    for step in range(20):
        w = rng.choice(n, rng.integers(0, 10), replace=False)
        rows = _rows(w, step)
        store.write(w, rows)
        values[w], score[w] = rows["values"], rows["score"]
        e = rng.integers(0, n, 3)
        assert store.erase(e) == np.unique(e).size
        values[e], score[e] = 0, 0
        r = rng.integers(0, n, 12)
        found, got = store.read(r)
        assert found.all() and store.contains(r).all()
        np.testing.assert_array_equal(got["values"], values[r])
        np.testing.assert_array_equal(got["score"], score[r])
    chunks = list(store.chunks(8))
    assert all(k.size <= 8 for k, _ in chunks)
    np.testing.assert_array_equal(np.concatenate([k for k, _ in chunks]), ids)
    np.testing.assert_array_equal(
        np.concatenate([r["values"] for _, r in chunks]), values
    )
    assert store.size == n
    if disk:
        store.close()
        again = DenseDiskStore.open(tmp_path / "d")
        np.testing.assert_array_equal(again.read(ids)[1]["score"], score)
        again.clear()
        again.close()
        assert not DenseDiskStore.open(tmp_path / "d").read(ids)[1]["score"].any()


@pytest.mark.parametrize("kind", ["host", "disk", "dense_host", "dense_disk"])
def test_errors_name_the_argument_and_change_nothing(kind, tmp_path):
    make = {
        "host": lambda: HostStore(FIELDS),
        "disk": lambda: DiskStore(tmp_path / "k", FIELDS),
        "dense_host": lambda: DenseHostStore(FIELDS, 10),
        "dense_disk": lambda: DenseDiskStore(tmp_path / "d", FIELDS, 10),
    }[kind]
    store = make()
    assert isinstance(store, RowStore)
    store.write([1, 2, 3], _rows([1, 2, 3], 5))
    before = _contents(store)
    good = _rows([4, 5], 9)
    bad_calls = [
        (ValueError, "unique", lambda: store.write([4, 4], good)),
        (
            ValueError,
            "missing \\['score'\\]",
            lambda: store.write([4, 5], {"values": good["values"]}),
        ),
        (
            ValueError,
            "unknown \\['extra'\\]",
            lambda: store.write([4, 5], {**good, "extra": good["score"]}),
        ),
        (
            ValueError,
            r"shape \(2, 3\)",
            lambda: store.write([4, 5], {**good, "values": good["values"][:, :2]}),
        ),
        (
            TypeError,
            "int64",
            lambda: store.write([4, 5], {**good, "score": good["score"] + 0.5}),
        ),
        (TypeError, "integer array", lambda: store.write(np.array([4.0, 5.0]), good)),
        (ValueError, "1-D", lambda: store.write(np.array([[4, 5]]), good)),
        (ValueError, "rows_per_chunk", lambda: next(iter(store.chunks(0)))),
    ]
    if kind.startswith("dense"):
        bad_calls += [
            (ValueError, r"\[0, 10\)", lambda: store.write([4, 10], good)),
            (ValueError, r"\[0, 10\)", lambda: store.read([-1])),
        ]
    for error, match, call in bad_calls:
        with pytest.raises(error, match=match):
            call()
        after = _contents(store)
        assert sorted(after) == sorted(before)
        for k in before:
            for name in before[k]:
                np.testing.assert_array_equal(after[k][name], before[k][name])
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.read([1])


def test_disk_files_grow_in_large_sparse_steps(tmp_path):
    store = DiskStore(tmp_path / "s", FIELDS, initial_capacity=1)
    store.write([1, 2], _rows([1, 2], 0))
    # One step of at least GROW_BYTES, not one row at a time.
    assert os.path.getsize(tmp_path / "s" / "score.rows") >= mapped_rows.GROW_BYTES
    store.close()


def test_a_dense_initializer_of_the_wrong_shape_is_named():
    with pytest.raises(ValueError, match=r"initializer\(0, 4\).*shape \(4, 3\)"):
        DenseHostStore(FIELDS, 4, lambda a, b: _rows(np.arange(a, b + 1), 0))


def test_field_specs_are_checked():
    assert FieldSpec("a", 2, np.float32) == FieldSpec("a", 2, "float32")
    with pytest.raises(ValueError, match="name"):
        FieldSpec("../x", 1, "float32")
    with pytest.raises(ValueError, match="width"):
        FieldSpec("a", 0, "float32")
    with pytest.raises(TypeError, match="dtype"):
        FieldSpec("a", 1, "U3")
    with pytest.raises(ValueError, match="distinct"):
        HostStore([FIELDS[0], FIELDS[0]])


def test_chunks_raise_when_the_store_changes_underneath():
    store = HostStore(FIELDS)
    store.write(np.arange(10), _rows(np.arange(10), 0))
    it = store.chunks(3)
    next(it)
    store.write([99], _rows([99], 0))
    with pytest.raises(RuntimeError, match="changed"):
        next(it)


def _files_at_a_crash(path, copy):
    """The store reopened from a copy of ``path``'s files as they are now
    (what a crash of the process holding ``path`` would leave: mapped
    writes are in the page cache, and the folder stays locked while its
    store is open)."""
    shutil.copytree(path, copy)
    return DiskStore.open(copy)


def test_crash_between_flushes_keeps_the_last_flush(tmp_path):
    """Reopening without a flush (as after a crash) gives the keys of the
    last flush; a slot freed since then was not given to another key, so
    an erased-then-back key shows its own rows, never another's."""
    path = tmp_path / "s"
    store = DiskStore(path, FIELDS)
    store.write([10, 20], _rows([10, 20], 1))
    store.flush()
    store.erase([10])
    store.write([30], _rows([30], 2))  # must not take 10's slot
    store.write([20], _rows([20], 3))
    crashed = _files_at_a_crash(path, tmp_path / "crash1")
    assert crashed.contains([10, 20, 30]).tolist() == [True, True, False]
    found, rows = crashed.read([10, 20])
    # 10: its rows at the flush; 20: written in place since (newer).
    np.testing.assert_array_equal(rows["score"], [[10 // 7 + 1], [20 // 7 + 3]])
    store.flush()  # now the freed slot may be reused
    store.write([40], _rows([40], 4))
    assert store._slots == 3
    crashed = _files_at_a_crash(path, tmp_path / "crash2")
    assert crashed.contains([10, 20, 30, 40]).tolist() == [
        False,
        True,
        True,
        False,
    ]


def test_reopen_refuses_a_missing_or_inconsistent_store(tmp_path):
    path = tmp_path / "s"
    store = DiskStore(path, FIELDS)
    store.write([1, 2], _rows([1, 2], 0))
    store.close()
    manifest = path / "manifest.json"
    good = json.loads(manifest.read_text())

    def reopen_with(**changes):
        manifest.write_text(json.dumps({**good, **changes}))
        return DiskStore.open(path)

    with pytest.raises(StoreFormatError, match="index"):
        reopen_with(size=3)
    with pytest.raises(StoreFormatError, match="holds"):
        reopen_with(rows=10**6)
    with pytest.raises(StoreFormatError, match="version"):
        reopen_with(version=99)
    with pytest.raises(StoreFormatError, match="not a 'dense'"):
        manifest.write_text(json.dumps(good))
        DenseDiskStore.open(path)
    with pytest.raises(StoreFormatError, match="missing"):
        reopen_with(index="index-0.npz")
    with pytest.raises(StoreFormatError, match="manifest"):
        manifest.write_text("{not json")
        DiskStore.open(path)
    manifest.write_text(json.dumps(good))
    (path / "score.rows").unlink()
    with pytest.raises(StoreFormatError, match="score.rows"):
        DiskStore.open(path)
    manifest.unlink()
    with pytest.raises(FileNotFoundError, match="manifest.json is missing"):
        DiskStore.open(path)
    with pytest.raises(FileNotFoundError):
        DiskStore.open(tmp_path / "nothing")


def test_a_new_store_does_not_replace_one_unless_asked(tmp_path):
    path = tmp_path / "s"
    DiskStore(path, FIELDS).close()
    with pytest.raises(FileExistsError, match="DiskStore.open"):
        DiskStore(path, FIELDS)
    store = DiskStore(path, FIELDS[:1], overwrite=True)
    assert store.size == 0 and not (path / "score.rows").exists()
    assert sorted(os.listdir(path)) == sorted(
        [".lock", "manifest.json", "values.rows", store._index_name]
    )


def test_stats_count_the_operations(tmp_path):
    store = DiskStore(tmp_path / "s", FIELDS)
    store.write([1, 2, 3], _rows([1, 2, 3], 0))
    store.read([1, 4, 1])
    store.erase([2, 9])
    stats = store.stats()
    assert {
        k: stats[k] for k in ("size", "reads", "writes", "hits", "misses", "erases")
    } == {"size": 2, "reads": 3, "writes": 3, "hits": 2, "misses": 1, "erases": 1}
    row_bytes = 3 * 4 + 8
    assert stats["nbytes"] >= 2 * row_bytes
    assert stats["file_bytes"] >= os.path.getsize(tmp_path / "s" / "values.rows")


def test_specs_resolve_and_open_stores(tmp_path):
    assert ks.store.get(None) is None
    assert ks.store.get("host") == Host()
    disk = Disk(tmp_path / "t")
    assert ks.store.get(disk) is disk
    assert ks.store.get(ks.store.serialize(disk)) == disk
    assert Disk.from_config(disk.get_config()) == disk
    for bad in ["disk", "gpu", 3, {"class_name": "Nope"}]:
        with pytest.raises(ValueError, match='valid: None, "host"'):
            ks.store.get(bad)
    with pytest.raises(ValueError, match="initial_capacity"):
        Host(0)
    for spec in [Host(), disk]:
        keyed = spec.open_keyed(FIELDS, name="a")
        dense = spec.open_dense(
            FIELDS, 4, lambda a, b: _rows(np.arange(a, b), 1), name="b"
        )
        keyed.write([5], _rows([5], 0))
        assert keyed.contains([5, 6]).tolist() == [True, False]
        np.testing.assert_array_equal(dense.read([3])[1]["score"], [[3 // 7 + 1]])
        keyed.close()
        dense.close()
    # A layer opening its store again starts a new working set.
    assert disk.open_keyed(FIELDS, name="a").size == 0


def test_docstring_examples_run():
    from keras_sparse.store import dense_store as ds
    from keras_sparse.store import disk_store
    from keras_sparse.store import fields
    from keras_sparse.store import host_store
    from keras_sparse.store import specs

    for module in (ds, disk_store, fields, host_store, specs):
        assert doctest.testmod(module).failed == 0


def test_benchmark_runs_and_checks_what_it_reads(tmp_path):
    """benchmarks/row_store.py at 2000 keys: every op of every store is
    timed (the script itself asserts the rows it reads back)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "row_store.py")
    spec = importlib.util.spec_from_file_location("row_store_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    best = bench.run(2000, 1, tmp_path)
    assert sorted(best) == sorted(bench.STORES)
    for name, seconds in best.items():
        want = set(bench.OPS) - ({"flush"} if "Disk" not in name else set())
        assert set(seconds) == want and all(s > 0 for s in seconds.values())
    assert bench.table(best, 2000).count("\n| ") == 1 + len(bench.OPS)  # + header
    assert os.listdir(tmp_path) == []


def _row_file_flags(folder):
    """``{row file: VmFlags}`` of this process's maps of ``folder``'s row
    files (Linux ``/proc/self/smaps``)."""
    flags, current = {}, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if len(head) >= 6 and "-" in head[0] and head[-1].endswith(".rows"):
                current = head[-1] if head[-1].startswith(str(folder)) else None
            elif line.startswith("VmFlags:") and current is not None:
                flags[current] = line.split()[1:]
                current = None
    return flags


@pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps"
)
def test_disk_row_maps_are_advised_random_access_after_growth(tmp_path):
    """Training reads scattered rows: the maps must not read ahead around
    each one (the kernel marks such maps ``rr``), and chunks still read all."""
    store = DiskStore(tmp_path / "s", FIELDS, initial_capacity=1)
    keys = np.arange(5000, dtype=np.int64) * 7
    store.write(keys, _rows(keys, 1))  # grows, so the files are mapped anew
    flags = _row_file_flags(tmp_path / "s")
    assert len(flags) == len(FIELDS)
    assert all("rr" in f for f in flags.values()), flags
    seen = np.concatenate([k for k, _ in store.chunks(999)])
    np.testing.assert_array_equal(np.sort(seen), keys)
    store.close()
