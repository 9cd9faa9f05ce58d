"""Quality, memory and step time of 16-bit tables against float32.

Two tasks, each trained once per seed and variant, all in one process:

* ``dlrm``: `examples/dlrm.py`'s model and synthetic Criteo-like clicks
  (its `build_model`, `criteo_like` data and split; Adagrad on the tables,
  Adam on the MLPs); metric: exact held-out AUC (rank statistic).
* ``ratings``: a rating task of MovieLens-100K's size (943 users, 1,682
  items, 100,000 distinct ratings 1-5 drawn from a rank-8 ground truth plus
  noise, skewed user activity and item popularity, 10% held out); a
  matrix factorization (user and item tables of ``--mf-dim``, user and item
  bias tables, a fixed global mean) trained by MSE with the tables' sparse
  SGD; metric: held-out RMSE. Run at each ``--mf-lr``: the smaller one is
  where a bfloat16 half-ulp exceeds most updates.

Variants (``table_dtype`` / ``slot_dtype`` / ``stochastic_rounding`` of
every table): ``float32``; ``bf16+SR`` (bfloat16 table and slots,
stochastic rounding); ``bf16 nearest`` (the same, rounded to nearest);
``fp16+SR`` (float16); on JAX also ``f32 no-fused`` (float32 with the
compiled CPU update switched off, the route 16-bit tables take), which
says how much of a 16-bit step time is the route rather than the dtype.

Every variant of a seed starts from the same initial weights and sees the
same batches; deltas are paired per seed (variant minus float32), then
mean +- std over seeds. Bytes are summed over the tables' variables (the
table and its optimizer slots; the dedup scratch and counters are left
out). Step time: ms per step over the epochs after the first (which
compiles), its ratio to float32 taken per seed (variants of a seed run
back to back) and the median reported. On a busy machine epoch times are
noise; ``--timing`` times the variants' steps in turns instead (rounds of
10 steps of each, the median of the per-round ratios).

    python benchmarks/table_precision.py                  # 3 seeds, both tasks
    python benchmarks/table_precision.py --quick          # smoke size
    python benchmarks/table_precision.py --tasks dlrm --first-seed 1 --seeds 1
    python benchmarks/table_precision.py --combine out0.txt out1.txt
    python benchmarks/table_precision.py --timing --rounds 15
"""

import argparse
import functools
import importlib.util
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from scipy.stats import rankdata  # noqa: E402

import keras_sparse as ks  # noqa: E402
from keras_sparse.data import criteo_like  # noqa: E402
from keras_sparse.data.synthetic import scaled_cardinalities  # noqa: E402

SIXTEEN = {"stochastic_rounding": True}
VARIANTS = {
    "float32": {},
    "bf16+SR": dict(table_dtype="bfloat16", slot_dtype="bfloat16", **SIXTEEN),
    "bf16 nearest": dict(
        table_dtype="bfloat16", slot_dtype="bfloat16", stochastic_rounding=False
    ),
    "fp16+SR": dict(table_dtype="float16", slot_dtype="float16", **SIXTEEN),
    "f32 no-fused": {},  # JAX only: float32 off the compiled update
}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FULL = dict(
    seeds=3, dlrm_samples=100_000, dlrm_fields=26, dlrm_scale=0.005, dlrm_dim=16,
    dlrm_epochs=2,
    dlrm_batch=2048, ratings=100_000, mf_epochs=10, mf_batch=256, mf_lr="0.5,0.1",
    variants=None,
)  # fmt: skip
QUICK = dict(
    seeds=1, dlrm_samples=2_000, dlrm_fields=2, dlrm_scale=0.001, dlrm_dim=4,
    dlrm_epochs=2, dlrm_batch=600, ratings=2_000, mf_epochs=2, mf_batch=600,
    mf_lr="0.5", variants="float32,bf16+SR,bf16 nearest",
)  # fmt: skip


@functools.cache
def load_dlrm():
    spec = importlib.util.spec_from_file_location(
        "dlrm_example", ROOT / "examples" / "dlrm.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def route(variant):
    """Switches JAX's compiled CPU update off for ``f32 no-fused`` (read
    when the step is traced) and back on for the others."""
    if keras.backend.backend() == "jax":
        from keras_sparse.ops.jax import native_rows

        native_rows.FUSED_OPTIMIZERS = variant != "f32 no-fused"


def table_bytes(model):
    """Bytes of every sparse table and its optimizer slots: the variables
    with one row per id (the scratch has one more, counters none)."""
    total = 0
    for layer in model.layers:
        if not isinstance(layer, ks.AllToAllDenseEmbedding):
            continue
        for v in layer.variables:
            if len(v.shape) and v.shape[0] == layer.input_dim:
                size = BYTES[keras.backend.standardize_dtype(v.dtype)]
                total += int(np.prod(v.shape)) * size
    return total


def fit_timed(model, x, y, epochs, batch):
    timer = load_dlrm().EpochTimer()
    model.fit(x, y, batch_size=batch, epochs=epochs, callbacks=[timer], verbose=0)
    steps = -(-len(y) // batch)
    timed = timer.seconds[1:] or timer.seconds
    return 1000 * sum(timed) / (len(timed) * steps)


def predict(model, x, batch):
    return np.asarray(model.predict(x, batch_size=batch, verbose=0), "float64")


def auc(labels, scores):
    labels = np.asarray(labels).reshape(-1) > 0.5
    ranks = rankdata(np.asarray(scores).reshape(-1))
    pos, neg = labels.sum(), (~labels).sum()
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def dlrm_data(args, seed):
    dlrm = load_dlrm()
    features, labels = criteo_like(args.dlrm_samples, scale=args.dlrm_scale, seed=seed)
    # The first ``dlrm_fields`` categorical fields (all 26 by default).
    keep = ["dense"] + [f"cat_{i}" for i in range(args.dlrm_fields)]
    features = {k: features[k] for k in keep}
    return dlrm, dlrm.split(features, labels, 0.1)


def dlrm_model(args, variant, seed, dlrm):
    keras.utils.set_random_seed(seed)  # the same initial weights per seed
    model = dlrm.build_model(
        scaled_cardinalities(scale=args.dlrm_scale)[: args.dlrm_fields],
        dim=args.dlrm_dim,
        optimizer="adagrad",
        table_options=VARIANTS[variant],
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    return model


def train_dlrm(args, variant, seed, data):
    dlrm, ((x_train, y_train), (x_test, y_test)) = data
    model = dlrm_model(args, variant, seed, dlrm)
    ms = fit_timed(model, x_train, y_train, args.dlrm_epochs, args.dlrm_batch)
    score = auc(y_test, predict(model, x_test, 8192))
    return score, table_bytes(model), ms


def ratings_data(args, seed, users=943, items=1682, rank=8):
    """MovieLens-100K-sized ratings: distinct (user, item) pairs with
    Zipf-like activity and popularity; rating = round(3.5 + biases +
    low-rank dot + noise) clipped to 1..5."""
    rng = np.random.default_rng(1000 + seed)
    user_p = 1.0 / np.arange(1, users + 1) ** 0.6
    item_p = 1.0 / np.arange(1, items + 1) ** 0.9
    user_p, item_p = rng.permutation(user_p / user_p.sum()), item_p / item_p.sum()
    item_p = rng.permutation(item_p)
    pairs = set()
    while len(pairs) < args.ratings:
        n = args.ratings - len(pairs)
        u = rng.choice(users, 2 * n, p=user_p)
        i = rng.choice(items, 2 * n, p=item_p)
        pairs.update(zip(u.tolist(), i.tolist()))
    pairs = np.array(sorted(pairs))[rng.permutation(len(pairs))[: args.ratings]]
    u, i = pairs[:, 0].astype("int32"), pairs[:, 1].astype("int32")
    p = rng.normal(0, 0.5, (users, rank)) / rank**0.25
    q = rng.normal(0, 0.5, (items, rank)) / rank**0.25
    b_u, b_i = rng.normal(0, 0.3, users), rng.normal(0, 0.5, items)
    truth = 3.5 + b_u[u] + b_i[i] + np.sum(p[u] * q[i], 1)
    rating = np.clip(np.round(truth + rng.normal(0, 0.5, len(u))), 1, 5)
    n_train = int(0.9 * len(u))
    x = {"user": u, "item": i}
    y = rating.astype("float32")
    train = ({k: v[:n_train] for k, v in x.items()}, y[:n_train])
    test = ({k: v[n_train:] for k, v in x.items()}, y[n_train:])
    return train, test


def mf_model(args, variant, lr, users=943, items=1682):
    opts = VARIANTS[variant]
    user, item = (keras.Input((), dtype="int32", name=n) for n in ("user", "item"))

    def table(rows, dim, name, scale):
        return ks.AllToAllDenseEmbedding(
            rows, dim, optimizer=ks.optimizers.SGD(lr), name=name,
            embeddings_initializer=keras.initializers.RandomNormal(0, scale),
            **opts,
        )  # fmt: skip

    p = table(users, args.mf_dim, "user_vec", 0.1)(user)
    q = table(items, args.mf_dim, "item_vec", 0.1)(item)
    b_u = table(users, 1, "user_bias", 0.0)(user)
    b_i = table(items, 1, "item_bias", 0.0)(item)
    dot = keras.ops.sum(p * q, axis=-1) + b_u[:, 0] + b_i[:, 0] + 3.5
    return keras.Model({"user": user, "item": item}, dot)


def mf_compiled(args, variant, seed, lr):
    keras.utils.set_random_seed(seed)
    model = mf_model(args, variant, lr)
    # No dense weights: the tables' sparse SGD does all the training.
    model.compile(optimizer="sgd", loss="mse")
    return model


def train_ratings(args, variant, seed, data, lr):
    (x_train, y_train), (x_test, y_test) = data
    model = mf_compiled(args, variant, seed, lr)
    ms = fit_timed(model, x_train, y_train, args.mf_epochs, args.mf_batch)
    error = predict(model, x_test, 8192).reshape(-1) - y_test
    return float(np.sqrt(np.mean(error**2))), table_bytes(model), ms


def run_task(task, variants, seeds, train):
    """``{variant: [(metric, bytes, ms), ...per seed]}``; a seed's variants
    back to back, so that their step times share the machine's state. Each
    run also prints a ``run |`` line (``--combine`` reads them back)."""
    results = {v: [] for v in variants}
    for seed in seeds:
        for variant in variants:
            route(variant)
            results[variant].append(train(variant, seed))
            metric, size, ms = results[variant][-1]
            # Exact values (repr), so that ``--combine`` prints the same table.
            print(f"  run | {task} | {seed} | {variant} | {metric!r} | {size} | "
                  f"{ms!r}", flush=True)  # fmt: skip
    route("float32")
    return results


def interleaved_ms(task, build, x, y, batch, rounds, steps=10):
    """Step times of a model per variant, ``build(variant)``, timed in
    turns: each round runs ``steps`` `train_on_batch` calls of every
    variant in a row, so that a busy machine slows them alike. Prints per
    variant the median ms per step and the median of its per-round ratio
    to float32."""
    steps = min(steps, len(y) // batch)
    batches = [
        ({k: v[i * batch : (i + 1) * batch] for k, v in x.items()},
         y[i * batch : (i + 1) * batch])
        for i in range(steps)
    ]  # fmt: skip
    models = {}
    for variant in build.variants:
        route(variant)  # read when the step is traced: at its first call
        models[variant] = build(variant)
        models[variant].train_on_batch(*batches[0])
    route("float32")
    ms = {v: [] for v in models}
    for _ in range(rounds):
        for variant, model in models.items():
            start = time.perf_counter()
            for xb, yb in batches:
                model.train_on_batch(xb, yb)
            ms[variant].append(1000 * (time.perf_counter() - start) / steps)
    rows = []
    for variant, times in ms.items():
        ratios = [t / b for t, b in zip(times, ms["float32"])]
        rows.append([task, variant, f"{statistics.median(times):.2f}",
                     f"{statistics.median(ratios):.2f}x", str(rounds)])  # fmt: skip
    return rows


def timing(args, names):
    """``--timing``: the interleaved step times of both tasks (seed 0)."""
    rows = []
    if "dlrm" in args.tasks:
        dlrm, ((x, y), _) = dlrm_data(args, 0)

        def build(variant):
            return dlrm_model(args, variant, 0, dlrm)

        build.variants = names
        rows += interleaved_ms("dlrm", build, x, y, args.dlrm_batch, args.rounds)
    if "ratings" in args.tasks:
        (x, y), _ = ratings_data(args, 0)
        lr = float(args.mf_lr.split(",")[0])

        def build(variant):
            return mf_compiled(args, variant, 0, lr)

        build.variants = names
        rows += interleaved_ms("ratings", build, x, y, args.mf_batch, args.rounds)
    header = ["task", "variant", "ms/step", "step ratio", "rounds"]
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def combine(paths):
    """Table rows from the ``run |`` lines of earlier runs' outputs (say,
    one process per seed), seeds in order per task and variant."""
    runs = {}
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            cells = [c.strip() for c in line.split("|")]
            if len(cells) == 7 and cells[0] == "run":
                _, task, seed, variant, metric, size, ms = cells
                runs.setdefault(task, {}).setdefault(variant, []).append(
                    (int(seed), float(metric), int(size), float(ms))
                )
    rows = []
    for task, by_variant in runs.items():
        results = {v: [r[1:] for r in sorted(rs)] for v, rs in by_variant.items()}
        rows += table_rows(task, results, relative="RMSE" in task)
    return rows


def mean_std(values, fmt):
    if len(values) < 2:
        return fmt.format(values[0])
    spread = fmt.replace("+", "").format(np.std(values, ddof=1))
    return f"{fmt.format(np.mean(values))} ± {spread}"


def table_rows(task, results, relative):
    """Markdown rows of one task; ``relative``: delta in % of float32
    (RMSE) instead of absolute (AUC)."""
    base = results["float32"]
    rows = []
    for variant, runs in results.items():
        metrics = [r[0] for r in runs]
        deltas = [r[0] - b[0] for r, b in zip(runs, base)]
        if relative:
            deltas = [100 * d / b[0] for d, b in zip(deltas, base)]
        ratios = [r[2] / b[2] for r, b in zip(runs, base)]
        rows.append([
            task, variant, mean_std(metrics, "{:.4f}"),
            mean_std(deltas, "{:+.2f}%" if relative else "{:+.4f}"),
            f"{runs[0][1] / 2**20:.3g}", f"{runs[0][1] / base[0][1]:.2f}x",
            f"{statistics.median(r[2] for r in runs):.2f}",
            f"{statistics.median(ratios):.2f}x",
        ])  # fmt: skip
    return rows


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke size")
    parser.add_argument("--seeds", type=int, help="how many (3; quick: 1)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument(
        "--timing",
        action="store_true",
        help="only step times, the variants timed in turns",
    )
    parser.add_argument("--rounds", type=int, default=15,
                        help="--timing: rounds of 10 steps per variant")  # fmt: skip
    parser.add_argument("--combine", nargs="+", metavar="OUTPUT",
                        help="print the table of earlier runs' outputs")  # fmt: skip
    parser.add_argument("--tasks", default="dlrm,ratings")
    parser.add_argument("--variants", help="comma-separated; default: all")
    parser.add_argument("--mf-lr",
                        help="sparse SGD rates of the ratings task (of the "
                        "batch-mean loss; per rating: lr * 2 / batch)")  # fmt: skip
    parser.add_argument("--mf-dim", type=int, default=16)
    for key in FULL:
        if key not in ("seeds", "mf_lr", "variants"):
            parser.add_argument("--" + key.replace("_", "-"), type=type(FULL[key]))
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None):
    args = parse_args(argv)
    names = [v for v in VARIANTS if v != "f32 no-fused"]
    if keras.backend.backend() == "jax":
        names.append("f32 no-fused")
    if args.variants:
        names = ["float32"] + [v for v in args.variants.split(",") if v != "float32"]
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    tasks = args.tasks.split(",")
    if args.combine:
        print_table(combine(args.combine))
        return
    if args.timing:
        timing(args, names)
        return
    print(f"backend={keras.backend.backend()} seeds={args.seeds} "
          f"compiled update: {ks.compiled_cpu_helpers()}", flush=True)  # fmt: skip
    rows = []
    start = time.perf_counter()
    if "dlrm" in tasks:
        print(f"dlrm: {args.dlrm_samples} samples, scale {args.dlrm_scale}, dim "
              f"{args.dlrm_dim}, {args.dlrm_epochs} epochs of batch "
              f"{args.dlrm_batch}, Adagrad(0.05) tables", flush=True)  # fmt: skip
        data = {s: dlrm_data(args, s) for s in seeds}
        results = run_task(
            "dlrm AUC", names, seeds, lambda v, s: train_dlrm(args, v, s, data[s])
        )
        rows += table_rows("dlrm AUC", results, relative=False)
    if "ratings" in tasks:
        data = {s: ratings_data(args, s) for s in seeds}
        for lr in (float(v) for v in args.mf_lr.split(",")):
            print(f"ratings: {args.ratings} ratings, dim {args.mf_dim}, "
                  f"{args.mf_epochs} epochs of batch {args.mf_batch}, "
                  f"SGD({lr}) tables", flush=True)  # fmt: skip
            results = run_task(
                f"ratings RMSE lr={lr}", names, seeds,
                lambda v, s, lr=lr: train_ratings(args, v, s, data[s], lr),
            )  # fmt: skip
            rows += table_rows(f"ratings RMSE lr={lr}", results, relative=True)
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


def print_table(rows):
    header = ["task", "variant", "metric", "Δ vs float32", "table+slot MiB",
              "bytes ratio", "ms/step", "step ratio"]  # fmt: skip
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
