"""A step switch, off against on, in one process (the peers workload).

The workload of `benchmarks/peers.py` (26 tables of ``--rows`` x 16, bags of
4 Zipf(1.1) ids, sum pooling, Dense(64)-ReLU-Dense(1), Adagrad, batch
4096), built twice: once with the switch off, once on, each model traced
with its setting. Their epochs then alternate (off/on, then on/off), so a
noisy machine slows both alike; the table gives the median and 25th
percentile ms per step of each and their ratios, and the last loss (equal
when the switch changes speed only).

    python benchmarks/switch_ab.py --rows 1e6 --form layers \\
        --switch keras_sparse.ops.jax.lookup.REUSE_FORWARD_ROWS
    python benchmarks/switch_ab.py --quick   # CI smoke run, tiny sizes
    KERAS_BACKEND=torch python benchmarks/switch_ab.py --rows 1e6 \\
        --switch keras_sparse.ops.native_optimizers.FUSED_OPTIMIZERS

A switch read when the step is traced (JAX, TensorFlow graphs) takes each
model's setting at its first fit; one read at every call (the PyTorch
update) is set again before each epoch.

``--compare-forms`` measures the two model forms instead, 26 separate
layers against one `EmbeddingCollection`, the same way (no switch):

    KERAS_BACKEND=tensorflow python benchmarks/switch_ab.py --rows 1e5 \
        --compare-forms
"""

import argparse
import importlib
import os
import pathlib
import statistics
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from peers_runners import BAG  # noqa: E402
from peers_runners import ZIPF_A  # noqa: E402
from peers_runners import keras_model  # noqa: E402

import keras_sparse as ks  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--switch",
        default="keras_sparse.ops.jax.lookup.REUSE_FORWARD_ROWS",
        help="module.ATTRIBUTE, a bool read when the step is traced or run",
    )
    p.add_argument("--form", choices=("layers", "collection"), default="layers")
    p.add_argument(
        "--compare-forms",
        action="store_true",
        help="separate layers against one collection (no switch)",
    )
    p.add_argument("--rows", type=float, default=1e6)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=16, help="steps per epoch")
    p.add_argument("--rounds", type=int, default=6, help="epochs of each model")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)  # fmt: skip
    if args.quick:
        args.rows, args.tables, args.batch, args.steps, args.rounds = 1e4, 2, 256, 3, 2
    module_name, attribute = args.switch.rsplit(".", 1)
    module = importlib.import_module(module_name)
    # As peers.py: JAX takes the allocator settings too, every backend the
    # 2 MiB pages.
    ks.tune_cpu_allocator(os.environ["KERAS_BACKEND"] == "jax", huge_pages=True)
    rows = int(args.rows)
    rng = np.random.default_rng(0)
    n = (1 + args.steps) * args.batch
    ids = np.stack(
        [ks.data.zipf_ids(n * BAG, rows, ZIPF_A, rng).reshape(n, BAG)
         for _ in range(args.tables)],
        axis=1,
    ).astype(np.int32)  # fmt: skip
    labels = (rng.random((n, 1)) < 0.25).astype(np.float32)
    from step_timer import StepTimer

    fit = dict(batch_size=args.batch, shuffle=False, verbose=0)
    # Arm: (form, switch setting or None); the first is the baseline.
    if args.compare_forms:
        arms = {"layers": ("layers", None), "collection": ("collection", None)}
        title = "separate layers against one collection"
    else:
        arms = {"off": (args.form, False), "on": (args.form, True)}
        title = f"{args.switch}: {args.form}"
    models = {}
    names = [f"f{t}" for t in range(args.tables)]
    for arm, (form, setting) in arms.items():
        if setting is not None:
            setattr(module, attribute, setting)
        model = keras_model(form, names, rows)
        warm = {nm: ids[: args.batch, t] for t, nm in enumerate(names)}
        model.fit(warm, labels[: args.batch], **fit)  # traces with the setting
        models[arm] = model
    timed = {
        nm: np.ascontiguousarray(ids[args.batch :, t]) for t, nm in enumerate(names)
    }
    times = {arm: [] for arm in arms}
    losses = {}
    order = list(arms)
    for r in range(args.rounds):
        for arm in order if r % 2 == 0 else order[::-1]:
            setting = arms[arm][1]
            if setting is not None:
                setattr(module, attribute, setting)  # eager backends: per call
            timer = StepTimer()
            history = models[arm].fit(
                timed, labels[args.batch :], callbacks=[timer], **fit
            )
            times[arm] += timer.gaps
            losses[arm] = history.history["loss"][-1]
    print(
        f"{title}, {args.tables} tables x {rows:.0e} rows, batch {args.batch}, "
        f"{args.rounds} alternating epochs of {args.steps} steps"
    )
    print(f"| {'form' if args.compare_forms else 'switch'} | median ms/step "
          "| p25 ms/step | last loss |")  # fmt: skip
    print("|---|---:|---:|---:|")
    stats = {}
    for arm in arms:
        gaps = [1e3 * g for g in times[arm]]
        stats[arm] = (statistics.median(gaps), float(np.percentile(gaps, 25)))
        median, p25 = stats[arm]
        print(f"| {arm} | {median:.1f} | {p25:.1f} | {losses[arm]:.6f} |")
    base, other = order
    print(
        f"{other} / {base}: median {stats[other][0] / stats[base][0]:.3f}, "
        f"p25 {stats[other][1] / stats[base][1]:.3f}"
    )


if __name__ == "__main__":
    main()
