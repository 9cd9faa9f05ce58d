"""Direct inference calls from several threads: calls/s against one thread.

A model server calls ``model(x, training=False)`` from a pool of threads.
Each thread's call keeps its own state (the full 64-bit keys of a JAX call
live in the call's context, not in the layer), so threads neither see one
another's keys nor wait on one lock around the call. This script builds a
small recommender (``--fields`` hash fields of 3 int64 keys above 2**32 each,
one fixed-vocabulary field, Dense layers), computes each batch's output once
sequentially, then times the same calls from 1, 2 and ``--threads`` threads
and prints calls/s and the ratio to one thread, beside the same ratio for
the model built with `keras.layers.Embedding` (how far Keras's own eager
calls scale with threads on this machine). It exits 1 if any threaded
output differs from the sequential one.

    KERAS_BACKEND=jax python benchmarks/concurrent_inference.py
    KERAS_BACKEND=torch python benchmarks/concurrent_inference.py --quick
    KERAS_BACKEND=jax python benchmarks/concurrent_inference.py --compiled

Run it alone on the machine; compare ratios from one run only.
"""

import argparse
import os
import sys
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_sparse as ks  # noqa: E402


def build(fields, batch, batches):
    keras.utils.set_random_seed(0)
    inputs = [keras.Input((3,), dtype="int64") for _ in range(fields)]
    ids = keras.Input((2,), dtype="int64")
    layers = [
        ks.DistributedHashEmbedding(16, capacity=1 << 16, combiner="sum")
        for _ in range(fields)
    ]
    fixed = ks.AllToAllDenseEmbedding(1000, 16, combiner="mean")
    joined = keras.layers.Concatenate()(
        [layer(x) for layer, x in zip(layers, inputs)] + [fixed(ids)]
    )
    hidden = keras.layers.Dense(64, activation="relu")(joined)
    model = keras.Model(inputs + [ids], keras.layers.Dense(1)(hidden))
    rng = np.random.default_rng(0)
    data = []
    for _ in range(batches):
        keys = [rng.integers(0, 2**20, (batch, 3)) + (5 << 32) for _ in layers]
        data.append(keys + [rng.integers(0, 1000, (batch, 2))])
    for n, layer in enumerate(layers):
        layer(np.concatenate([b[n] for b in data]), training=True)
    return model, data


def build_plain(fields, data):
    """The same model with `keras.layers.Embedding` (ids: keys mod 2**16),
    the baseline for how far Keras's eager calls scale with threads here."""
    keras.utils.set_random_seed(0)
    inputs = [keras.Input((3,), dtype="int32") for _ in range(fields)]
    ids = keras.Input((2,), dtype="int32")
    pooled = [
        keras.ops.sum(keras.layers.Embedding(1 << 16, 16)(x), axis=1) for x in inputs
    ]
    pooled.append(keras.ops.mean(keras.layers.Embedding(1000, 16)(ids), axis=1))
    hidden = keras.layers.Dense(64, activation="relu")(
        keras.layers.Concatenate()(pooled)
    )
    model = keras.Model(inputs + [ids], keras.layers.Dense(1)(hidden))
    plain = [[(a % (1 << 16)).astype("int32") for a in b] for b in data]
    return model, plain


def compiled(model):
    """A served model as a model server compiles it on JAX: one jitted
    stateless call (hash layers read their serving map inside the program),
    which runs without the interpreter lock; Keras's ``predict`` is not
    thread-safe on JAX."""
    import jax

    ks.refresh_serving_maps(model)  # a compiled program reads the maps
    trainable = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]
    step = jax.jit(lambda t, n, x: model.stateless_call(t, n, x, training=False)[0])
    return lambda x, training=False: step(trainable, frozen, x)


def run(model, data, threads, repeats):
    """Seconds for ``repeats`` passes over ``data`` split over ``threads``,
    and every call's output by batch index."""
    outputs = {}

    def serve(first):
        for _ in range(repeats):
            for i in range(first, len(data), threads):
                outputs.setdefault(i, []).append(
                    keras.ops.convert_to_numpy(model(data[i], training=False))
                )

    workers = [threading.Thread(target=serve, args=(t,)) for t in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - start, outputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fields", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="JAX: serve one jitted stateless call (both models)",
    )
    args = parser.parse_args()
    if args.quick:
        args.fields, args.batch, args.batches, args.repeats = 2, 64, 4, 2
    if args.compiled:
        import jax

        # 64-bit keys inside a compiled program (docs: serving guide).
        jax.config.update("jax_enable_x64", True)
    model, data = build(args.fields, args.batch, args.batches)
    expected = [keras.ops.convert_to_numpy(model(b, training=False)) for b in data]
    if args.compiled:
        model = compiled(model)
        eager, expected = expected, [keras.ops.convert_to_numpy(model(b)) for b in data]
        # The compiled program reads the serving map; XLA may fuse the float
        # math differently from eager calls, so equal to rounding here, and
        # the threads below must give exactly the sequential compiled result.
        np.testing.assert_allclose(np.stack(expected), np.stack(eager), atol=1e-5)
    run(model, data, 1, 1)  # warm-up
    counts = sorted({1, 2, args.threads})
    print(
        f"backend {keras.backend.backend()}, {args.fields} hash fields, "
        f"batch {args.batch}, {args.batches * args.repeats} calls per row\n"
    )
    plain, plain_data = build_plain(args.fields, data)
    plain_expected = [keras.ops.convert_to_numpy(plain(b)) for b in plain_data]
    if args.compiled:
        plain = compiled(plain)
        plain_expected = [keras.ops.convert_to_numpy(plain(b)) for b in plain_data]
    run(plain, plain_data, 1, 1)  # warm-up
    print(
        "| threads | calls/s | vs 1 thread | outputs equal "
        "| Keras Embedding: vs 1 thread |"
    )
    print("|---|---|---|---|---|")
    base = plain_base = None
    ok = True
    for threads in counts:
        seconds, outputs = run(model, data, threads, args.repeats)
        plain_seconds, plain_outputs = run(plain, plain_data, threads, args.repeats)
        equal = _all_equal(outputs, expected)
        ok &= equal and _all_equal(plain_outputs, plain_expected)
        rate = args.batches * args.repeats / seconds
        plain_rate = args.batches * args.repeats / plain_seconds
        base, plain_base = base or rate, plain_base or plain_rate
        print(
            f"| {threads} | {rate:,.1f} | {rate / base:.2f}x | {equal} | "
            f"{plain_rate / plain_base:.2f}x |"
        )
    return 0 if ok else 1


def _all_equal(outputs, expected):
    return all(
        np.array_equal(out, expected[i]) for i, outs in outputs.items() for out in outs
    )


if __name__ == "__main__":
    sys.exit(main())
