"""Where a compiled step's time goes with GPU hash tables.

The 26-field model of ``benchmarks/hash_embedding.py`` (batch 8192, dim 16,
16,384 rows per field, Adagrad), one compiled training step per variant:

* ``Embedding``: keras Embedding fed hashed bins (the floor: no table);
* ``AllToAllDenseEmbedding``: the same bins into our fixed-vocabulary layer
  (the sparse row updates, no table);
* ``hash layers``: 26 ``DistributedHashEmbedding(table_device="gpu")``,
  raw int64 keys into ``fit`` (in-step GPU-buffer callbacks);
* ``collection``: the same fields in one ``HashEmbeddingCollection`` (one
  callback, one launch per step);
* ``collection, int32 keys``: the same with keys folded below 2**31, so no
  full-key restore is needed (JAX without x64);
* ``collection, XLA stand-in``: the collection with its callback replaced
  by ``rows = key % rows`` computed in XLA (no table, no callback): what the
  step costs around the table call.

Per step: wall time, and host time inside the callbacks (the callback
body, the table launches, the full-key restore).

    python benchmarks/gpu_step_profile.py          # on a GPU with CuPy
    python benchmarks/gpu_step_profile.py --only collection
    python benchmarks/gpu_step_profile.py --trace out/trace  # + profiler traces

With ``--trace DIR`` each variant also records a JAX profiler trace of
``--trace-steps`` steps into ``DIR/<variant>/`` and prints its summary
(device streams and host threads, busy time per step and the costliest
events: `benchmarks/trace_summary.py`).
"""

import argparse
import collections
import contextlib
import functools
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import hash_embedding as bench  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import trace_summary  # noqa: E402

import keras_sparse.table  # noqa: E402
from keras_sparse.data import criteo_like  # noqa: E402
from keras_sparse.layers import AllToAllDenseEmbedding  # noqa: E402
from keras_sparse.layers import jax_key_queue  # noqa: E402
from keras_sparse.layers.hash import jax_group_mapping  # noqa: E402
from keras_sparse.layers.hash import jax_step_mapping  # noqa: E402
from keras_sparse.layers.hash.embedding import DistributedHashEmbedding  # noqa: E402

SAMPLES, BATCH, CAPACITY = 1 << 17, 8192, 1 << 14
spent = collections.Counter()


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0

    return wrapper


def instrument():
    """Host timers around the callback bodies, table calls and restores."""
    for name in ("_gpu_rows", "_table_rows"):
        fn = getattr(DistributedHashEmbedding, name)
        setattr(DistributedHashEmbedding, name, timed(name, fn))
    jax_key_queue.restore = timed("restore", jax_key_queue.restore)
    for name in ("_gpu_rows", "_restore_together"):
        fn = getattr(jax_group_mapping, name)
        setattr(jax_group_mapping, name, timed(f"group{name}", fn))
    together = keras_sparse.table.step_rows_together
    keras_sparse.table.step_rows_together = timed("together", together)


def dense_model(bins):
    keras.utils.set_random_seed(0)
    inputs = {
        f"cat_{f}": keras.Input((), dtype="int32", name=f"cat_{f}")
        for f in range(bench.FIELDS)
    }
    parts = [
        AllToAllDenseEmbedding(bins, bench.DIM, optimizer="adagrad", name=f"e{f}")(k)
        for f, k in enumerate(inputs.values())
    ]
    return bench._head(parts, inputs)


@contextlib.contextmanager
def xla_stand_in():
    """The step's table callback replaced by rows computed in XLA."""
    import jax.numpy as jnp

    def rows_in_step(owner, route, keys, use, n, host_rows, gpu_rows):
        rows = (keys.astype(jnp.uint32) % CAPACITY).astype(jnp.int32)
        return rows, jnp.zeros((n,), bool)

    original = jax_step_mapping.rows_in_step
    jax_step_mapping.rows_in_step = rows_in_step
    try:
        yield
    finally:
        jax_step_mapping.rows_in_step = original


def variants(keys, bins):
    folded = {k: (v % (1 << 31)).astype(np.int32) for k, v in keys.items()}
    hashed = {k: bench._splitmix64_bins(v, CAPACITY) for k, v in keys.items()}
    return {
        "Embedding (hashed bins)": (lambda: bench.baseline_model(CAPACITY), hashed),
        "AllToAllDenseEmbedding (hashed bins)": (
            lambda: dense_model(CAPACITY),
            hashed,
        ),
        "hash layers, GPU tables": (
            lambda: bench.hash_model(CAPACITY, "gpu", key_dtype="int64"),
            keys,
        ),
        "collection, GPU tables": (
            lambda: bench.hash_model(CAPACITY, "gpu", "int64", together=True),
            keys,
        ),
        "collection, int32 keys": (
            lambda: bench.hash_model(CAPACITY, "gpu", "int32", together=True),
            folded,
        ),
        "collection, XLA stand-in": (
            lambda: bench.hash_model(CAPACITY, "gpu", "int32", together=True),
            folded,
        ),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only",
        default="",
        help="variants whose name has one of these (comma-separated)",
    )
    parser.add_argument("--trace", default="", help="folder for profiler traces")
    parser.add_argument("--trace-steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=12, help="events per track")
    parser.add_argument(
        "--trace-python", action="store_true", help="trace Python calls too (slower)"
    )
    args = parser.parse_args()
    features, labels = criteo_like(SAMPLES, hashed_keys=True, scale=0.01, seed=0)
    keys = {f"cat_{f}": features[f"cat_{f}"] for f in range(bench.FIELDS)}
    instrument()
    steps = SAMPLES // BATCH
    print(f"device: {bench.device_description()}; {bench.FIELDS} fields, batch "
          f"{BATCH}, {CAPACITY:,} rows per field; median of 2 epochs of "
          f"{steps} steps\n")  # fmt: skip
    traces = []
    print("| variant | step ms | callbacks ms | table ms | key restore ms |")
    print("|---|---:|---:|---:|---:|")
    for name, (build, x) in variants(keys, CAPACITY).items():
        if not any(part in name for part in args.only.split(",")):
            continue
        stand_in = "stand-in" in name
        with xla_stand_in() if stand_in else contextlib.nullcontext():
            model = build()
            fit = bench.epoch_on_arrays(model, x, labels, BATCH)
            fit()  # compiles (the stand-in is traced here), fills the tables
            if args.trace:
                traces.append((name, record_trace(model, x, labels, args, name)))
        times, parts = [], []
        for _ in range(2):
            spent.clear()
            t0 = time.perf_counter()
            fit()
            times.append(time.perf_counter() - t0)
            parts.append(dict(spent))
        best = parts[int(np.argsort(times)[0])]
        body = best.get("_gpu_rows", 0) + best.get("group_gpu_rows", 0)
        table = best.get("_table_rows", 0) + best.get("together", 0)
        restore = best.get("restore", 0) + best.get("group_restore_together", 0)
        step = 1e3 * statistics.median(times) / steps
        cells = [1e3 * c / steps for c in (body, table, restore)]
        print(
            f"| {name} | {step:.2f} | " + " | ".join(f"{c:.2f}" for c in cells) + " |"
        )
    for name, lines in traces:
        print(f"\n### trace: {name}\n")
        print("\n".join(lines))


def record_trace(model, x, labels, args, name):
    """Profile ``--trace-steps`` steps of ``model``; the summary's lines."""
    import jax

    n = args.trace_steps * BATCH
    part = {k: v[:n] for k, v in x.items()}
    fit = bench.epoch_on_arrays(model, part, labels[:n], BATCH)
    fit()  # a new data adapter: keep its first-call costs out of the trace
    folder = pathlib.Path(args.trace) / "".join(c if c.isalnum() else "_" for c in name)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = int(args.trace_python)
    with jax.profiler.trace(
        str(folder), create_perfetto_trace=True, profiler_options=options
    ):
        fit()
    events = trace_summary.load(folder)
    return trace_summary.summarize(events, args.top, args.trace_steps)


if __name__ == "__main__":
    main()
