"""Row-exchange packing in the step vs in the prefetch workers (8 CPU devices).

A row-sharded lookup with compact exchange buffers (``row_exchange_slack``)
packs each device's ids into per-owner buckets and checks the fullest bucket
(an all-reduce, and a host callback on overflow). ``keras_sparse.data.
prefetch`` can do that packing in its worker threads instead
(``bucket=True``, `keras_sparse.sharding.exchange_buckets`). Measured side
by side in one run:

Part 1, the sharded lookup alone: one jitted forward + sparse-update
backward of a row-sharded table, ids packed in the step vs slots given, per
slack; plus the host time of `exchange_slots` for the same batch (spent in
the workers, off the step).

Part 2, ``model.fit``: a model of ``--fields`` row-sharded
`DistributedHashEmbedding` fields (Zipf keys) under
``keras_sparse.sharding.distribution(..., row_exchange_slack=4)``: no stage
(host callback), the stage with ``bucket=False`` (segments are not used by
sharded lookups, so the step packs the ids itself) and with ``bucket=True``.
Fresh models with the same seed, one warm-up fit each, timed fits
interleaved round-robin, medians.

On CPU the 8 "devices" share 2 cores: the step times measure compute and
overheads, not a network.

    python benchmarks/exchange_buckets.py [--batch 8192] [--fields 8]
        [--steps 6] [--repeats 3]
"""

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_sparse as ks  # noqa: E402
from keras_sparse import sharding  # noqa: E402
from keras_sparse.data import prefetch  # noqa: E402
from keras_sparse.data import zipf_ids  # noqa: E402
from keras_sparse.sharding import jax_row_buffers as jrb  # noqa: E402
from keras_sparse.sharding import jax_sharded_lookup as jsl  # noqa: E402
from keras_sparse.sharding.exchange_buckets import exchange_slots  # noqa: E402

D, DIM = 8, 16


def markdown(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _median_ms(fn, args, repeats):
    import jax

    jax.block_until_ready(fn(*args))  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def _lookup_step(mesh, opt, slack):
    """Jitted forward + sparse-update backward of one row-sharded lookup."""
    import jax
    import jax.numpy as jnp

    def loss(table, slots, ids, valid, grads, given_slots):
        rows = jsl.sharded_lookup_with_sparse_update(
            "row", mesh, "model", table, slots, opt, ids, valid, 0,
            slack=slack, exchange_slot=given_slots,
        )  # fmt: skip
        return jnp.sum(rows * grads)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def lookup_alone(num_ids, rows, slacks, repeats):
    import jax
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:D]), ("model",))
    opt = ks.optimizers.get("adagrad", "bench")
    rng = np.random.default_rng(0)
    # Row ids of hashed keys: spread over the shards, with Zipf repeats.
    ids = rng.permutation(rows)[zipf_ids(num_ids, rows, 1.05, rng)]
    by_row = NamedSharding(mesh, P("model", None))
    by_id = NamedSharding(mesh, P("model"))
    table = jax.device_put(rng.normal(size=(rows, DIM)).astype("float32"), by_row)
    slots = {"accumulator": jax.device_put(np.full((rows, DIM), 0.1, "f4"), by_row)}
    dev_ids = jax.device_put(ids.astype("int32"), by_id)
    valid = jax.device_put(np.ones(num_ids, bool), by_id)
    grads = jax.device_put(
        rng.normal(size=(num_ids, DIM)).astype("float32"),
        NamedSharding(mesh, P("model", None)),
    )
    out = []
    for slack in slacks:
        capacity = jrb.row_capacity(num_ids // D, D, slack)
        t0 = time.perf_counter()
        for _ in range(repeats):
            host = exchange_slots(ids, D, rows // D, capacity)
        host_ms = 1e3 * (time.perf_counter() - t0) / repeats
        args = (table, slots, dev_ids, valid, grads)
        step = _lookup_step(mesh, opt, slack)
        t_in = _median_ms(step, args + (None,), repeats)
        t_given = _median_ms(step, args + (jax.device_put(host, by_id),), repeats)
        out.append((slack, capacity, t_in, t_given, host_ms))
    return out


def _layers(fields, capacity):
    keras.utils.set_random_seed(0)
    return [
        ks.DistributedHashEmbedding(
            DIM, capacity=capacity, combiner="sum", optimizer="adagrad",
            sharding="row", name=f"f{i}",
        )
        for i in range(fields)
    ]  # fmt: skip


def _model(layers):
    inputs = [
        keras.Input((1,), dtype="int32", name=f"k{i}") for i, _ in enumerate(layers)
    ]
    h = keras.layers.Concatenate()([lay(x) for lay, x in zip(layers, inputs)])
    h = keras.layers.Dense(64, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


def fit_paths(batch, fields, steps, repeats, slack=4.0, capacity=1 << 15):
    rng = np.random.default_rng(1)
    n = batch * steps
    x = {
        f"k{i}": (zipf_ids(n, 200_000, 1.05, rng) * 7_919 + i).astype("int32")[:, None]
        for i in range(fields)
    }
    y = rng.normal(size=(n, 1)).astype("float32")
    paths = []
    for label, bucket in (
        ("no stage (host callback)", None),
        ("prefetch, bucket=False (step packs)", False),
        ("prefetch, bucket=True (workers pack)", True),
    ):
        layers = _layers(fields, capacity)
        dist = sharding.distribution(layers, devices=D, row_exchange_slack=slack)
        keras.distribution.set_distribution(dist)
        model = _model(layers)  # built under the distribution
        if bucket is None:

            def fit(m=model, dist=dist):
                keras.distribution.set_distribution(dist)
                m.fit(x, y, batch_size=batch, shuffle=False, verbose=0)

        else:
            stage = prefetch((x, y), model, batch_size=batch, threads=2, bucket=bucket)

            def fit(m=model, st=stage, dist=dist):
                keras.distribution.set_distribution(dist)
                m.fit(st, epochs=1, verbose=0)

        paths.append((label, fit))
        keras.distribution.set_distribution(None)
    for _, fit in paths:
        fit()  # warm-up: compiles, the stage's first pass
    wall = [[] for _ in paths]
    for _ in range(repeats):
        for i, (_, fit) in enumerate(paths):
            t0 = time.perf_counter()
            fit()
            wall[i].append(time.perf_counter() - t0)
    keras.distribution.set_distribution(None)
    base = float(np.median(wall[0]))
    return [
        (label, n / float(np.median(w)), base / float(np.median(w)))
        for (label, _), w in zip(paths, wall)
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--fields", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    num_ids = args.batch * args.fields
    print(
        f"devices={D} batch={args.batch} fields={args.fields} "
        f"cores={os.cpu_count()}\n\n### sharded lookup alone: {num_ids} ids "
        f"({num_ids // D}/device), dim {DIM}\n"
    )
    rows = lookup_alone(num_ids, 1 << 18, (2.0, 4.0), max(5, args.repeats))
    print(
        markdown(
            [
                "slack",
                "slots/destination",
                "packed in step ms",
                "slots given ms",
                "given / packed",
                "host exchange_slots ms (workers)",
            ],
            [
                (s, c, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x", f"{h:.1f}")
                for s, c, a, b, h in rows
            ],
        )  # fmt: skip
    )
    print(f"\n### model.fit, {args.fields} row-sharded hash fields, slack 4\n")
    print(
        markdown(
            ["input path", "samples/s", "vs no stage"],
            [
                (r[0], f"{r[1]:,.0f}", f"{r[2]:.2f}x")
                for r in fit_paths(args.batch, args.fields, args.steps, args.repeats)
            ],
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
