"""What one GPU-table ``lookup_or_insert`` costs, by route.

A full CUDA table (``HashTable(device="gpu")``) takes Zipf batches, so every
call evicts. Routes, all giving identical rows (``tests/gpu``):

* ``one-launch``: the whole call in one ``ks_insert_calls`` launch and one
  host read of its counts (the default for batches up to 64K keys);
* ``step-rows``: the same launch as a training step makes it
  (``HashTable.step_rows``): the counts stay on the device, no host read;
* ``multi-launch``: host-orchestrated CuPy code per phase with the eviction
  rounds in one ``ks_evict_rounds`` launch (larger batches; the default
  before ``ks_insert_calls``);
* ``per-round``: the same with one round at a time in CuPy code
  (``ArrayTable._evict_rounds``, the largest batches).

A second table times a training step of ``--fields`` hash fields (one
table each): ``step_rows`` per field, against ``step_rows_together``, which
runs every field's call in one launch (one block per table, what a
`HashEmbeddingCollection` does in a compiled JAX step).

On a real GPU the tables print milliseconds per call or step. On the CPU emulation
of CUDA (``tests/cuda_emulation``) time means nothing, so it prints what a
GPU would pay per call instead: host synchronizations, device operations
(each at least one kernel launch) and RawModule kernel launches.

    python benchmarks/gpu_table_calls.py                       # on a GPU
    PYTHONPATH=tests/cuda_emulation/fake_cupy:. \\
        python benchmarks/gpu_table_calls.py --calls 10        # emulated
"""

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from keras_sparse.table import HashTable  # noqa: E402
from keras_sparse.table import insert_call  # noqa: E402
from keras_sparse.table import step_rows_together  # noqa: E402
from keras_sparse.table.array_table import ArrayTable  # noqa: E402

EMULATED = getattr(cp, "EMULATED", False)


def zipf_batches(batch, calls, seed):
    rng = np.random.default_rng(seed)
    for _ in range(calls):
        ids = rng.zipf(1.1, batch) % 10_000_000
        yield (ids.astype(np.int64) * -0x61C8864680B583EB).astype(np.int64)


ROUTES = ("one-launch", "step-rows", "multi-launch", "per-round")


def measure(route, args):
    table = HashTable(args.capacity, device="gpu", eviction=args.eviction)
    one_launch_max = insert_call.MAX_KEYS
    if route in ("multi-launch", "per-round"):
        insert_call.MAX_KEYS = 0  # restored below
    if route == "per-round":  # the per-round CuPy code, bound to this table only
        impl = table._impl
        impl._evict_rounds = ArrayTable._evict_rounds.__get__(impl)
    call = table.step_rows if route == "step-rows" else table.lookup_or_insert
    try:
        return _timed_calls(table, call, args)
    finally:
        insert_call.MAX_KEYS = one_launch_max


def _timed_calls(table, call, args):
    for keys in zipf_batches(args.batch, args.warmup, seed=1):  # fill the table
        table.lookup_or_insert(cp.asarray(keys))
    batches = [cp.asarray(k) for k in zipf_batches(args.batch, args.calls, seed=2)]
    times, counts = [], []
    for keys in batches:
        before = dict(cp.stats) if EMULATED else None
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        call(keys)
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
        if EMULATED:
            counts.append({k: cp.stats[k] - before[k] for k in before})
    stats = table.stats()
    row = {
        "ms": 1e3 * statistics.median(times),
        "evictions": stats["evictions"],
        "load": stats["load_factor"],
    }
    if EMULATED:
        for k in ("syncs", "ops", "kernels"):
            row[k] = statistics.mean(c[k] for c in counts)
    return row


def measure_fields(together, args):
    """Per training step of ``args.fields`` fields: every field's step rows,
    by one launch (``together``) or one ``step_rows`` call per field."""
    tables = [
        HashTable(args.capacity, device="gpu", eviction=args.eviction, seed=f)
        for f in range(args.fields)
    ]
    for f, table in enumerate(tables):
        for keys in zipf_batches(args.batch, args.warmup, seed=100 + f):
            table.lookup_or_insert(cp.asarray(keys))
    n = args.fields * args.batch
    bounds = [(f * args.batch, (f + 1) * args.batch) for f in range(args.fields)]
    steps = [
        cp.asarray(np.concatenate(list(zipf_batches(args.batch, args.fields, s))))
        for s in range(args.calls)
    ]
    out = (cp.empty(n, dtype=cp.int32), cp.empty(n, dtype=cp.bool_))
    times, counts = [], []
    for keys in steps:
        before = dict(cp.stats) if EMULATED else None
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        if together:
            assert step_rows_together(tables, keys, None, bounds, out) == []
        else:
            for table, (a, b) in zip(tables, bounds):
                table.step_rows(keys[a:b], None, (out[0][a:b], out[1][a:b]))
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
        if EMULATED:
            counts.append({k: cp.stats[k] - before[k] for k in before})
    row = {
        "ms": 1e3 * statistics.median(times),
        "evictions": sum(t.stats()["evictions"] for t in tables),
    }
    if EMULATED:
        for k in ("syncs", "ops", "kernels", "host_to_device"):
            row[k] = statistics.mean(c[k] for c in counts)
    return row


def print_fields(args):
    rows = {
        f"step_rows per field ({args.fields} calls)": measure_fields(False, args),
        "step_rows_together (one launch)": measure_fields(True, args),
    }
    cols = ["syncs", "ops", "kernels", "host_to_device"] if EMULATED else ["ms"]
    print(
        f"\nper training step of {args.fields} fields ({args.batch:,} keys "
        "each, one table each):\n"
    )
    head = ["route"] + [f"{c} per step" for c in cols]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, row in rows.items():
        cells = [f"{row[c]:,.1f}" if c != "ms" else f"{row[c]:.3f}" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    first, second = rows.values()
    assert first["evictions"] == second["evictions"]  # same work done


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacity", type=int, default=1 << 14)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--eviction", default="lru", choices=["lru", "lfu"])
    parser.add_argument("--fields", type=int, default=26,
                        help="hash fields of the per-step table")  # fmt: skip
    args = parser.parse_args()
    device = (
        "CUDA emulated on the CPU (counts per call; times are not GPU times)"
        if EMULATED
        else cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    )
    print(
        f"device: {device}\ncapacity {args.capacity:,}, batch {args.batch:,} "
        f"Zipf(1.1) keys, eviction {args.eviction}, {args.calls} calls after "
        f"{args.warmup} warm-up calls\n"
    )
    rows = {name: measure(name, args) for name in ROUTES}
    cols = ["syncs", "ops", "kernels"] if EMULATED else ["ms"]
    head = ["route"] + [f"{c} per call" for c in cols] + ["vs multi-launch"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    base = rows["multi-launch"]
    for name, row in rows.items():
        key = "ops" if EMULATED else "ms"
        ratio = base[key] / row[key] if row[key] else float("inf")
        cells = [f"{row[c]:,.1f}" if c != "ms" else f"{row[c]:.3f}" for c in cols]
        gain = "baseline" if row is base else f"{ratio:.1f}x fewer {key}"
        if key == "ms" and row is not base:
            gain = f"{ratio:.1f}x faster"
        print(f"| {name} | " + " | ".join(cells) + f" | {gain} |")
    for row in rows.values():  # same work done
        assert row["evictions"] == base["evictions"]
    print(
        f"\nevery route: {base['evictions']:,} evictions in all, load factor "
        f"{base['load']:.2f} (identical rows: tests/gpu/test_hash_table_gpu.py)"
    )
    if args.fields:
        print_fields(args)


if __name__ == "__main__":
    main()
