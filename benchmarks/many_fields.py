"""Many bag fields, big batches: the shape of a public GPU embedding demo.

Batch 65,536; 100 fields of 10 ids each (bags, ``combiner="sum"``), an
8,192-id vocabulary per field, dim 4; the 400 pooled values go through a
6 x Dense(1024, relu) MLP to Dense(1, sigmoid), binary crossentropy, Adam
everywhere. Variants, one model each, the same batches:

* ``keras``: 100 ``keras.layers.Embedding(8192, 4)`` summed over the bag
  axis, trained by the model's (dense) Adam;
* ``dense``: 100 ``ks.AllToAllDenseEmbedding(8192, 4, combiner="sum",
  optimizer="adam")`` (lazy Adam on the rows a batch touched; with this
  many ids per row the update runs over the whole table,
  `keras_sparse.ops.dense_row_updates`);
* ``dense-sorted``: the same with that route switched off (the ids sorted
  and deduplicated, only the touched rows gathered and scattered);
* ``hash-gpu`` / ``hash-cpu``: a ``ks.HashEmbeddingCollection`` of 100
  ``ks.DistributedHashEmbedding(4, capacity=2 * 8192, combiner="sum",
  optimizer="adam")`` fields with CUDA / NumPy tables: exact rows for any
  key, one table call per step for the fields;
* ``hash-gpu-1team``: ``hash-gpu`` with the step's large table calls run
  one after another on every block of the launch (one team), instead of
  side by side on teams of blocks (`keras_sparse.table.launches`).

Each variant trains ``--warmup`` steps (compiling), then ``--steps`` timed
``train_on_batch`` calls on batches already on the device (two batches,
alternating); prints the median ms per iteration and the ratio to
``keras``. Ids are uniform over the vocabulary, so every field sees most of
its ids every step.

    python benchmarks/many_fields.py                   # the demo's shape (GPU)
    python benchmarks/many_fields.py --quick           # smoke size (CPU)
    python benchmarks/many_fields.py --only hash-gpu --trace /tmp/t  # + profile

With ``--trace DIR`` each variant also records a JAX profiler trace of
``--trace-steps`` steps into ``DIR/<variant>/`` and prints its summary
(`benchmarks/trace_summary.py`: busy time and costliest events per device
stream and host thread).
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_sparse as ks  # noqa: E402

VARIANTS = ("keras", "dense", "dense-sorted", "hash-gpu", "hash-gpu-1team", "hash-cpu")


def field_names(args):
    return [f"f{i}" for i in range(args.fields)]


def embeddings(variant, args):
    """``(pool, layers)``: a function from the input dict to the pooled
    parts, and the embedding layers it uses."""
    names = field_names(args)
    if variant == "keras":
        layers = {
            n: keras.layers.Embedding(args.vocab, args.dim, name=f"{n}_emb")
            for n in names
        }

        def pool(x):
            return [keras.ops.sum(layers[n](x[n]), axis=1) for n in names]

        return pool, layers
    if variant.startswith("dense"):
        layers = {
            n: ks.AllToAllDenseEmbedding(
                args.vocab, args.dim, combiner="sum", optimizer="adam", name=f"{n}_emb"
            )
            for n in names
        }
        return (lambda x: [layers[n](x[n]) for n in names]), layers
    layers = {
        n: ks.DistributedHashEmbedding(
            args.dim,
            capacity=2 * args.vocab,
            combiner="sum",
            optimizer="adam",
            table_device=variant.split("-")[1],
            name=f"{n}_emb",
        )
        for n in names
    }
    collection = ks.HashEmbeddingCollection(layers, name="fields")

    def pool(x):
        out = collection(x)
        return [out[n] for n in names]

    return pool, layers


def build(variant, args):
    names = field_names(args)
    inputs = {n: keras.Input((args.bag,), dtype="int32", name=n) for n in names}
    pool, _ = embeddings(variant, args)
    h = keras.layers.Concatenate()(pool(inputs))
    for _ in range(args.layers):
        h = keras.layers.Dense(args.width, activation="relu")(h)
    y = keras.layers.Dense(1, activation="sigmoid")(h)
    model = keras.Model(inputs, y)
    model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy")
    return model


def batches(args, count=2):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        x = {
            n: rng.integers(0, args.vocab, (args.batch, args.bag), dtype=np.int32)
            for n in field_names(args)
        }
        y = rng.integers(0, 2, (args.batch, 1)).astype(np.float32)
        out.append(on_device(x, y))
    return out


def on_device(x, y):
    if keras.backend.backend() == "jax":
        import jax

        return jax.device_put(x), jax.device_put(y)
    return x, y


def timed(variant, args, data):
    """Median ms per step and the last loss (a trace summary with --trace)."""
    from keras_sparse.ops import dense_row_updates

    # The route is chosen when the step is traced (the first call).
    dense_row_updates.FORCE_DENSE_ROUTE = False if variant == "dense-sorted" else None
    if variant.startswith("hash-gpu"):
        from keras_sparse.table import launches

        launches.GRID_TEAMS = 1 if variant == "hash-gpu-1team" else None
    model = build(variant, args)
    for i in range(args.warmup):
        model.train_on_batch(*data[i % 2])
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = model.train_on_batch(*data[i % 2])  # a Python float: synced
        times.append(time.perf_counter() - t0)
    if args.trace:
        TRACES.append((variant, record_trace(model, data, args, variant)))
    return 1e3 * statistics.median(times), float(loss)


TRACES = []


def record_trace(model, data, args, name):
    """Profile ``--trace-steps`` steps of ``model``; the summary's lines."""
    import jax
    import trace_summary

    folder = pathlib.Path(args.trace) / name
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for i in range(args.trace_steps):
            loss = model.train_on_batch(*data[i % 2])
        float(loss)
    events = trace_summary.load(folder)
    return trace_summary.summarize(events, args.top, args.trace_steps)


def device_name():
    if keras.backend.backend() == "jax":
        import jax

        d = jax.devices()[0]
        return f"jax {d.platform}: {getattr(d, 'device_kind', d)}"
    return keras.backend.backend()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--fields", type=int, default=100)
    parser.add_argument("--bag", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", default="", help=",".join(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="smoke size")
    parser.add_argument("--trace", default="", help="folder for profiler traces")
    parser.add_argument("--trace-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="events per trace track")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.fields, args.vocab, args.width = 512, 8, 256, 64
        args.warmup, args.steps = 2, 3
    gpu = not device_name().startswith("jax cpu")
    wanted = args.only.split(",") if args.only else [
        v for v in VARIANTS if v.startswith("hash-gpu") == gpu or "hash" not in v
    ]  # fmt: skip
    print(
        f"device: {device_name()}\nbatch {args.batch:,}, {args.fields} fields "
        f"x {args.bag} ids (sum), vocab {args.vocab:,} per field, dim "
        f"{args.dim}, {args.layers} x Dense({args.width}), Adam; median of "
        f"{args.steps} steps after {args.warmup}\n"
    )
    data = batches(args)
    rows = [(v, *timed(v, args, data)) for v in wanted]
    base = dict((v, ms) for v, ms, _ in rows).get("keras")
    print("| variant | ms / iteration | vs keras | loss |\n|---|---:|---:|---:|")
    for v, ms, loss in rows:
        ratio = f"{ms / base:.2f}x" if base else "-"
        print(f"| {v} | {ms:.1f} | {ratio} | {loss:.4f} |")
    for v, lines in TRACES:
        print(f"\n### trace: {v}\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
