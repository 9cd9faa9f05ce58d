"""Throughput of keras_sparse.table.HashTable vs simple baselines.

CPU: a 4M-capacity table (NumPy twin) at load factors 0.5/0.75/0.95 with 1M-key
batches, against a Python dict loop and a warm ``pandas.Index.get_indexer``.
GPU (when CuPy sees a device): a 64M-capacity table at the same load factors
with 1M-key batches vs ``cupy.searchsorted`` on the sorted live keys, timed
with CUDA events (best of N; the events include ``lookup_or_insert``'s one
host read of its counts). On the GPU, ``lookup_or_insert`` runs as one
cooperative launch on every block (batches above 64K keys), and the same
batch on the multi-launch path (host syncs between its placement rounds)
is timed beside it.  ``lookup`` batches are 100% hits drawn from live
keys; ``lookup_or_insert`` batches are 50% live keys + 50% new keys, and the
table state is restored after every timed call so each repeat starts equal.

    python benchmarks/hash_table.py [--quick] [--device cpu|gpu|auto] [--grid-blocks N]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from keras_sparse.table import HashTable  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent / "out"
LOADS = (0.5, 0.75, 0.95)


def best_of(fn, reps, setup=None, sync=None):
    best = float("inf")
    for _ in range(reps):
        if setup:
            setup()
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t0)
    return best


def best_of_events(fn, reps, setup=None):
    """Best GPU time in seconds between two CUDA events around ``fn``."""
    import cupy as cp

    best = float("inf")
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(reps):
        if setup:
            setup()
        cp.cuda.Device().synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, end) / 1e3)
    return best


def snapshot(impl):
    names = ("keys", "digest", "score", "load", "holey")
    saved = {n: getattr(impl, n).copy() for n in names}
    size, clock = impl.size, impl.clock

    def restore():
        for n in names:
            getattr(impl, n)[...] = saved[n]
        impl.size, impl.clock = size, clock

    return restore


def fill(table, n, rng, xp=np, chunk=1 << 20):
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        table.lookup_or_insert(
            xp.asarray(rng.integers(-(2**63), 2**63 - 1, m, dtype=np.int64))
        )


def bench_cpu(capacity, batch, reps):
    return [_cpu_case(lf, capacity, batch, reps) for lf in LOADS]


def _cpu_case(lf, capacity, batch, reps):
    import pandas as pd

    rng = np.random.default_rng(int(lf * 100))
    t = HashTable(capacity, eviction="lru", device="cpu")
    fill(t, int(lf * t.capacity), rng)
    live = t.export()[0]
    hits = rng.choice(live, batch)
    mixed = np.concatenate(
        [
            rng.choice(live, batch // 2),
            rng.integers(-(2**63), 2**63 - 1, batch - batch // 2),
        ]
    )
    rng.shuffle(mixed)
    restore = snapshot(t._impl)
    t_lookup = best_of(lambda: t.lookup(hits), reps)
    t_insert = best_of(lambda: t.lookup_or_insert(mixed), reps, setup=restore)
    restore()
    index = pd.Index(live)
    index.get_indexer(hits)  # warm the pandas hash table
    t_pandas = best_of(lambda: index.get_indexer(hits), reps)
    base = {int(k): i for i, k in enumerate(live.tolist())}
    t_dict_lookup = best_of(lambda: [base.get(k, -1) for k in hits.tolist()], 2)
    holder = {}

    def dict_insert():
        d = holder["d"]
        for k in mixed.tolist():
            d.setdefault(k, len(d))

    t_dict_insert = best_of(
        dict_insert, 2, setup=lambda: holder.__setitem__("d", dict(base))
    )
    return dict(
        device="cpu",
        load=t.load_factor,
        lookup=batch / t_lookup,
        insert=batch / t_insert,
        pandas=batch / t_pandas,
        dict_lookup=batch / t_dict_lookup,
        dict_insert=batch / t_dict_insert,
    )


def bench_gpu(capacity, batch, reps):
    return [_gpu_case(lf, capacity, batch, reps) for lf in LOADS]


def _gpu_case(lf, capacity, batch, reps):
    import cupy as cp

    rng = np.random.default_rng(int(lf * 100))
    t = HashTable(capacity, eviction="lru", device="gpu")
    fill(t, int(lf * t.capacity), rng, xp=cp, chunk=1 << 23)
    live = t.export()[0]
    hits = live[cp.asarray(rng.integers(0, live.shape[0], batch))]
    mixed = cp.concatenate(
        [
            hits[: batch // 2],
            cp.asarray(rng.integers(-(2**63), 2**63 - 1, batch - batch // 2)),
        ]
    )
    mixed = mixed[cp.asarray(rng.permutation(batch))]
    restore = snapshot(t._impl)
    t.lookup(hits)  # compile/warm the kernels outside the timed region
    t.lookup_or_insert(mixed)
    restore()
    t_lookup = best_of_events(lambda: t.lookup(hits), reps)
    t_insert = best_of_events(lambda: t.lookup_or_insert(mixed), reps, setup=restore)
    restore()
    from keras_sparse.table import insert_call

    insert_call.GRID_ROUTE = False
    try:
        t.lookup_or_insert(mixed)
        restore()
        t_multi = best_of_events(lambda: t.lookup_or_insert(mixed), reps, setup=restore)
    finally:
        insert_call.GRID_ROUTE = True
    restore()
    sorted_keys = cp.sort(live)
    cp.searchsorted(sorted_keys, hits)
    t_ss = best_of_events(lambda: cp.searchsorted(sorted_keys, hits), reps)
    return dict(
        device="gpu",
        load=t.load_factor,
        lookup=batch / t_lookup,
        insert=batch / t_insert,
        multi=batch / t_multi,
        searchsorted=batch / t_ss,
    )


def print_table(rows):
    cols = ["device", "load", "lookup keys/s", "lookup_or_insert keys/s (50% new)"]
    cols += ["baseline", "baseline keys/s", "ratio"]
    print("| " + " | ".join(cols) + " |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["device"] == "cpu":
            base = [
                ("pandas get_indexer (lookup)", r["pandas"], r["lookup"]),
                ("dict loop get (lookup)", r["dict_lookup"], r["lookup"]),
                ("dict loop setdefault (insert)", r["dict_insert"], r["insert"]),
            ]
        else:
            base = [
                ("cupy.searchsorted (lookup)", r["searchsorted"], r["lookup"]),
                ("multi-launch lookup_or_insert", r["multi"], r["insert"]),
            ]
        for name, b, ours in base:
            cells = [r["device"], f"{r['load']:.3f}", f"{r['lookup']:.3g}"]
            cells += [f"{r['insert']:.3g}", name, f"{b:.3g}", f"{ours / b:.2f}x"]
            print("| " + " | ".join(cells) + " |")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for dev in sorted({r["device"] for r in rows}):
        rs = [r for r in rows if r["device"] == dev]
        loads = [r["load"] for r in rs]
        axes[0].plot(loads, [r["lookup"] for r in rs], "o-", label=f"HashTable {dev}")
        axes[1].plot(loads, [r["insert"] for r in rs], "o-", label=f"HashTable {dev}")
        if dev == "cpu":
            axes[0].plot(
                loads, [r["pandas"] for r in rs], "s--", label="pandas get_indexer"
            )
            axes[0].plot(
                loads, [r["dict_lookup"] for r in rs], "^--", label="dict loop"
            )
            axes[1].plot(
                loads,
                [r["dict_insert"] for r in rs],
                "^--",
                label="dict setdefault loop",
            )
        else:
            axes[0].plot(
                loads, [r["searchsorted"] for r in rs], "s--", label="cupy.searchsorted"
            )
    for ax, title in zip(axes, ("lookup (100% hits)", "lookup_or_insert (50% new)")):
        ax.set(title=title, xlabel="load factor", ylabel="keys/s", yscale="log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="auto")
    p.add_argument(
        "--grid-blocks", type=int, default=None,
        help="blocks of a GPU call above 64K keys (default: one per multiprocessor)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.grid_blocks:
        from keras_sparse.table import launches

        launches.GRID_BLOCKS = args.grid_blocks
    gpu_ok = False
    if args.device in ("gpu", "auto"):
        try:
            import cupy

            gpu_ok = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            gpu_ok = False
        if args.device == "gpu" and not gpu_ok:
            sys.exit("--device gpu: CuPy sees no CUDA device")
    rows = []
    if args.device in ("cpu", "auto"):
        cap, batch = (1 << 16, 1 << 14) if args.quick else (1 << 22, 1 << 20)
        rows += bench_cpu(cap, batch, 2 if args.quick else 3)
    if gpu_ok:
        cap, batch = (1 << 20, 1 << 16) if args.quick else (1 << 26, 1 << 20)
        rows += bench_gpu(cap, batch, 3 if args.quick else 10)
    print_table(rows)
    plot(rows, OUT / "hash_table.png")
    print(f"\nplot: {OUT / 'hash_table.png'}")


if __name__ == "__main__":
    main()
