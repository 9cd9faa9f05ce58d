"""Sparse-update step time per segment algorithm, next to keras Embedding.

`keras_sparse.ops.row_updates.find_segments` finds, for every looked-up id,
its segment among the batch's distinct ids by binary search
(``searchsorted``), through an argsort of the ids, or with one sort of
``id << bits | position`` ("packed"); the optimizer then runs on the
smallest of n/32, n/8, n/2, n rows that holds the distinct ids ("sized"),
or on n rows. The library picks per device (packed + sized on CPU when the
bits fit, argsort on n rows on GPUs under JAX); this benchmark times the
variants side by side in one run, interleaved twice, on whatever device the
backend uses. Model: 26 tables of 100,000 x 16 rows (one Zipf id per table per
sample), Concatenate -> Dense(64) -> Dense(1), Adagrad; the keras row uses
`keras.layers.Embedding` with the model's Adagrad (dense update).

    python benchmarks/segment_algorithms.py [--batch 16384] [--steps 8]
"""

import argparse
import os
import statistics

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_sparse as ks  # noqa: E402
from keras_sparse.ops import count_buckets  # noqa: E402
from keras_sparse.ops import row_updates  # noqa: E402

TABLES, ROWS, DIM = 26, 100_000, 16


from step_timer import StepTimer  # noqa: E402


def build(kind):
    keras.utils.set_random_seed(0)
    ids = keras.Input((TABLES,), dtype="int32")
    parts = []
    for i in range(TABLES):
        col = ids[:, i]
        if kind == "keras":
            parts.append(keras.layers.Embedding(ROWS, DIM)(col))
        else:
            parts.append(ks.AllToAllDenseEmbedding(ROWS, DIM, optimizer="adagrad")(col))
    h = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()(parts))
    model = keras.Model(ids, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adagrad(), "mse")
    return model


def step_ms(kind, force, x, y, batch):
    algorithm, sized = force or (None, None)
    row_updates.FORCE_SEGMENT_ALGORITHM = algorithm
    count_buckets.FORCE_SIZED = sized
    try:
        model = build(kind)
        model.fit(x[: 2 * batch], y[: 2 * batch], batch_size=batch, verbose=0)
        timer = StepTimer()
        model.fit(x, y, batch_size=batch, verbose=0, shuffle=False, callbacks=[timer])
        return 1e3 * statistics.median(timer.gaps)
    finally:
        row_updates.FORCE_SEGMENT_ALGORITHM = None
        count_buckets.FORCE_SIZED = None
        keras.backend.clear_session()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    x = np.stack(
        [np.minimum(rng.zipf(1.2, n) - 1, ROWS - 1) for _ in range(TABLES)], 1
    ).astype("int32")
    y = rng.normal(size=(n, 1)).astype("float32")
    variants = [
        ("keras.layers.Embedding (dense Adagrad)", "keras", None),
        ("AllToAllDenseEmbedding, search, n rows", "sparse", ("search", False)),
        ("AllToAllDenseEmbedding, argsort, n rows", "sparse", ("argsort", False)),
        ("AllToAllDenseEmbedding, packed, n rows", "sparse", ("packed", False)),
        ("AllToAllDenseEmbedding, search, sized", "sparse", ("search", True)),
        ("AllToAllDenseEmbedding, packed, sized", "sparse", ("packed", True)),
        ("AllToAllDenseEmbedding, library's choice", "sparse", None),
    ]
    times = {name: [] for name, _, _ in variants}
    for _ in range(2):
        for name, kind, force in variants:
            times[name].append(step_ms(kind, force, x, y, args.batch))
    import jax

    print(f"device: {jax.devices()[0]}, batch {args.batch}, {TABLES} tables\n")
    print("| variant | step ms (two interleaved runs) | time vs keras |")
    print("|---|---|---|")
    base = min(times[variants[0][0]])
    for name, _, _ in variants:
        t = times[name]
        print(f"| {name} | {t[0]:.2f}, {t[1]:.2f} | {min(t) / base:.2f}x |")


if __name__ == "__main__":
    main()
