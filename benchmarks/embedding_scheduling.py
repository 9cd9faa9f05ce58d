"""Embedding scheduling: bytes per device per step with a remote-row cache.

8 data-parallel replicas, every table row-sharded over the same 8 devices
(owner of row ``r``: ``r // ceil(rows / 8)``), on the workloads of
``benchmarks/prefetch.py``'s routing part (same seeds, same batches):

  user-item: 1M users, 200K items (dim 64), 3 small context fields (dim
      16), Zipf(1.05) ids;
  26-field Criteo-like: ``criteo_like(scale=0.01)``, dim 16.

Per workload, five configurations: Keras' contiguous split ("no routing"),
``route="locality"`` (`keras_sparse.data.locality_assignment`, as the
input stage routes), and locality routing plus a remote-row cache with
on-demand synchronization (`keras_sparse.data.plan_remote_cache`) of 1%, 5%
and 10% of each table's rows per device, planned with a look-ahead of
``--lookahead`` batches (the input stage's ``capacity``).

Bytes, counted from the schedule (the compiled step does not use it yet):
a remote read costs 2 x (4 B id + dim x 4 B) (forward: id out, vector back;
backward: id and gradient), a pull or push 4 B + dim x 4 B x 2 (the row and
its Adagrad accumulator); a device's cache hits and reads of rows it owns
cost nothing. "Per position" is the count the routing code reports (one
remote read per looked-up position, as today's exchange sends them);
"distinct" counts one remote read per distinct row per device and step (a
deduplicating exchange), the baseline the cache rows compare with. Per
device: the mean over devices and steps (total / 8) and the busiest
device's mean. Scheduler: ``plan_remote_cache``'s time per batch, all
tables.

    python benchmarks/embedding_scheduling.py [--batch 16384] [--steps 8]
        [--lookahead 4] [--quick]
"""

import argparse
import os
import pathlib
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from keras_sparse.data import criteo_like  # noqa: E402
from keras_sparse.data import locality_assignment  # noqa: E402
from keras_sparse.data import plan_remote_cache  # noqa: E402
from keras_sparse.data import zipf_ids  # noqa: E402
from keras_sparse.data.routing import exchanged_bytes  # noqa: E402
from keras_sparse.data.routing import remote_id_bytes  # noqa: E402
from keras_sparse.data.routing import rows_per_shard  # noqa: E402
from keras_sparse.data.synthetic import scaled_cardinalities  # noqa: E402

REPLICAS = 8
CACHE_SHARES = (0.01, 0.05, 0.10)


def user_item(batch, steps):
    """``[(name, rows, dim, ids [n])]``: benchmarks/prefetch.py's data."""
    rng = np.random.default_rng(0)
    specs = [
        ("user", 1_000_000, 64),
        ("item", 200_000, 64),
        ("hour", 24, 16),
        ("device", 8, 16),
        ("city", 1000, 16),
    ]
    n = batch * steps
    return [
        (name, rows, dim, zipf_ids(n, rows, 1.05, rng).astype(np.int64))
        for name, rows, dim in specs
    ]


def criteo(batch, steps, scale=0.01):
    features, _ = criteo_like(batch * steps, scale=scale, seed=1)
    cards = scaled_cardinalities(None, scale)
    return [
        (f"cat_{f}", rows, 16, features[f"cat_{f}"].astype(np.int64))
        for f, rows in enumerate(cards)
    ]


def routed_batches(tables, batch, steps, route):
    """Per table, per step, per device: the ids, after the routing;
    and the per-position bytes of each step (the routing code's count)."""
    d = REPLICAS
    per_table = [[] for _ in tables]
    position_bytes = []
    cost = [remote_id_bytes(dim) for _, _, dim, _ in tables]
    for s in range(steps):
        part = slice(s * batch, (s + 1) * batch)
        owners = [ids[part] // rows_per_shard(rows, d) for _, rows, _, ids in tables]
        perm = locality_assignment(owners, d, cost) if route else None
        position_bytes.append(exchanged_bytes(owners, d, cost, perm))
        order = np.arange(batch) if perm is None else perm
        for t, (_, _, _, ids) in enumerate(tables):
            per_table[t].append(list(ids[part][order].reshape(d, -1)))
    return per_table, position_bytes


def schedule(tables, per_table, share, lookahead):
    """Sums the plans of every table: (bytes [T, D], baseline [T, D],
    seconds, counts)."""
    sent = base = 0
    seconds, counts = 0.0, {}
    for (_, rows, dim, _), batches in zip(tables, per_table):
        plan = plan_remote_cache(
            batches, rows, int(share * rows), dim=dim, slots=1, lookahead=lookahead
        )
        sent = sent + plan.bytes
        base = base + plan.baseline_bytes
        seconds += plan.seconds
        for k, v in plan.counts.items():
            counts[k] = counts.get(k, 0) + v
    return sent, base, seconds, counts


def run(name, tables, batch, steps, lookahead):
    rows = []
    mib = 2.0**20
    ref = None
    for route in (False, True):
        per_table, position = routed_batches(tables, batch, steps, route)
        shares = (0.0,) + (CACHE_SHARES if route else ())
        for share in shares:
            sent, base, seconds, counts = schedule(tables, per_table, share, lookahead)
            if ref is None:
                ref = base.sum()
            label = "locality routing" if route else "no routing"
            if share:
                label += f" + cache {100 * share:.0f}%"
            rows.append(
                (
                    name,
                    label,
                    f"{np.mean(position) / mib:.2f}" if not share else "-",
                    f"{sent.sum() / steps / mib:.2f}",
                    f"{sent.sum() / steps / REPLICAS / 1024:.0f}",
                    f"{sent.sum(axis=0).max() / steps / 1024:.0f}",
                    f"{100 * (1 - sent.sum() / ref):.1f}%",
                    f"{counts['hits']}",
                    f"{1e3 * seconds / steps:.1f}",
                )
            )
    return rows


def markdown(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lookahead", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.steps = 1024, 3
    print(
        f"{REPLICAS} replicas, batch {args.batch}, {args.steps} steps, "
        f"look-ahead {args.lookahead}; bytes from the schedule\n"
    )
    rows = []
    for name, make in (("user-item", user_item), ("26-field Criteo-like", criteo)):
        rows += run(
            name, make(args.batch, args.steps), args.batch, args.steps, args.lookahead
        )
    headers = [
        "workload",
        "configuration",
        "per position MiB/step",
        "distinct MiB/step",
        "KiB/device/step",
        "busiest device KiB/step",
        "vs no routing (distinct)",
        "cache hits",
        "scheduler ms/batch",
    ]
    print(markdown(headers, rows))


if __name__ == "__main__":
    main()
