"""What one GPU-table ``lookup_or_insert`` costs, eviction rounds fused or not.

A full CUDA table (``HashTable(device="gpu")``) takes Zipf batches, so every
call evicts; once every pending key's buckets are full, the eviction rounds
run either all in one ``ks_evict_rounds`` launch (the default) or one round
at a time in host-orchestrated CuPy code (``ArrayTable._evict_rounds``, what
the table did before). Both give identical rows (``tests/gpu``).

On a real GPU the table prints milliseconds per call. On the CPU emulation
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
from keras_sparse.table.numpy_table import ArrayTable  # noqa: E402

EMULATED = getattr(cp, "EMULATED", False)


def zipf_batches(batch, calls, seed):
    rng = np.random.default_rng(seed)
    for _ in range(calls):
        ids = rng.zipf(1.1, batch) % 10_000_000
        yield (ids.astype(np.int64) * -0x61C8864680B583EB).astype(np.int64)


def measure(fused, args):
    table = HashTable(args.capacity, device="gpu", eviction=args.eviction)
    if not fused:  # the per-round CuPy code, bound to this table only
        impl = table._impl
        impl._evict_rounds = ArrayTable._evict_rounds.__get__(impl)
    for keys in zipf_batches(args.batch, args.warmup, seed=1):  # fill the table
        table.lookup_or_insert(cp.asarray(keys))
    batches = [cp.asarray(k) for k in zipf_batches(args.batch, args.calls, seed=2)]
    times, counts = [], []
    for keys in batches:
        before = dict(cp.stats) if EMULATED else None
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        table.lookup_or_insert(keys)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacity", type=int, default=1 << 14)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--eviction", default="lru", choices=["lru", "lfu"])
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
    rows = {name: measure(name == "fused", args) for name in ("fused", "per-round")}
    cols = ["syncs", "ops", "kernels"] if EMULATED else ["ms"]
    head = ["eviction rounds"] + [f"{c} per call" for c in cols] + ["vs per-round"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    base = rows["per-round"]
    for name, row in rows.items():
        key = cols[0]
        ratio = base[key] / row[key] if row[key] else float("inf")
        cells = [f"{row[c]:,.1f}" if c != "ms" else f"{row[c]:.3f}" for c in cols]
        gain = "baseline" if row is base else f"{ratio:.1f}x less ({key})"
        print(f"| {name} | " + " | ".join(cells) + f" | {gain} |")
    assert rows["fused"]["evictions"] == base["evictions"]  # same work done
    print(
        f"\nboth: {base['evictions']:,} evictions in all, load factor "
        f"{base['load']:.2f} (identical rows: tests/gpu/test_hash_table_gpu.py)"
    )


if __name__ == "__main__":
    main()
