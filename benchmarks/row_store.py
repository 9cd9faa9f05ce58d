"""Throughput of the row stores (`keras_sparse.store`), keys per second.

1e6 random int64 keys (dense stores: ids 0..1e6-1 in random order), each
with two fields of 16 float32 (an embedding row and one optimizer slot),
as a layer's cache would write back and fill them. Per store, in order:

* insert: the keys written into a new, empty store (growth included);
* overwrite: the same keys again, shuffled (rows found, rewritten);
* read: every key, shuffled (all hits);
* read 50% miss: half held keys, half absent ones;
* contains: the same mixed batch;
* chunks: every key read back, 65536 at a time;
* erase: half the keys;
* flush: disk stores (rows synced, index and manifest written).

Best of ``--reps`` runs, each on a fresh store (disk stores in a new
folder under ``--folder``, by default the system's temporary folder).
Disk numbers are page-cache numbers (the files fit in RAM here): they
measure the store's own work, not the disk. A read of 1e6 rows returns
two new 64 MB arrays, which glibc maps fresh from the kernel (a page
fault per 4 KiB page on first write) unless ``--tune-allocator`` keeps
freed memory for reuse (`keras_sparse.tune_cpu_allocator`).

    python benchmarks/row_store.py [--keys 1000000] [--reps 3] [--quick]
                                   [--tune-allocator]
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from keras_sparse import store as ks_store  # noqa: E402

FIELDS = (
    ks_store.FieldSpec("values", 16, "float32"),
    ks_store.FieldSpec("slot", 16, "float32"),
)
STORES = ("HostStore", "DiskStore", "DenseHostStore", "DenseDiskStore")
OPS = (
    "insert",
    "overwrite",
    "read",
    "read 50% miss",
    "contains",
    "chunks",
    "erase",
    "flush",
)


def _make(name, n, folder):
    if name == "HostStore":
        return ks_store.HostStore(FIELDS)
    if name == "DiskStore":
        return ks_store.DiskStore(folder, FIELDS)
    if name == "DenseHostStore":
        return ks_store.DenseHostStore(FIELDS, n)
    return ks_store.DenseDiskStore(folder, FIELDS, n)


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_run(name, n, folder, rng):
    """Seconds per op of one fresh store."""
    dense = name.startswith("Dense")
    if dense:
        keys = rng.permutation(n).astype(np.int64)
        other = rng.permutation(n).astype(np.int64)  # dense: every id is held
    else:
        keys = rng.integers(-(2**63), 2**63 - 1, n, endpoint=True)
        other = rng.integers(-(2**63), 2**63 - 1, n, endpoint=True)
    rows = {f.name: rng.random((n, f.width), dtype=np.float32) for f in FIELDS}
    shuffled = rng.permutation(n)
    mixed = np.concatenate([keys[: n // 2], other[: n - n // 2]])[rng.permutation(n)]
    store = _make(name, n, folder)
    seconds = {}
    seconds["insert"] = _timed(lambda: store.write(keys, rows))
    again = {k: v[shuffled] for k, v in rows.items()}
    seconds["overwrite"] = _timed(lambda: store.write(keys[shuffled], again))
    seconds["read"] = _timed(lambda: store.read(keys[shuffled]))
    seconds["read 50% miss"] = _timed(lambda: store.read(mixed))
    seconds["contains"] = _timed(lambda: store.contains(mixed))
    seconds["chunks"] = _timed(lambda: sum(k.size for k, _ in store.chunks()))
    seconds["erase"] = _timed(lambda: store.erase(keys[: n // 2]))
    if "Disk" in name:
        seconds["flush"] = _timed(store.flush)
    found, got = store.read(keys[n // 2 :])
    assert found.all() and np.array_equal(got["slot"], rows["slot"][n // 2 :])
    store.close()
    return seconds


def run(n, reps, folder):
    """``{store: {op: best seconds}}``."""
    rng = np.random.default_rng(0)
    best = {}
    for name in STORES:
        for rep in range(reps):
            path = pathlib.Path(folder) / f"{name}-{rep}"
            try:
                seconds = one_run(name, n, path, rng)
            finally:
                shutil.rmtree(path, ignore_errors=True)
            mine = best.setdefault(name, {})
            for op, s in seconds.items():
                mine[op] = min(mine.get(op, float("inf")), s)
    return best


def table(best, n):
    lines = [
        f"{n:.0e} keys x (16 + 16) float32; million keys/s (ms), best of runs",
        "",
        "| op | " + " | ".join(best) + " |",
        "|---|" + "---|" * len(best),
    ]
    for op in OPS:
        cells = []
        for name in best:
            s = best[name].get(op)
            if s is None:
                cells.append("-")
            elif op == "flush":
                cells.append(f"({s * 1e3:.0f} ms)")
            else:
                count = n // 2 if op == "erase" else n
                cells.append(f"{count / s / 1e6:.2f} ({s * 1e3:.0f} ms)")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--folder", default=None)
    parser.add_argument("--quick", action="store_true", help="1e4 keys, 1 run")
    parser.add_argument(
        "--tune-allocator",
        action="store_true",
        help="keep freed memory for reuse (keras_sparse.tune_cpu_allocator)",
    )
    args = parser.parse_args()
    if args.tune_allocator:
        from keras_sparse import tune_cpu_allocator

        tune_cpu_allocator()
    n, reps = (10_000, 1) if args.quick else (args.keys, args.reps)
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        print(table(run(n, reps, folder), n))


if __name__ == "__main__":
    main()
