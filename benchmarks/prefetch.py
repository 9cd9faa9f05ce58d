"""The prefetching input stage: fit throughput and locality-routing bytes.

Part 1, throughput: ``model.fit`` samples/s of a 26-field Criteo-like model
(one `DistributedHashEmbedding` per field, ``dim`` 16, adagrad; dense
features; Dense(64) -> Dense(1)) with batches of 16K samples, without the
stage (the table is reached through the per-step host callback) and with
``keras_sparse.data.prefetch`` at 1, 2 and 4 threads, measured side by side
in one process, same data, each after a warm-up fit that compiles. The
input-side work (the 26 ``lookup_or_insert`` calls of a batch) is measured
by the stage itself (``stats()["table_s"]``) and reported per step.

Part 2, routing: all-to-all bytes per step for 8 data-parallel replicas with
row-sharded tables (owner = row // ceil(rows / 8)), Keras' contiguous split
vs ``route="locality"``, for (a) a user-item workload (1M users, 200K
items, Zipf(1.05) ids, dim 64; 3 small context fields, dim 16) and (b) the
26-field workload (dim 16). A remote id costs 2 x (4 B id + dim x 4 B)
(forward: id out, vector back; backward: id and gradient).

    python benchmarks/prefetch.py [--quick] [--steps 8] [--batch 16384]

Run it alone on the machine: on 2 cores, concurrent processes distort the
throughput numbers (compare ratios from the same run only).
"""

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_sparse.data import criteo_like  # noqa: E402
from keras_sparse.data import prefetch  # noqa: E402
from keras_sparse.data import zipf_ids  # noqa: E402
from keras_sparse.data.synthetic import scaled_cardinalities  # noqa: E402
from keras_sparse.layers import AllToAllDenseEmbedding  # noqa: E402
from keras_sparse.layers import DistributedHashEmbedding  # noqa: E402

FIELDS = 26


def hash_model(capacity, dim=16, fields=FIELDS):
    keras.utils.set_random_seed(0)
    inputs, parts = {}, []
    dense = keras.Input((13,), name="dense")
    for f in range(fields):
        k = keras.Input((), dtype="int32", name=f"cat_{f}")
        inputs[f"cat_{f}"] = k
        parts.append(
            DistributedHashEmbedding(
                dim, capacity=capacity, optimizer="adagrad", name=f"emb_{f}"
            )(k)
        )
    inputs["dense"] = dense
    h = keras.layers.Concatenate()(parts + [dense])
    h = keras.layers.Dense(64, activation="relu", name="mlp")(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy")
    return model


def criteo_data(n, seed=0, scale=0.01):
    features, labels = criteo_like(n, scale=scale, seed=seed)
    x = {k: v for k, v in features.items()}
    return x, labels


def bench_throughput(batch, steps, capacity, threads_list):
    n = batch * steps
    x, y = criteo_data(n)
    rows = []

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    model = hash_model(capacity)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)  # warm
    base = timed(
        lambda: model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    )
    rows.append(("no stage (host callback)", n / base, 1.0, "", ""))
    for threads in threads_list:
        model = hash_model(capacity)
        with prefetch(
            (x, y), model, batch_size=batch, threads=threads, capacity=4
        ) as stage:
            model.fit(stage, epochs=1, verbose=0)  # warm-up: compiles
            before = stage.stats()
            t = timed(lambda m=model, st=stage: m.fit(st, epochs=1, verbose=0))
            after = stage.stats()
        table = (after["table_s"] - before["table_s"]) / steps
        wait = (after["wait_s"] - before["wait_s"]) / steps
        rows.append(
            (
                f"prefetch, threads={threads}",
                n / t,
                base / t,
                f"{1e3 * table:.0f}",
                f"{1e3 * wait:.0f}",
            )
        )
    # Compute floor: the same steps fed pre-prepared codes from memory (the
    # layers in prepared mode, no table work at all): the best any input
    # pipeline can do for this model on this machine.
    model = hash_model(capacity)
    with prefetch((x, y), model, batch_size=batch, threads=1) as stage:
        stage.on_epoch_begin()
        parts = [stage[0] for _ in range(len(stage))]
        stage.on_epoch_end()
        px = {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}

        def run():
            model.fit(px, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

        run()  # warm-up: compiles
        floor = timed(run)
    rows.append(("compute floor (pre-prepared, no table work)", n / floor,
                 base / floor, "0", ""))  # fmt: skip
    return rows, base / steps


def user_item_routing(batch, steps, replicas=8):
    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    specs = {  # name: (rows, dim)
        "user": (1_000_000, 64),
        "item": (200_000, 64),
        "hour": (24, 16),
        "device": (8, 16),
        "city": (1000, 16),
    }
    inputs, parts = {}, []
    for name, (rows, dim) in specs.items():
        k = keras.Input((), dtype="int32", name=name)
        inputs[name] = k
        parts.append(
            AllToAllDenseEmbedding(rows, dim, optimizer="adagrad", name=f"{name}_emb")(
                k
            )
        )
    model = keras.Model(
        inputs, keras.layers.Dense(1)(keras.layers.Concatenate()(parts))
    )
    n = batch * steps
    x = {
        name: zipf_ids(n, rows, 1.05, rng).astype(np.int32)
        for name, (rows, _) in specs.items()
    }
    y = np.zeros((n, 1), np.float32)
    return _route_stats(x, y, model, batch, replicas)


def criteo_routing(batch, steps, replicas=8, scale=0.01):
    keras.utils.set_random_seed(0)
    cards = scaled_cardinalities(None, scale)
    inputs, parts = {}, []
    for f, rows in enumerate(cards):
        k = keras.Input((), dtype="int32", name=f"cat_{f}")
        inputs[f"cat_{f}"] = k
        parts.append(AllToAllDenseEmbedding(rows, 16, optimizer="adagrad")(k))
    model = keras.Model(
        inputs, keras.layers.Dense(1)(keras.layers.Concatenate()(parts))
    )
    features, labels = criteo_like(batch * steps, scale=scale, seed=1)
    x = {k: v for k, v in features.items() if k.startswith("cat_")}
    return _route_stats(x, labels, model, batch, replicas)


def _route_stats(x, y, model, batch, replicas):
    with prefetch(
        (x, y), model, batch_size=batch, route="locality", replicas=replicas
    ) as stage:
        stage.on_epoch_begin()
        t0 = time.perf_counter()
        for _ in range(len(stage)):
            stage[0]
        elapsed = time.perf_counter() - t0
        stage.on_epoch_end()
        s = stage.stats()
    return s, elapsed / max(1, s["routed_batches"])


def markdown(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--capacity", type=int, default=1 << 16)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch = 3, 4096
    print(
        f"backend={keras.backend.backend()} batch={args.batch} "
        f"steps/epoch={args.steps} cores={os.cpu_count()}\n"
    )
    rows, base_step = bench_throughput(
        args.batch, args.steps, args.capacity, [1, 2] if args.quick else [1, 2, 4]
    )
    print("### fit throughput, 26-field DistributedHashEmbedding model\n")
    print(
        markdown(
            [
                "input path",
                "samples/s",
                "speed-up",
                "table ms/step (worker)",
                "main thread waited for a batch ms/step",
            ],
            [(r[0], f"{r[1]:,.0f}", f"{r[2]:.2f}x", r[3], r[4]) for r in rows],
        )  # fmt: skip
    )
    table_ms = [float(r[3]) for r in rows[1:] if r[3]]
    print(
        f"\nno-stage step: {1e3 * base_step:.0f} ms; input-side work (26 "
        f"lookup_or_insert calls, measured in the stage's workers): "
        f"~{np.median(table_ms):.0f} ms/step "
        f"({100 * np.median(table_ms) / (1e3 * base_step):.0f}% of the no-stage "
        "step)\n"
    )
    print("### all-to-all bytes per step, 8 replicas, row-sharded tables\n")
    out = []
    for name, fn in (
        ("user-item (Zipf 1.05)", user_item_routing),
        ("26-field Criteo-like", criteo_routing),
    ):
        s, route_s = fn(args.batch, args.steps)
        out.append(
            (
                name,
                f"{s['bytes_unrouted_per_step'] / 2**20:.2f}",
                f"{s['bytes_routed_per_step'] / 2**20:.2f}",
                f"{100 * s['bytes_saved_fraction']:.1f}%",
                f"{1e3 * route_s:.0f}",
            )
        )
    print(
        markdown(
            [
                "workload",
                "unrouted MiB/step",
                "routed MiB/step",
                "saved",
                "prepare+route ms/batch",
            ],
            out,
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
