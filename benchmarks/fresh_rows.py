"""Fresh-row initial values: sized draws vs one draw per batch position.

A `DistributedHashEmbedding` training step re-initializes the rows its table
assigned to new keys. `keras_sparse.layers.hash.fresh_rows` sizes the
initializer's draw to the step's fresh count (1/32, 1/8, 1/2 or all of the
batch); the alternative draws one row per id of the batch. This benchmark
fits the 26-field models of ``benchmarks/prefetch.py`` (config A: dim 16,
Dense(64), Criteo scale 0.01, batch 16384; config B: dim 8, Dense(16),
full-size vocabularies, batch 65536) without a prefetch stage, one model per
variant, the fits interleaved round-robin (``--repeats`` rounds, one warm-up
fit each, medians), and reports the share of fresh positions per step.

    python benchmarks/fresh_rows.py [--steps 8] [--repeats 3] [--only A|B]
"""

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from prefetch import FIELDS  # noqa: E402
from prefetch import criteo_data  # noqa: E402
from prefetch import hash_model  # noqa: E402

from keras_sparse import HashTable  # noqa: E402
from keras_sparse.layers.hash import fresh_rows  # noqa: E402

CONFIGS = {
    "A": dict(batch=16384, dim=16, hidden=64, scale=0.01),
    "B": dict(batch=65536, dim=8, hidden=16, scale=1.0),
}


def fresh_share(x, batch, steps, capacity):
    """Mean and max over fields of the last batch's share of fresh positions.

    Replays the batches through LRU tables of the benchmark's capacity, as
    the layers' tables see them in the first epoch.
    """
    shares = []
    for f in range(FIELDS):
        table = HashTable(capacity, eviction="lru", device="cpu")
        for s in range(steps):
            res = table.lookup_or_insert(x[f"cat_{f}"][s * batch : (s + 1) * batch])
        rows = np.asarray(res.rows)
        shares.append(float(np.mean(np.isin(rows, res.new_rows) & (rows >= 0))))
    return float(np.mean(shares)), float(np.max(shares))


def bench(cfg, steps, repeats, capacity):
    batch = cfg["batch"]
    x, y = criteo_data(batch * steps, scale=cfg["scale"])
    variants = {}
    for label, sized in (("one row per batch position", False), ("sized", True)):
        fresh_rows.sized_draws = lambda s=sized: s  # read when the step traces
        model = hash_model(capacity, dim=cfg["dim"], hidden=cfg["hidden"])

        def fit(m=model):
            m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

        fit()  # warm-up: traces (with this variant's setting) and compiles
        variants[label] = (fit, model)
    times = {label: [] for label in variants}
    for _ in range(repeats):
        for label, (fit, _) in variants.items():
            t0 = time.perf_counter()
            fit()
            times[label].append(time.perf_counter() - t0)
    ms = {k: float(np.median(v)) / steps for k, v in times.items()}
    return ms, fresh_share(x, batch, steps, capacity)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=1 << 16)
    parser.add_argument("--only", choices=sorted(CONFIGS))
    args = parser.parse_args()
    print(
        "| config | fresh positions, last batch (mean / max field) "
        "| one row per batch position, ms/step | sized, ms/step | speed-up |"
    )
    print("|---|---|---:|---:|---:|")
    for name, cfg in CONFIGS.items():
        if args.only and name != args.only:
            continue
        ms, (mean, top) = bench(cfg, args.steps, args.repeats, args.capacity)
        full, sized = ms["one row per batch position"], ms["sized"]
        print(
            f"| {name} | {100 * mean:.1f}% / {100 * top:.1f}% | {1e3 * full:.0f} "
            f"| {1e3 * sized:.0f} | {full / sized:.2f}x |"
        )


if __name__ == "__main__":
    main()
