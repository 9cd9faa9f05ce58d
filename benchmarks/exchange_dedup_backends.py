"""Distinct-id exchanges beyond JAX's row tables: bytes per device per step,
every position vs each device's distinct ids (8 devices), side by side.

Workloads of ``benchmarks/exchange_dedup.py`` (user-item: 5 tables;
26-field Criteo-like, ``scale=0.01``), every table sharded over 8 devices
(replicas / processes), each step's global batch split contiguously. Both
settings of ``exchange_buckets.DEDUP_EXCHANGE`` are counted on the same
batches:

* TensorFlow row sharding (`tf_sharded_lookup`, all-gathers of any size:
  the bytes follow the ids): what one replica receives, ``4 T`` ids +
  ``4 D`` sizes + ``4 T dim`` rows + ``4 T dim`` gradients, ``T`` the ids
  of all replicas (every position, or each replica's distinct ids).
* PyTorch row sharding (`torch_sharded_lookup`, ``all_to_all_single`` of
  per-owner blocks): what one process hands to the collectives, the mean
  over processes: ``4 D (3 + C)`` ids with headers (``C`` the step's
  largest block: the smallest capacity that sends it in one collective;
  the placement keeps up to a quarter more) + ``4 k dim`` rows back +
  ``4 k dim`` gradients, ``k`` the ids a process sends.
* JAX key sharding (`DistributedHashEmbedding(sharding="key")`, the ids
  taken as keys): fixed buffers, so the bytes do not depend on the batch:
  the row exchange's full buffers (``n`` slots per destination) against
  the key exchange's ``key_capacity`` slots (default: no slack); "fits"
  is the fullest (device, owner) count of distinct keys over all steps,
  which must stay within it. The key exchange itself (``20 D C`` bytes,
  unchanged) is listed apart.

Counted from the ids (the buffers each exchange fills), not timed: the TF
and PyTorch counts are those tests/test_tf_sharded.py and
tests/test_torch_sharded.py check on real exchanges.

    python benchmarks/exchange_dedup_backends.py [--batch 16384] [--steps 8]
"""

import argparse
import os
import pathlib
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from embedding_scheduling import criteo  # noqa: E402
from embedding_scheduling import user_item  # noqa: E402
from exchange_dedup import markdown  # noqa: E402

from keras_sparse.sharding import jax_exchange_bytes as jeb  # noqa: E402
from keras_sparse.sharding.exchange_buckets import bucket_fill  # noqa: E402
from keras_sparse.sharding.jax_key_mapping import key_capacity  # noqa: E402
from keras_sparse.table import owner_of  # noqa: E402

D = 8


def step_fills(ids, rows, batch, steps, dedup):
    """Per step, the ``[D, D]`` ids each device sends each row owner."""
    shard_rows = -(-rows // D)
    return [
        bucket_fill(ids[s * batch : (s + 1) * batch], D, shard_rows, dedup)
        for s in range(steps)
    ]


def tf_bytes(fills, dim):
    """Mean bytes one replica receives per step (row sharding)."""
    per_step = [4 * int(f.sum()) * (1 + 2 * dim) + 4 * D for f in fills]
    return float(np.mean(per_step))


def torch_bytes(fills, dim):
    """Mean bytes one process sends per step (row sharding)."""
    per_step = [4 * D * (3 + int(f.max())) + 8 * dim * int(f.sum()) / D for f in fills]
    return float(np.mean(per_step))


def key_fill(ids, batch, steps):
    """The fullest (device, owner) count of distinct keys over all steps."""
    worst = 0
    for s in range(steps):
        local = ids[s * batch : (s + 1) * batch].reshape(D, -1)
        for p in range(D):
            keys = np.unique(local[p])
            worst = max(worst, int(np.bincount(owner_of(keys, D), minlength=D).max()))
    return worst


def key_bytes(rows, dim, batch, dedup):
    """The key-sharded row exchange's buffer bytes per device per step."""
    n = batch // D
    c = key_capacity(n, D) if dedup else n
    out = jeb.exchange_bytes("row", rows, dim, batch, D, capacity=c)["total"]
    # The key exchange's packing: no overflow check in the row lookup.
    return out - (4 if c < n else 0)


def measure(tables, batch, steps):
    out = {k: [0.0, 0.0] for k in ("tf", "torch", "key")}
    fit, cap, key_exchange = 0, key_capacity(batch // D, D), 0
    for _, rows, dim, ids in tables:
        for i, dedup in enumerate((False, True)):
            fills = step_fills(ids, rows, batch, steps, dedup)
            out["tf"][i] += tf_bytes(fills, dim)
            out["torch"][i] += torch_bytes(fills, dim)
            out["key"][i] += key_bytes(rows, dim, batch, dedup)
        fit = max(fit, key_fill(ids, batch, steps))
        key_exchange += 20 * D * cap
    return out, fit, cap, key_exchange


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    b, s = args.batch, args.steps
    print(f"devices={D} batch={b} steps={s}\n")
    names = {"tf": "TF row", "torch": "PyTorch row", "key": "JAX key (rows)"}
    rows = []
    for name, tables in (
        ("user-item", user_item(b, s)),
        ("26-field Criteo-like", criteo(b, s)),
    ):
        out, fit, cap, key_exchange = measure(tables, b, s)
        for k, (before, after) in out.items():
            note = f"fits: {fit} <= {cap} slots" if k == "key" else ""
            rows.append(
                (
                    name, names[k], f"{before / 2**20:.2f}",
                    f"{after / 2**20:.2f}", f"{1 - after / before:.0%}", note,
                )
            )  # fmt: skip
        rows.append(
            (name, "JAX key (keys, unchanged)", f"{key_exchange / 2**20:.2f}",
             f"{key_exchange / 2**20:.2f}", "0%", "")
        )  # fmt: skip
    print(
        markdown(
            [
                "workload",
                "exchange",
                "every position MiB/device/step",
                "distinct ids MiB/device/step",
                "saved",
                "",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
