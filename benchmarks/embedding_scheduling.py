"""Embedding scheduling: bytes per device per step with a remote-row cache.

8 data-parallel replicas, every table row-sharded over the same 8 devices
(owner of row ``r``: ``r // ceil(rows / 8)``), on the workloads of
``benchmarks/prefetch.py``'s routing part (same seeds, same batches):

  user-item: 1M users, 200K items (dim 64), 3 small context fields (dim
      16), Zipf(1.05) ids;
  26-field Criteo-like: ``criteo_like(scale=0.01)``, dim 16;
  and, constructed to show when a cache pays, user-item with sessions (a
  session's samples come in 4 consecutive batches and read 4 items, see
  `sessions`).

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
tables (wall, and process CPU time: on a shared machine the wall time
counts other processes' work).

    python benchmarks/embedding_scheduling.py [--batch 16384] [--steps 8]
        [--lookahead 4] [--quick]
"""

import argparse
import os
import pathlib
import sys
import time

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


def sessions(batch, steps, length=4, per_step=8, items=4):
    """User-item with sessions (constructed, to show when a cache pays):
    ``batch / per_step`` sessions are open at each step, a quarter renewed
    per step (so each lasts ``length`` steps); a session is one Zipf user
    and ``items`` Zipf items, and gives ``per_step`` samples per step, each
    one of its items; context fields as in `user_item`; each batch
    shuffled."""
    rng = np.random.default_rng(2)
    open_n = batch // per_step
    user = zipf_ids(open_n, 1_000_000, 1.05, rng)
    item = zipf_ids(open_n * items, 200_000, 1.05, rng).reshape(open_n, items)
    age = rng.integers(0, length, open_n)
    cols = {"user": [], "item": []}
    for _ in range(steps):
        new = age % length == 0
        user[new] = zipf_ids(int(new.sum()), 1_000_000, 1.05, rng)
        item[new] = zipf_ids(int(new.sum()) * items, 200_000, 1.05, rng).reshape(
            -1, items
        )
        age += 1
        who = np.repeat(np.arange(open_n), per_step)
        pick = item[who, rng.integers(0, items, who.size)]
        order = rng.permutation(who.size)
        cols["user"].append(user[who][order])
        cols["item"].append(pick[order])
    n = batch * steps
    out = [
        ("user", 1_000_000, 64, np.concatenate(cols["user"]).astype(np.int64)),
        ("item", 200_000, 64, np.concatenate(cols["item"]).astype(np.int64)),
    ]
    for name, rows in (("hour", 24), ("device", 8), ("city", 1000)):
        out.append((name, rows, 16, zipf_ids(n, rows, 1.05, rng).astype(np.int64)))
    return out


def criteo(batch, steps, scale=0.01):
    features, _ = criteo_like(batch * steps, scale=scale, seed=1)
    cards = scaled_cardinalities(None, scale)
    return [
        (f"cat_{f}", rows, 16, features[f"cat_{f}"].astype(np.int64))
        for f, rows in enumerate(cards)
    ]


def routed_batches(tables, batch, steps, route):
    """Per table, per step, per device: the ids, after the routing;
    and the per-position bytes of each step (the routing code's count).

    ``route``: None (contiguous split), "locality" (by owners), or
    "affinity": locality routing that counts a row as local to the device
    that alone read it at the previous step (where a cache would hold it).
    """
    d = REPLICAS
    per_table = [[] for _ in tables]
    position_bytes = []
    cost = [remote_id_bytes(dim) for _, _, dim, _ in tables]
    last = [None for _ in tables]  # (sorted ids, device) read by one device
    for s in range(steps):
        part = slice(s * batch, (s + 1) * batch)
        owners = [ids[part] // rows_per_shard(rows, d) for _, rows, _, ids in tables]
        scores = owners
        if route == "affinity":
            scores = [
                _affine(ids[part], own, prev)
                for (*_, ids), own, prev in zip(tables, owners, last)
            ]
        perm = None if route is None else locality_assignment(scores, d, cost)
        position_bytes.append(exchanged_bytes(owners, d, cost, perm))
        order = np.arange(batch) if perm is None else perm
        for t, (_, _, _, ids) in enumerate(tables):
            blocks = ids[part][order].reshape(d, -1)
            per_table[t].append(list(blocks))
            last[t] = _alone(blocks)
    return per_table, position_bytes


def _alone(blocks):
    """(sorted ids, device) of the ids one device alone read."""
    d = blocks.shape[0]
    dev = np.repeat(np.arange(d), blocks.shape[1])
    pairs = np.unique(blocks.reshape(-1) * d + dev)
    ids, dev = pairs // d, pairs % d
    one = (
        np.bincount(np.searchsorted(ids, ids), minlength=ids.size)[
            np.searchsorted(ids, ids)
        ]
        == 1
    )
    return ids[one], dev[one]


def _affine(ids, owners, prev):
    """Owners, with the ids one device alone read last step on it."""
    if prev is None or not prev[0].size:
        return owners
    at = np.minimum(np.searchsorted(prev[0], ids), prev[0].size - 1)
    return np.where(prev[0][at] == ids, prev[1][at], owners)


def schedule(tables, per_table, share, lookahead):
    """Sums the plans of every table: (bytes [T, D], baseline [T, D],
    seconds, counts)."""
    sent = base = 0
    seconds, counts = 0.0, {}
    cpu = time.process_time()
    for (_, rows, dim, _), batches in zip(tables, per_table):
        plan = plan_remote_cache(
            batches, rows, int(share * rows), dim=dim, slots=1, lookahead=lookahead
        )
        sent = sent + plan.bytes
        base = base + plan.baseline_bytes
        seconds += plan.seconds
        for k, v in plan.counts.items():
            counts[k] = counts.get(k, 0) + v
    counts["cpu_s"] = time.process_time() - cpu
    return sent, base, seconds, counts


def run(name, tables, batch, steps, lookahead):
    rows = []
    mib = 2.0**20
    ref = None
    for route in (None, "locality", "affinity"):
        per_table, position = routed_batches(tables, batch, steps, route)
        shares = (0.0,) + (CACHE_SHARES if route else ())
        if route == "affinity":
            shares = CACHE_SHARES
        for share in shares:
            sent, base, seconds, counts = schedule(tables, per_table, share, lookahead)
            if ref is None:
                ref = base.sum()
            label = {None: "no routing", "locality": "locality routing"}.get(
                route, "affinity routing"
            )
            if share:
                label += f" + cache {100 * share:.0f}%"
            rows.append(
                (
                    name,
                    label,
                    f"{np.mean(position) / mib:.2f}",
                    f"{sent.sum() / steps / mib:.2f}",
                    f"{sent.sum() / steps / REPLICAS / 1024:.0f}",
                    f"{sent.sum(axis=0).max() / steps / 1024:.0f}",
                    f"{100 * (1 - sent.sum() / ref):.1f}%",
                    f"{counts['hits']}",
                    f"{1e3 * seconds / steps:.1f}",
                    f"{1e3 * counts['cpu_s'] / steps:.1f}",
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
    workloads = (
        ("user-item", user_item),
        ("26-field Criteo-like", criteo),
        ("user-item, sessions", sessions),
    )
    for name, make in workloads:
        rows += run(
            name, make(args.batch, args.steps), args.batch, args.steps, args.lookahead
        )
    headers = [
        "workload",
        "configuration",
        "per position MiB/step (no cache)",
        "distinct MiB/step",
        "KiB/device/step",
        "busiest device KiB/step",
        "vs no routing (distinct)",
        "cache hits",
        "scheduler ms/batch",
        "scheduler CPU ms/batch",
    ]
    print(markdown(headers, rows))


if __name__ == "__main__":
    main()
