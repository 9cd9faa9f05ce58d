"""Sharded embedding tables on 8 (virtual) CPU devices: one row per strategy.

A DLRM-like model: 26 tables (Criteo-like spread of sizes, ``dim`` 16,
``adagrad`` sparse optimizer, one Zipf id per table per sample) pooled and
concatenated into Dense(64) -> Dense(1), MSE loss, keras Adam for the dense
part. Every table uses the same strategy ("data", "row", "column"), or the
planner's choice ("auto", given ``--memory-mib`` of table memory per
device); "table" puts the 26 tables in one ``EmbeddingCollection`` placed
table-wise (each table whole on one device, the planner balancing bytes and
lookups; one stacked ``[8 * B, 16]`` variable, ``B`` = the busiest device's
rows). Reported per strategy:

- step: median steady-state seconds per ``model.fit`` step (after a warm-up
  fit that compiles; the loss is read each step so dispatch cannot hide work);
- bytes/step: what each device hands to collectives per step, from the
  buffer shapes (`keras_sparse.sharding.exchange_bytes`, summed over tables);
- HLO bytes/step: the same, read from the compiled training step (all
  collectives of the step, the dense part's gradient all-reduce included);
- table mem/device: bytes of table + slot shards held by device 0 (padding
  rows of row-sharded tables and of the table-wise stack included).

On CPU the "devices" share 2 cores, so step times measure overheads, not
network; the bytes and memory columns are the portable part.

``--dedup both`` runs every strategy with the row exchange sending each
device's distinct ids once and with one slot per local position.

    python benchmarks/sharding.py [--steps 20] [--batch 512] [--dedup both]
"""

import argparse
import os
import pathlib
import statistics
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_sparse  # noqa: E402
from keras_sparse import sharding  # noqa: E402
from keras_sparse.sharding import exchange_buckets  # noqa: E402
from keras_sparse.sharding import jax_exchange_bytes  # noqa: E402

NUM_TABLES = 26
DIM = 16
DEVICES = 8
# Criteo-like spread; most counts are not multiples of 8, so row-sharded
# tables are padded to ceil(rows / 8) rows per device.
ROWS = [int(r) + 3 for r in np.geomspace(16, 500_000, NUM_TABLES).round()]


def make_layers(strategy):
    if strategy == "table":
        tables = {
            f"t{i:02d}": keras_sparse.TableConfig(rows, DIM, combiner="sum")
            for i, rows in enumerate(ROWS)
        }
        return [
            keras_sparse.EmbeddingCollection(
                tables, optimizer="adagrad", sharding="table", name="tables"
            )
        ]
    return [
        keras_sparse.AllToAllDenseEmbedding(
            rows,
            DIM,
            combiner="sum",
            optimizer="adagrad",
            sharding={"auto": "auto", "single": "auto"}.get(strategy, strategy),
            name=f"t{i:02d}",
        )
        for i, rows in enumerate(ROWS)
    ]


def build_model(layers):
    ids = keras.Input((NUM_TABLES,), dtype="int32", name="ids")
    if isinstance(layers[0], keras_sparse.EmbeddingCollection):
        out = layers[0]({f"t{i:02d}": ids[:, i : i + 1] for i in range(NUM_TABLES)})
        pooled = list(out.values())
    else:
        pooled = [layer(ids[:, i : i + 1]) for i, layer in enumerate(layers)]
    h = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()(pooled))
    model = keras.Model(ids, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


from step_timer import StepTimer  # noqa: E402


def data(steps, batch, rng):
    cols = [
        np.minimum(rng.zipf(1.2, size=steps * batch) - 1, rows - 1) for rows in ROWS
    ]
    x = np.stack(cols, axis=1).astype("int32")
    y = rng.normal(size=(x.shape[0], 1)).astype("float32")
    return x, y


def table_bytes_on_device0(layers):
    total = 0
    for layer in layers:
        if isinstance(layer, keras_sparse.EmbeddingCollection):
            variables = [
                v for stack in layer.stacks for v in layer.stack_variables(stack.name)
            ]
        else:
            variables = [layer.embeddings, *layer.slots.values()]
        for var in variables:
            shard = var.value.addressable_shards[0]
            total += shard.data.size * shard.data.dtype.itemsize
    return total


def compiled_step_bytes(model, x, y):
    import jax

    model.make_train_function()
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    dist = keras.distribution.distribution()
    xs = jax.device_put(x, dist.get_data_layout(x.shape).backend_layout)
    ys = jax.device_put(y, dist.get_data_layout(y.shape).backend_layout)
    lowered = jax.jit(model.train_step).lower(state, (xs, ys))
    text = lowered.compile().as_text()
    return jax_exchange_bytes.hlo_collective_bytes(text, DEVICES)["total"]


def fit_timed(layers, steps, batch, rng):
    """Builds the model, warms it up (compiles), then times ``steps`` steps."""
    model = build_model(layers)
    x, y = data(steps, batch, rng)
    model.fit(x[: batch * 2], y[: batch * 2], batch_size=batch, verbose=0)
    timer = StepTimer()
    model.fit(x, y, batch_size=batch, verbose=0, shuffle=False, callbacks=[timer])
    return model, x, y, timer


def run_single(steps, batch, rng):
    """The same model without a distribution, on the backend's first device."""
    import jax

    layers = make_layers("single")
    try:
        _, _, _, timer = fit_timed(layers, steps, batch, rng)
        d = jax.devices()[0]
        return {
            "strategy": f"single device ({d.platform}: {d.device_kind})",
            "tables": f"local:{len(layers)}",
            "step_ms": 1000 * statistics.median(timer.gaps),
            "bytes": 0,
            "hlo_bytes": 0,
            "mem": table_bytes_on_device0(layers),
            "plan": None,
        }
    finally:
        keras.backend.clear_session()


def run(strategy, steps, batch, rng, memory_per_device, row_slack=None):
    if strategy == "single":
        return run_single(steps, batch, rng)
    layers = make_layers(strategy)
    dist = sharding.distribution(
        layers,
        devices=DEVICES,
        row_exchange_slack=row_slack,
        batch_size=batch,
        ids_per_sample=1,
        memory_per_device=memory_per_device if strategy == "auto" else None,
    )
    plan = dist.keras_sparse_plan
    keras.distribution.set_distribution(dist)
    try:
        model, x, y, timer = fit_timed(layers, steps, batch, rng)
        try:
            hlo_bytes = compiled_step_bytes(model, x[:batch], y[:batch])
        except Exception as e:  # diagnostics only
            hlo_bytes = f"n/a ({type(e).__name__})"
        reported = sum(
            sharding.exchange_bytes(
                t.strategy, t.spec.rows, DIM, batch, DEVICES, slack=row_slack
            )["total"]
            for t in plan
        )
        counts = {}
        for t in plan:
            counts[t.strategy] = counts.get(t.strategy, 0) + 1
        return {
            "strategy": strategy,
            "tables": ", ".join(f"{k}:{v}" for k, v in sorted(counts.items())),
            "step_ms": 1000 * statistics.median(timer.gaps),
            "bytes": reported,
            "hlo_bytes": hlo_bytes,
            "mem": table_bytes_on_device0(layers),
            "plan": plan,
        }
    finally:
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()


def fmt(n):
    if isinstance(n, str):
        return n
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument(
        "--strategies",
        default="data,row,column,table,auto",
        help="comma list of data,row,column,table,auto and 'single' (no "
        "distribution, the backend's first device: the GPU when there is one)",
    )
    parser.add_argument(
        "--memory-mib",
        type=float,
        default=32,
        help="per-device table memory budget given to the planner (auto)",
    )
    parser.add_argument(
        "--row-slack",
        type=float,
        default=None,
        help="row_exchange_slack for row-sharded tables (default: full buffers); "
        "the Zipf ids here are frequency-ordered, so they need a large slack",
    )
    parser.add_argument(
        "--dedup",
        choices=("on", "off", "both"),
        default="on",
        help="row exchange: each device's distinct ids once (on), one slot per "
        "position (off, the earlier exchange), or both, one after the other",
    )
    args = parser.parse_args()
    modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.dedup]
    rng = np.random.default_rng(0)
    total_rows = sum(ROWS)
    print(
        f"{NUM_TABLES} tables, {total_rows} rows x {DIM}, adagrad; "
        f"batch {args.batch}; {DEVICES} CPU devices "
        f"(full table+slots: {fmt(total_rows * DIM * 2 * 4)})"
    )
    rows = []
    for strategy in args.strategies.split(","):
        for dedup in modes:
            exchange_buckets.DEDUP_EXCHANGE = dedup  # read when traced
            label = strategy
            if len(modes) > 1:
                label += " (distinct ids)" if dedup else " (per position)"
            try:
                r = run(
                    strategy,
                    args.steps,
                    args.batch,
                    rng,
                    int(args.memory_mib * 2**20),
                    args.row_slack,
                )
            except Exception as e:
                if "exchange slots per destination" not in str(e):
                    raise
                print(f"  {label}: a bucket overflows", flush=True)
                continue
            r["strategy"] = label
            rows.append(r)
            print(f"  done {label}: {r['step_ms']:.1f} ms/step", flush=True)
    head = (
        "strategy",
        "tables",
        "step ms",
        "bytes/step",
        "HLO bytes/step",
        "table mem/device",
    )
    body = [
        (
            r["strategy"],
            r["tables"],
            f"{r['step_ms']:.1f}",
            fmt(r["bytes"]),
            fmt(r["hlo_bytes"]),
            fmt(r["mem"]),
        )
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    for line in [head] + body:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
    auto = [r for r in rows if r["strategy"].startswith("auto")]
    if auto:
        print("\nplanner (auto):")
        print(auto[0]["plan"])


if __name__ == "__main__":
    main()
