"""model.fit step time: keras.layers.Embedding + Adam vs a sparse-updated table.

Both models are identical except for the table: ids `[batch, 26]` (26 lookups
per sample into ONE table of `rows x 32`, Zipf-distributed like click logs)
are summed to `[batch, 32]` and fed to Dense(16) -> Dense(1) with an MSE loss;
the model optimizer is keras Adam in both.

- dense: `keras.layers.Embedding` + sum over the bag. Adam updates the whole
  table (and its two slots) every step, so the step grows with the table.
- sparse: `AllToAllDenseEmbedding(combiner="sum", optimizer="adam")`. Adam is
  applied to the touched rows inside the backward pass; the step should not
  depend on the table size.

Steady-state time: after a warm-up fit (compilation), each repeat fits
`--steps` batches and the per-step time is the gap between consecutive batch
ends (the loss is read each step, so asynchronous dispatch cannot hide work);
the table reports the median. Models are built one at a time and freed.

    python benchmarks/sparse_update.py                 # 1e5, 1e6, 1e7 rows
    python benchmarks/sparse_update.py --quick         # small smoke run

Writes a markdown table to stdout and a plot to benchmarks/out/sparse_update.png.
"""

import argparse
import gc
import os
import pathlib
import statistics

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras
import numpy as np

import keras_sparse
from keras_sparse.data import zipf_ids

BAG = 26
DIM = 32
ZIPF_A = 1.05
OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"


def build_model(rows, sparse):
    ids = keras.Input((BAG,), dtype="int32", name="ids")
    if sparse:
        table = keras_sparse.AllToAllDenseEmbedding(
            rows, DIM, combiner="sum", optimizer="adam", name="table"
        )
        pooled = table(ids)
    else:
        table = keras.layers.Embedding(rows, DIM, name="table")
        pooled = keras.ops.sum(table(ids), axis=1)
    hidden = keras.layers.Dense(16, activation="relu")(pooled)
    model = keras.Model(ids, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


from step_timer import StepTimer  # noqa: E402


def step_seconds(rows, sparse, steps, repeats, batch_size, rng):
    """Steady-state seconds per model.fit step: (median, fastest)."""
    ids = zipf_ids(steps * batch_size * BAG, rows, ZIPF_A, rng).astype(np.int32)
    x = ids.reshape(-1, BAG)
    y = rng.standard_normal((len(x), 1)).astype(np.float32)
    model = build_model(rows, sparse)
    fit = {"batch_size": batch_size, "shuffle": False, "verbose": 0}
    model.fit(x[: 2 * batch_size], y[: 2 * batch_size], **fit)  # compile
    gaps = []
    for _ in range(repeats):
        timer = StepTimer()
        model.fit(x, y, callbacks=[timer], **fit)
        gaps.extend(timer.gaps)
    del model
    gc.collect()
    keras.backend.clear_session()
    return statistics.median(gaps), min(gaps)


def markdown_table(results):
    base = results[0]["sparse"]
    lines = [
        "| rows | dense ms/step | sparse ms/step | speedup | sparse vs first |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']:.0e} | {1e3 * r['dense']:.1f} | {1e3 * r['sparse']:.1f} "
            f"| {r['dense'] / r['sparse']:.1f}x | {r['sparse'] / base:.2f}x |"
        )
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r["rows"] for r in results]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rows, [1e3 * r["dense"] for r in results], "o-", label="Embedding + Adam")
    ax.plot(
        rows,
        [1e3 * r["sparse"] for r in results],
        "s-",
        label='AllToAllDenseEmbedding(optimizer="adam")',
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="table rows",
        ylabel="ms / step",
        title=f"model.fit step, dim {DIM}, {BAG} ids/sample, {keras.backend.backend()}",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", help="comma-separated table sizes, e.g. 1e5,1e6")
    parser.add_argument("--steps", type=int, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument(
        "--out", type=pathlib.Path, default=OUT_DIR / "sparse_update.png"
    )
    parser.add_argument("--quick", action="store_true", help="1e4,1e5 rows, 5 steps")
    args = parser.parse_args(argv)
    args.rows = args.rows or ("1e4,1e5" if args.quick else "1e5,1e6,1e7")
    args.rows = [int(float(r)) for r in args.rows.split(",")]
    args.steps = args.steps or (5 if args.quick else 10)
    if args.quick:
        args.repeats = 1
    return args


def main(argv=None):
    args = parse_args(argv)
    print(
        f"backend={keras.backend.backend()} batch={args.batch_size} bag={BAG} dim={DIM}"
    )
    rng = np.random.default_rng(0)
    results = []
    for rows in args.rows:
        result = {"rows": rows}
        for kind in ("dense", "sparse"):
            result[kind], fastest = step_seconds(
                rows, kind == "sparse", args.steps, args.repeats, args.batch_size, rng
            )
            print(
                f"rows={rows:.0e} {kind}: median {1e3 * result[kind]:.1f} ms/step, "
                f"fastest {1e3 * fastest:.1f}",
                flush=True,
            )
        results.append(result)
    print()
    print(markdown_table(results))
    plot(results, args.out)
    print(f"\nplot: {args.out}")
    return results


if __name__ == "__main__":
    main()
