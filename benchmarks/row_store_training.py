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
- ``disk``: the same over memory-mapped files (``ks.store.Disk``).

    python benchmarks/row_store_training.py --quick
    python benchmarks/row_store_training.py --layer dense --universe 100000000 \
        --cache 1000000 --variants whole,host --repeat 1
    KERAS_BACKEND=torch python benchmarks/row_store_training.py

The table prints the median samples/s of each variant and its ratio to
``whole``, the share of key lookups the device table served (hits), the
rows moved per step (fills + write-backs) and their bytes, and peak RSS.
Compare ratios from one run only.
"""

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def child(args):
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
        if args.variant == "disk":
            store = ks.store.Disk(tempfile.mkdtemp(prefix="ks_rows_"))
    keras.utils.set_random_seed(0)
    inputs = keras.Input((args.fields,), dtype="int64")
    if args.layer == "hash":
        layer = ks.DistributedHashEmbedding(
            args.dim, capacity=capacity, combiner="sum", optimizer="adagrad",
            store=store,
        )  # fmt: skip
    else:
        cache = None if store is None else capacity
        layer = ks.AllToAllDenseEmbedding(
            args.universe, args.dim, combiner="sum", optimizer="adagrad",
            cache_rows=cache, store=store,
        )  # fmt: skip
    model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
    model.compile("sgd", "mse")
    warm = 20 * args.batch
    model.fit(keys[:warm], target[:warm], batch_size=args.batch, verbose=0)
    stats = layer.stats if args.variant != "whole" or args.layer == "hash" else None
    before = stats() if stats else {}
    start = time.perf_counter()
    model.fit(keys[warm:], target[warm:], batch_size=args.batch, verbose=0)
    seconds = time.perf_counter() - start
    after = stats() if stats else {}
    steps = (n - warm) // args.batch
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    looked = delta.get("hits", 1) + delta.get("misses", 0)
    moved = delta.get("fills", 0) + delta.get("write_backs", 0)
    row_bytes = args.dim * 4 * 2  # values + Adagrad accumulator
    out = {
        "samples_s": (n - warm) / seconds,
        "hits": delta.get("hits", 1) / max(looked, 1),
        "moved_per_step": moved / steps,
        "moved_bytes_per_step": moved * row_bytes / steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "store_size": after.get("store_size", 0),
    }
    print("RESULT " + json.dumps(out))


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
    parser.add_argument("--variants", default="whole,host,disk")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.universe, args.cache, args.steps, args.repeat = 100_000, 10_000, 80, 1
    if args.child:
        args.variant = args.child
        return child(args)
    args.passthrough = [
        f"--{name}={getattr(args, name)}"
        for name in (
            "layer",
            "universe",
            "cache",
            "dim",
            "fields",
            "batch",
            "steps",
            "zipf",
        )  # fmt: skip
    ]
    variants = args.variants.split(",")
    results = {v: [] for v in variants}
    for _ in range(args.repeat):
        for variant in variants:  # interleaved: drifts hit every variant
            results[variant].append(run(args, variant))
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    print(
        f"backend={backend} layer={args.layer} universe={args.universe:,} "
        f"cache={args.cache:,} dim={args.dim} fields={args.fields} batch={args.batch} "
        f"zipf={args.zipf} repeat={args.repeat}"
    )
    base = statistics.median(r["samples_s"] for r in results[variants[0]])
    header = "variant  samples/s  ratio   hits   rows moved/step  bytes/step"
    header += "  peak RSS MB"
    print(header)
    for variant in variants:
        rows = results[variant]
        rate = statistics.median(r["samples_s"] for r in rows)
        last = rows[-1]
        print(
            f"{variant:7s}  {rate:9.0f}  {rate / base:5.2f}x  {last['hits']:5.1%}"
            f"  {last['moved_per_step']:15.0f}  {last['moved_bytes_per_step']:10.0f}"
            f"  {max(r['peak_rss_mb'] for r in rows):11.0f}"
        )


if __name__ == "__main__":
    main()
