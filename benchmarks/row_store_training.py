"""Training with a small device table over a row store vs a table holding
every key: samples/s, hit rate, rows moved and peak memory, side by side.

Each variant trains a `DistributedHashEmbedding` (``--layer dense``: an
`AllToAllDenseEmbedding` of ``--universe`` ids, ``cache_rows=--cache``;
``--dim`` wide, Adagrad,
summed over ``--fields`` keys per sample, a Dense head) with ``model.fit``
on the same Zipf-distributed keys, in a fresh process of its own (so peak
RSS is its own), the variants interleaved over ``--repeat`` rounds:

- ``whole``: ``capacity`` = every key of the universe (no eviction);
- ``host``: ``capacity=--cache``, evicted keys in host memory
  (``store="host"``);
- ``disk``: the same over memory-mapped files (``ks.store.Disk``) in a
  new folder under ``--store-dir`` (the system's temporary folder by
  default), deleted when the variant ends;
- ``disk-cold`` (hash layer): ``disk`` with the store's files dropped from
  the OS page cache after the warm steps (flushed, then
  ``posix_fadvise(DONTNEED)``), so the timed steps read stored rows from
  the disk.

``--stage`` trains every variant through `keras_sparse.data.prefetch`
(its table calls run batches ahead of the steps).

``--tune-allocator`` calls ``ks.tune_cpu_allocator()`` in every variant
before the layer is built (the setting recommended for JAX on a CPU: XLA's
step buffers reused, the tables' and slots' variables on huge pages).

``--reopen`` (disk): after training, ``flush_store()``, close the store and
time a new layer opening it in place (``ks.store.Disk(path, reopen=True)``)
and reading the last batch's ids, checked equal to the trained layer's.
Peak RSS is split into anonymous memory and mapped file pages (which the
OS may drop under pressure); "disk rd/step" is the bytes the process read
from storage per timed step (page faults on the store's files that the
page cache did not serve); "init s" is the time to build the layer (the
store's initialization for ``host``/``disk``).

    python benchmarks/row_store_training.py --quick
    python benchmarks/row_store_training.py --layer dense --universe 100000000 \
        --cache 1000000 --variants whole,host --repeat 1
    python benchmarks/row_store_training.py --layer dense --universe 280000000 \
        --cache 1000000 --variants disk --repeat 1 --steps 50 --reopen \
        --store-dir /var/tmp
    KERAS_BACKEND=torch python benchmarks/row_store_training.py

The table prints the median samples/s of each variant and its ratio to
``whole``, the share of key lookups the device table served (hits), the
rows moved per step (fills + write-backs) and their bytes, the process's
CPU time per timed step (every thread; less disturbed by other load than
wall time), and peak RSS.
Compare ratios from one run only.
"""

import argparse
import json
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


class MemoryPeaks:
    """Peaks of anonymous and file-backed resident memory (Linux
    ``/proc/self/status``), sampled every 50 ms by a daemon thread."""

    def __init__(self):
        self.peaks = {"RssAnon": 0, "RssFile": 0}
        self.sample()
        threading.Thread(target=self._run, daemon=True).start()

    def sample(self):
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    name, _, value = line.partition(":")
                    if name in self.peaks:
                        kb = int(value.split()[0])
                        self.peaks[name] = max(self.peaks[name], kb)
        except OSError:  # not Linux: only ru_maxrss is reported
            pass

    def _run(self):
        while True:
            time.sleep(0.05)
            self.sample()


def io_bytes():
    """This process's bytes read from and written to storage so far (Linux
    ``/proc/self/io``; zeros elsewhere)."""
    out = {"read_bytes": 0, "write_bytes": 0}
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name in out:
                    out[name] = int(value)
    except OSError:
        pass
    return out


def child(args):
    memory = MemoryPeaks()
    try:
        return _child(args, memory)
    finally:
        if args.folder is not None:
            shutil.rmtree(args.folder, ignore_errors=True)


def _child(args, memory):
    import keras
    import numpy as np

    import keras_sparse as ks

    rng = np.random.default_rng(0)
    n = args.steps * args.batch
    keys = rng.zipf(args.zipf, size=(n, args.fields)) % args.universe
    if args.layer == "hash":
        keys = (keys * 2654435761 + 17).astype("int64")
    else:  # ids of a fixed vocabulary, hot ones spread over the table
        keys = ((keys * 2654435761) % args.universe).astype("int64")
    target = rng.normal(size=(n, 1)).astype("float32")
    store = None
    capacity = args.universe
    if args.variant != "whole":
        capacity = args.cache
        store = "host"
        if args.variant.startswith("disk"):
            args.folder = tempfile.mkdtemp(prefix="ks_rows_", dir=args.store_dir)
            store = ks.store.Disk(args.folder)

    def new_layer(store):
        keras.utils.set_random_seed(0)
        if args.layer == "hash":
            return ks.DistributedHashEmbedding(
                args.dim, capacity=capacity, combiner="sum", optimizer="adagrad",
                store=store, name="ids",
            )  # fmt: skip
        cache = None if store is None else capacity
        return ks.AllToAllDenseEmbedding(
            args.universe, args.dim, combiner="sum", optimizer="adagrad",
            cache_rows=cache, store=store, name="ids",
            embeddings_initializer=args.initializer,
        )  # fmt: skip

    if args.tune_allocator:
        ks.tune_cpu_allocator()
    start = time.perf_counter()
    layer = new_layer(store)
    layer.build((None, args.fields))
    init_s = time.perf_counter() - start
    inputs = keras.Input((args.fields,), dtype="int64")
    model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
    model.compile("sgd", "mse")
    warm = args.warm_steps * args.batch

    def fit(x, y):
        if not args.stage:
            return model.fit(x, y, batch_size=args.batch, verbose=0)
        with ks.data.prefetch((x, y), model, batch_size=args.batch) as stage:
            return model.fit(stage, verbose=0)

    fit(keys[:warm], target[:warm])
    if "-cold" in args.variant:
        layer.flush_store()
        drop_page_cache(layer, args.folder)
    stats = layer.stats if args.variant != "whole" or args.layer == "hash" else None
    before = stats() if stats else {}
    io_before = io_bytes()
    start, cpu = time.perf_counter(), time.process_time()
    fit(keys[warm:], target[warm:])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    io_after = io_bytes()
    after = stats() if stats else {}
    steps = (n - warm) // args.batch
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    looked = delta.get("hits", 1) + delta.get("misses", 0)
    moved = delta.get("fills", 0) + delta.get("write_backs", 0)
    row_bytes = args.dim * 4 * 2  # values + Adagrad accumulator
    memory.sample()
    out = {
        "samples_s": (n - warm) / seconds,
        "hits": delta.get("hits", 1) / max(looked, 1),
        "moved_per_step": moved / steps,
        "moved_bytes_per_step": moved * row_bytes / steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_anon_mb": memory.peaks["RssAnon"] / 1024,
        "peak_file_mb": memory.peaks["RssFile"] / 1024,
        "disk_read_per_step": (io_after["read_bytes"] - io_before["read_bytes"])
        / steps,
        "store_size": after.get("store_size", 0),
        "init_s": init_s,
        "train_s": seconds,
        "cpu_ms_per_step": cpu * 1e3 / steps,
        "reopen_s": None,
    }
    if args.reopen and args.variant == "disk":
        out["reopen_s"] = reopen(args, layer, new_layer, keys[-args.batch :])
    print("RESULT " + json.dumps(out))


def drop_page_cache(layer, folder):
    """Drops the (flushed) files under ``folder`` from the OS page cache:
    the layer's store unmaps its pages (``MADV_DONTNEED``), which lets
    ``posix_fadvise(DONTNEED)`` drop them."""
    import mmap

    from keras_sparse.store.mapped_rows import _advise

    for rows in layer.row_tier.store._rows.maps.values():
        _advise(rows, mmap.MADV_DONTNEED)
    for path in pathlib.Path(folder).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def reopen(args, layer, new_layer, ids):
    """Seconds to open the trained store in place in a new layer and read
    ``ids`` (checked equal to the trained layer's output)."""
    import gc

    import numpy as np

    import keras_sparse as ks

    want = np.asarray(layer(ids, training=False))
    layer.flush_store()
    tier = layer.row_cache.row_tier if args.layer == "dense" else layer.row_tier
    tier.store.close()
    del layer, tier
    gc.collect()
    start = time.perf_counter()
    again = new_layer(ks.store.Disk(args.folder, reopen=True))
    got = np.asarray(again(ids, training=False))
    seconds = time.perf_counter() - start
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    return seconds


def run(args, variant):
    cmd = [sys.executable, __file__, "--child", variant] + args.passthrough
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{variant} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layer", choices=("hash", "dense"), default="hash")
    parser.add_argument("--universe", type=int, default=2_000_000)
    parser.add_argument("--cache", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--fields", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warm-steps", type=int, default=20)
    parser.add_argument(
        "--initializer",
        default="uniform",
        help="dense layer's embeddings_initializer (zeros: a store of 1e8+ "
        "rows is written at disk speed, without computing each id's row)",
    )
    parser.add_argument("--variants", default="whole,host,disk")
    parser.add_argument(
        "--store-dir", default=None, help="where disk stores go (a new folder each)"
    )
    parser.add_argument(
        "--reopen", action="store_true", help="time reopening the disk store"
    )
    parser.add_argument(
        "--stage", action="store_true", help="train through ks.data.prefetch"
    )
    parser.add_argument(
        "--tune-allocator",
        action="store_true",
        help="ks.tune_cpu_allocator() in every variant",
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.universe, args.cache, args.steps, args.repeat = 100_000, 10_000, 80, 1
    args.folder = None
    if args.steps <= args.warm_steps:
        parser.error("--steps must be above --warm-steps")
    if args.child:
        args.variant = args.child
        return child(args)
    args.passthrough = [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in (
            "layer",
            "universe",
            "cache",
            "dim",
            "fields",
            "batch",
            "steps",
            "zipf",
            "warm_steps",
            "initializer",
        )  # fmt: skip
    ]
    if args.store_dir is not None:
        args.passthrough.append(f"--store-dir={args.store_dir}")
    for flag in ("reopen", "stage", "tune_allocator"):
        if getattr(args, flag):
            args.passthrough.append(f"--{flag.replace('_', '-')}")
    variants = args.variants.split(",")
    results = {v: [] for v in variants}
    for _ in range(args.repeat):
        for variant in variants:  # interleaved: drifts hit every variant
            results[variant].append(run(args, variant))
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    print(
        f"backend={backend} layer={args.layer} universe={args.universe:,} "
        f"cache={args.cache:,} dim={args.dim} fields={args.fields} batch={args.batch} "
        f"zipf={args.zipf} steps={args.steps - args.warm_steps}+"
        f"{args.warm_steps} warm repeat={args.repeat} stage={args.stage} "
        f"tuned allocator={args.tune_allocator}"
    )
    base = statistics.median(r["samples_s"] for r in results[variants[0]])
    header = "variant            samples/s  ratio  cpu ms/step   hits"
    header += "   rows moved/step  bytes/step"
    header += "  disk rd/step  peak RSS MB  anon MB  file MB  init s  reopen s"
    print(header)
    for variant in variants:
        rows = results[variant]
        rate = statistics.median(r["samples_s"] for r in rows)
        last = rows[-1]
        reopened = last["reopen_s"]
        print(
            f"{variant:17s}  {rate:9.0f}  {rate / base:5.2f}x"
            f"  {statistics.median(r['cpu_ms_per_step'] for r in rows):11.3f}"
            f"  {last['hits']:5.1%}"
            f"  {last['moved_per_step']:15.0f}  {last['moved_bytes_per_step']:10.0f}"
            f"  {last['disk_read_per_step']:12.0f}"
            f"  {max(r['peak_rss_mb'] for r in rows):11.0f}"
            f"  {max(r['peak_anon_mb'] for r in rows):7.0f}"
            f"  {max(r['peak_file_mb'] for r in rows):7.0f}"
            f"  {statistics.median(r['init_s'] for r in rows):6.1f}"
            + ("         -" if reopened is None else f"  {reopened:8.2f}")
        )


if __name__ == "__main__":
    main()
