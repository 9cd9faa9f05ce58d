"""Row exchange: one slot per local position vs one per distinct id (8 devices).

A row-sharded lookup sends each device's ids to their owners in static
``[D, C]`` buffers and gets ``[D, C, dim]`` rows back (and sends
``[D, C, dim]`` gradients in training). With compact buffers
(``row_exchange_slack``) today's exchange (``exchange_buckets.
DEDUP_EXCHANGE = True``) gives each device's distinct ids one slot each and
sums their gradients on the sender; the earlier one (``False``) gave every
local position a slot. Both are run here, in one process:

Part 1, bytes (host only): for the workloads of
``benchmarks/embedding_scheduling.py`` (user-item: 5 tables; 26-field
Criteo-like, ``scale=0.01``), every table row-sharded over 8 devices, the
smallest capacity that fits every step (the fullest bucket,
`exchange_buckets.bucket_fill`, over all steps) and the bytes per device
per step of buffers that size (`exchange_bytes(..., capacity=)`), against
full-size buffers (``row_exchange_slack=None``: the same for both).

Part 2, time: one jitted forward + sparse-update backward of one
row-sharded table (hashed Zipf(1.05) rows): full-size buffers (which keep
a slot per position), both exchanges at the smallest slack that fits one
slot per position, and the distinct exchange at the smallest slack that
fits it; the bytes of every compiled step are read from its HLO. On CPU
the 8 "devices" share the cores: the times measure compute and overheads,
not a network.

    python benchmarks/exchange_dedup.py [--batch 16384] [--steps 8]
"""

import argparse
import math
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
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from embedding_scheduling import criteo  # noqa: E402
from embedding_scheduling import user_item  # noqa: E402

import keras_sparse as ks  # noqa: E402
from keras_sparse.data import zipf_ids  # noqa: E402
from keras_sparse.sharding import exchange_buckets as buckets  # noqa: E402
from keras_sparse.sharding import jax_exchange_bytes as jeb  # noqa: E402
from keras_sparse.sharding import jax_row_buffers as jrb  # noqa: E402
from keras_sparse.sharding import jax_sharded_lookup as jsl  # noqa: E402
from keras_sparse.sharding.exchange_buckets import bucket_fill  # noqa: E402

D = 8
MODES = (("per position", False), ("distinct", True))


def markdown(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def fitting_capacity(ids, rows, batch, steps, dedup):
    shard_rows = -(-rows // D)
    worst = 0
    for s in range(steps):
        part = ids[s * batch : (s + 1) * batch]
        worst = max(worst, int(bucket_fill(part, D, shard_rows, dedup).max()))
    return worst


def bytes_table(workloads, batch, steps):
    out = []
    for name, tables in workloads:
        full, fit, fill = 0, {d: 0 for _, d in MODES}, {d: 0 for _, d in MODES}
        for _, rows, dim, ids in tables:
            full += jeb.exchange_bytes("row", rows, dim, batch, D)["total"]
            for _, dedup in MODES:
                c = fitting_capacity(ids, rows, batch, steps, dedup)
                fill[dedup] += c
                fit[dedup] += jeb.exchange_bytes(
                    "row", rows, dim, batch, D, capacity=c
                )["total"]
        out.append((name, len(tables), full, fit, fill))
    return out


def _step(mesh, opt, slack):
    import jax
    import jax.numpy as jnp

    def loss(table, slots, ids, valid, grads):
        rows = jsl.sharded_lookup_with_sparse_update(
            "row", mesh, "model", table, slots, opt, ids, valid, 0, slack=slack
        )
        return jnp.sum(rows * grads)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _median_ms(fn, args, repeats):
    import jax

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def time_table(num_ids, rows, dim, repeats):
    import jax
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:D]), ("model",))
    opt = ks.optimizers.get("adagrad", "bench")
    rng = np.random.default_rng(0)
    ids = rng.permutation(rows)[zipf_ids(num_ids, rows, 1.05, rng)]
    by_row = NamedSharding(mesh, P("model", None))
    by_id = NamedSharding(mesh, P("model"))
    args = (
        jax.device_put(rng.normal(size=(rows, dim)).astype("float32"), by_row),
        {"accumulator": jax.device_put(np.full((rows, dim), 0.1, "f4"), by_row)},
        jax.device_put(ids.astype("int32"), by_id),
        jax.device_put(np.ones(num_ids, bool), by_id),
        jax.device_put(rng.normal(size=(num_ids, dim)).astype("f4"), by_row),
    )
    n = num_ids // D

    def fitting_slack(dedup):
        c = int(bucket_fill(ids, D, rows // D, dedup).max())
        slack = c * D / n
        while jrb.row_capacity(n, D, slack) > c:  # float rounding
            slack = math.nextafter(slack, 0)
        return slack

    old, new = fitting_slack(False), fitting_slack(True)
    cases = [
        ("per position", False, "full (the default; both exchanges)", None),
        ("per position", False, "smallest fitting (per position)", old),
        ("distinct", True, "smallest fitting (per position)", old),
        ("distinct", True, "smallest fitting (distinct)", new),
    ]
    runs = []
    for label, dedup, what, s in cases:
        buckets.DEDUP_EXCHANGE = dedup  # read when the step is traced
        compiled = _step(mesh, opt, s).lower(*args).compile()
        hlo = jeb.hlo_collective_bytes(compiled.as_text(), D)["total"]
        jax.block_until_ready(compiled(*args))  # warm-up
        cap = jrb.row_capacity(n, D, s)
        runs.append([label, what, s, cap, hlo, compiled])
    buckets.DEDUP_EXCHANGE = True
    times = [[] for _ in runs]
    for _ in range(repeats):  # interleaved: the machine's load drifts
        for i, run in enumerate(runs):
            times[i].append(_median_ms(run[5], args, 1))
    return [r[:5] + [float(np.median(t))] for r, t in zip(runs, times)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ids", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    b, s = args.batch, args.steps
    print(f"devices={D} batch={b} steps={s} cores={os.cpu_count()}\n")
    workloads = [("user-item", user_item(b, s)), ("26-field Criteo-like", criteo(b, s))]
    rows = []
    for name, k, full, fit, fill in bytes_table(workloads, b, s):
        old, new = fit[False], fit[True]
        rows.append(
            (
                name, k, f"{full / 2**20:.2f}",
                f"{fill[False]:,}", f"{old / 2**20:.2f}",
                f"{fill[True]:,}", f"{new / 2**20:.2f}",
                f"{1 - new / old:.0%}",
            )
        )  # fmt: skip
    print(
        markdown(
            [
                "workload",
                "tables",
                "full buffers MiB/device/step",
                "per position: slots/dest (sum)",
                "MiB/device/step",
                "distinct: slots/dest (sum)",
                "MiB/device/step",
                "saved",
            ],
            rows,
        )  # fmt: skip
    )
    rows_t = 1 << 18
    print(f"\n### one table: {args.ids} ids, {rows_t} rows, dim 16\n")
    out = time_table(args.ids, rows_t, 16, args.repeats)
    print(
        markdown(
            ["exchange", "buffers", "slack", "slots/dest", "HLO KiB/device", "ms"],
            [
                (
                    label,
                    what,
                    "-" if s is None else f"{s:.3f}",
                    c,
                    f"{h / 1024:,.0f}",
                    f"{t:.1f}",
                )
                for label, what, s, c, h, t in out
            ],
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
