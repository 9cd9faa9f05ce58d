"""int8 / int4 serving tables of the DLRM example: error, size and AUC.

Trains the DLRM of ``examples/dlrm.py`` (its ``--quick`` sizes by default:
26 ``AllToAllDenseEmbedding`` tables with a sparse optimizer), saves it,
and for each mode loads a copy and calls ``model.quantize(mode)``
(Keras's default configs: int8 one scale per row, int4 packed with a scale
and a zero point per row and 128-wide group). Prints, per mode:

* the error of the dequantized rows vs float32 over every table row: the
  largest per-row max abs error, and the mean over rows of the per-row mean
  abs error;
* the tables' bytes (quantized variables) and their ratio to float32;
* the held-out AUC (exact, from the predictions) of the quantized model
  and its change vs float32.

    KERAS_BACKEND=jax python benchmarks/quantized_tables.py          # quick
    KERAS_BACKEND=jax python benchmarks/quantized_tables.py --full   # dlrm.py sizes
"""

import argparse
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import dlrm  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_sparse  # noqa: E402
from keras_sparse.data import criteo_like  # noqa: E402
from keras_sparse.data.synthetic import scaled_cardinalities  # noqa: E402


def _tables(model):
    return [
        layer
        for layer in model.layers
        if isinstance(layer, keras_sparse.AllToAllDenseEmbedding)
    ]


def _bytes(variables):
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def _row_errors(float_tables, tables):
    """(largest per-row max abs error, mean of per-row mean abs errors)."""
    row_max, row_mean = [], []
    for values, layer in zip(float_tables, tables):
        ids = ops.arange(layer.input_dim, dtype="int32")
        rows = ops.convert_to_numpy(layer(ids))
        gap = np.abs(rows.astype(np.float64) - values)
        row_max.append(gap.max(axis=1))
        row_mean.append(gap.mean(axis=1))
    return float(np.concatenate(row_max).max()), float(np.concatenate(row_mean).mean())


def _auc(model, x, y, batch_size):
    """Exact held-out ROC AUC (rank statistic, ties averaged)."""
    scores = model.predict(x, batch_size=batch_size, verbose=0).ravel()
    labels = np.asarray(y).ravel() > 0.5
    order = np.argsort(scores, kind="stable")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)
    pos, neg = labels.sum(), (~labels).sum()
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="dlrm.py's default sizes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = dlrm.DEFAULTS if args.full else dlrm.QUICK
    keras.utils.set_random_seed(args.seed)
    cardinalities = scaled_cardinalities(scale=sizes["scale"])
    features, labels = criteo_like(
        sizes["samples"], scale=sizes["scale"], seed=args.seed
    )
    (x_train, y_train), (x_test, y_test) = dlrm.split(features, labels, 0.1)
    model = dlrm.build_model(cardinalities, dim=sizes["dim"])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="binary_crossentropy",
        metrics=[keras.metrics.AUC(name="auc")],
    )
    model.fit(
        x_train,
        y_train,
        batch_size=sizes["batch_size"],
        epochs=sizes["epochs"],
        verbose=0,
    )
    batch = sizes["batch_size"]
    float_auc = _auc(model, x_test, y_test, batch)
    float_tables = [ops.convert_to_numpy(t.embeddings) for t in _tables(model)]
    float_bytes = sum(v.nbytes for v in float_tables)
    path = os.path.join(tempfile.mkdtemp(), "dlrm.keras")
    model.save(path)
    print(
        f"backend={keras.backend.backend()} tables={len(float_tables)} "
        f"rows={sum(len(v) for v in float_tables):,} dim={sizes['dim']} "
        f"float32 AUC={float_auc:.4f}\n"
    )
    print(
        "| mode | max abs err (row max) | mean abs err (row mean) | "
        "table bytes | vs float32 | AUC | AUC change |"
    )
    print("|---|---|---|---|---|---|---|")
    print(f"| float32 | 0 | 0 | {float_bytes:,} | 1.000x | {float_auc:.4f} | - |")
    for mode in ("int8", "int4"):
        quantized = keras.models.load_model(
            path, custom_objects={"DotInteraction": dlrm.DotInteraction}
        )
        quantized.quantize(mode)
        tables = _tables(quantized)
        worst, mean = _row_errors(float_tables, tables)
        size = _bytes([v for t in tables for v in t.variables])
        auc = _auc(quantized, x_test, y_test, batch)
        print(
            f"| {mode} | {worst:.2e} | {mean:.2e} | {size:,} | "
            f"{size / float_bytes:.3f}x | {auc:.4f} | {auc - float_auc:+.4f} |"
        )


if __name__ == "__main__":
    main()
