"""DLRM on synthetic Criteo-like clicks, with sparse-updated embedding tables.

Each of the 26 categorical fields has its own `AllToAllDenseEmbedding` whose
rows are updated by a sparse optimizer inside the backward pass; the model's
Adam only trains the MLPs. Runs on JAX (default), TensorFlow or PyTorch, on
CPU in a few minutes, and on a GPU when Keras finds one:

    python examples/dlrm.py                 # ~300k samples, 3 epochs
    python examples/dlrm.py --quick         # ~30 s smoke run
    KERAS_BACKEND=torch python examples/dlrm.py --optimizer adam

It prints the training throughput (epochs after the first, so compilation is
excluded) and the AUC on a held-out split, ending with one summary line:

    final: auc=0.80 loss=0.45 samples/s=52000 ...
"""

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
# PyTorch's OpenMP threads spin while they wait for work; when another
# process keeps a core busy, the spinning thread takes the time its peer
# needs to finish, and each step waits for it (PyTorch only: JAX and
# TensorFlow do not use OpenMP). Read when torch loads; set
# OMP_WAIT_POLICY yourself to choose otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import keras
import numpy as np
from keras import ops

import keras_sparse
from keras_sparse import optimizers as sparse_optimizers
from keras_sparse.data import criteo_like
from keras_sparse.data.synthetic import scaled_cardinalities

DEFAULTS = {
    "samples": 300_000,
    "batch_size": 2048,
    "epochs": 3,
    "dim": 16,
    "scale": 0.05,
}
QUICK = {"samples": 60_000, "batch_size": 1024, "epochs": 2, "dim": 8, "scale": 0.002}

SPARSE_OPTIMIZERS = {
    "sgd": sparse_optimizers.SGD,
    "adagrad": sparse_optimizers.Adagrad,
    "rowwise_adagrad": sparse_optimizers.RowWiseAdagrad,
    "adam": sparse_optimizers.Adam,
    "ftrl": sparse_optimizers.Ftrl,
}
# Embedding rows see few updates each, so they want a larger step than the MLPs.
DEFAULT_EMBEDDING_LR = {"sgd": 0.5, "adam": 0.01, "ftrl": 0.1}


class DotInteraction(keras.layers.Layer):
    """Pairwise dot products of the feature vectors (strict upper triangle).

    Input: a list of `n` tensors `[batch, dim]`. Output:
    `[batch, n * (n - 1) / 2]`.
    """

    def call(self, vectors):
        n = len(vectors)
        stacked = ops.stack(vectors, axis=1)
        gram = ops.matmul(stacked, ops.transpose(stacked, (0, 2, 1)))
        rows, cols = np.triu_indices(n, k=1)
        flat = ops.reshape(gram, (-1, n * n))
        return ops.take(flat, rows * n + cols, axis=1)


def mlp(x, units, name, last_activation="relu"):
    for i, width in enumerate(units):
        activation = last_activation if i == len(units) - 1 else "relu"
        x = keras.layers.Dense(width, activation=activation, name=f"{name}_{i}")(x)
    return x


def build_model(
    cardinalities,
    *,
    dim=16,
    num_dense=13,
    optimizer="adagrad",
    embedding_lr=None,
    bottom_units=(64, 32),
    top_units=(256, 128),
    table_options=None,
):
    """Builds the (uncompiled) DLRM.

    Args:
        cardinalities: vocabulary size of each categorical input `cat_i`.
        dim: embedding width (the bottom MLP's output width too).
        num_dense: width of the `dense` input.
        optimizer: sparse optimizer name for the tables (see
            `SPARSE_OPTIMIZERS`).
        embedding_lr: its learning rate; defaults per optimizer.
        bottom_units, top_units: hidden widths of the two MLPs.
        table_options: more keyword arguments of every table, e.g.
            ``{"table_dtype": "bfloat16"}`` (`benchmarks/table_precision.py`).

    Returns:
        A functional `keras.Model` whose inputs are named like the keys of
        `criteo_like` features and whose output is a click probability.
    """
    lr = embedding_lr or DEFAULT_EMBEDDING_LR.get(optimizer, 0.05)
    dense_in = keras.Input((num_dense,), name="dense")
    cat_ins = [
        keras.Input((), dtype="int32", name=f"cat_{i}")
        for i in range(len(cardinalities))
    ]
    bottom = mlp(dense_in, (*bottom_units, dim), "bottom")
    vectors = [bottom]
    for i, (cardinality, ids) in enumerate(zip(cardinalities, cat_ins)):
        table = keras_sparse.AllToAllDenseEmbedding(
            cardinality,
            dim,
            optimizer=SPARSE_OPTIMIZERS[optimizer](learning_rate=lr),
            name=f"embedding_{i}",
            **(table_options or {}),
        )
        vectors.append(table(ids))
    interactions = DotInteraction(name="interaction")(vectors)
    x = keras.layers.Concatenate(name="top_input")([bottom, interactions])
    click = mlp(x, (*top_units, 1), "top", last_activation="sigmoid")
    return keras.Model([dense_in, *cat_ins], click, name="dlrm")


class EpochTimer(keras.callbacks.Callback):
    """Wall time of each training epoch."""

    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def accelerator():
    """Name of the GPU the backend computes on, or None on CPU."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        return None if device.platform == "cpu" else str(device)
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_logical_devices("GPU")
        return gpus[0].name if gpus else None
    if backend == "torch":
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return None


def split(features, labels, test_fraction):
    n_train = int(len(labels) * (1.0 - test_fraction))
    train = {k: v[:n_train] for k, v in features.items()}
    test = {k: v[n_train:] for k, v in features.items()}
    return (train, labels[:n_train]), (test, labels[n_train:])


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, help="train + test rows")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--dim", type=int, help="embedding width")
    parser.add_argument(
        "--scale", type=float, help="shrinks the Criteo vocabularies (1 = full)"
    )
    parser.add_argument(
        "--optimizer", default="adagrad", choices=sorted(SPARSE_OPTIMIZERS)
    )
    parser.add_argument("--embedding-lr", type=float)
    parser.add_argument("--test-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="small smoke run (~30 s on CPU)"
    )
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None):
    """Trains and evaluates; returns a dict of the final metrics."""
    args = parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    gpu = accelerator()
    print(f"backend={keras.backend.backend()} gpu={gpu or 'none (CPU)'}")

    cardinalities = scaled_cardinalities(scale=args.scale)
    features, labels = criteo_like(args.samples, scale=args.scale, seed=args.seed)
    (x_train, y_train), (x_test, y_test) = split(features, labels, args.test_fraction)
    print(
        f"data: {len(y_train)} train / {len(y_test)} test rows, "
        f"{sum(cardinalities):,} embedding rows x {args.dim}, "
        f"click rate {labels.mean():.3f}"
    )

    model = build_model(
        cardinalities,
        dim=args.dim,
        optimizer=args.optimizer,
        embedding_lr=args.embedding_lr,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="binary_crossentropy",
        metrics=[keras.metrics.AUC(name="auc")],
    )
    # Progress as it happens, in order: the first evaluation and epoch also
    # compile the model, which takes a while on a CPU.
    print("held-out rows, untrained model (compiling first):", flush=True)
    initial_loss, initial_auc = model.evaluate(
        x_test, y_test, batch_size=args.batch_size, verbose=1
    )
    print(f"held-out before training: auc={initial_auc:.4f} loss={initial_loss:.4f}")
    print(f"training {args.epochs} epochs:", flush=True)
    timer = EpochTimer()
    history = model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=[timer],
        verbose=1,  # a bar per step when interactive, a line per epoch in logs
    )
    print("held-out rows, trained model:", flush=True)
    loss, auc = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=1)

    # The first epoch includes tracing and compilation; leave it out when we can.
    timed = timer.seconds[1:] or timer.seconds
    samples_per_s = len(y_train) * len(timed) / sum(timed)
    result = {
        "auc": float(auc),
        "loss": float(loss),
        "initial_auc": float(initial_auc),
        "initial_loss": float(initial_loss),
        "train_loss": [float(v) for v in history.history["loss"]],
        "samples_per_s": samples_per_s,
        "gpu": gpu,
    }
    print(
        f"final: auc={auc:.4f} loss={loss:.4f} samples/s={samples_per_s:.0f} "
        f"backend={keras.backend.backend()} device={gpu or 'cpu'}"
    )
    return result


if __name__ == "__main__":
    main()
