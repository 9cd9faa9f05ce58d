"""DistributedHashEmbedding vs keras.layers.Hashing + Embedding at equal memory.

What is compared: ``model.fit`` throughput (samples/s) of a 26-field model on
64-bit Zipf keys (``keras_sparse.data.criteo_like(..., hashed_keys=True)``).
Per field an embedding (dim 16, ``combiner=None``, keys of shape ``[batch]``)
-> Concatenate -> Dense(64, relu) -> Dense(1, sigmoid), binary crossentropy,
Adagrad everywhere:

* ``DistributedHashEmbedding(16, capacity=C, optimizer="adagrad")`` per
  field: every distinct key gets its own row (LRU eviction once a field has
  more than ``C`` live keys). The 64-bit keys reach the layer through
  ``keras_sparse.data.prefetch`` (the table work runs in its worker threads
  and the model receives int32 row codes), so JAX's int32 narrowing of int64
  inputs never applies and ``jax_enable_x64`` stays off.
* the usual workaround: ``keras.layers.Hashing(num_bins=C)`` into a fixed
  range, then ``keras.layers.Embedding(C, 16)`` trained by the model's
  Adagrad. Same number of table rows (``26 * C``) as the hash layer. Keras'
  ``Hashing`` is a TensorFlow-backed preprocessing layer that cannot be
  traced inside a JAX model, so it runs on the host, once, over the whole
  data set before the model (on the full int64 keys); the timed baseline fit
  therefore EXCLUDES hashing time. The host hashing time is measured
  separately and a second baseline row adds it back.

On a CPU (JAX) two more rows feed the raw int64 keys straight into ``fit``
(the compiled step reaches the tables through its callbacks; the full
64-bit keys are restored on the host): once through the in-place buffer
callback (the default on one device) and once through ``io_callback``
(``jax_step_mapping.IN_PLACE_CALLBACKS = False``), the two routes of
`keras_sparse.layers.hash.jax_step_mapping`.

Also reported: the collisions the workaround suffers, from the bins its
``Hashing`` layer actually produces: the fraction of distinct keys that share
a bin with another distinct key of the same field, and the fraction of
lookups (samples x fields) that land in such a collided bin.

Steady state: per variant one warm-up epoch (compiles; for the hash layer it
also fills the tables) is excluded, then the median of ``--repeats`` timed
one-epoch fits over the same data. Runs on whatever device the backend picks
(CPU in CI; the GPU when one is present: just run the same command); the
device is printed. Outputs a markdown table and
``benchmarks/out/hash_embedding.png``.

    python benchmarks/hash_embedding.py --quick        # CI smoke size
    python benchmarks/hash_embedding.py                # default size
    python benchmarks/hash_embedding.py --samples 1048576 --batch-size 16384 \\
        --capacity-per-field 65536 --scale 0.1

Run it alone on the machine: on 2 cores, concurrent processes distort the
throughput numbers (compare ratios from the same run only).
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_sparse.data import criteo_like  # noqa: E402
from keras_sparse.data import prefetch  # noqa: E402
from keras_sparse.layers import DistributedHashEmbedding  # noqa: E402
from keras_sparse.layers import HashEmbeddingCollection  # noqa: E402
from keras_sparse.layers.hash import jax_step_mapping  # noqa: E402

FIELDS = 26
DIM = 16
# prefetch: CPU tables through ks.data.prefetch; raw: CPU tables, raw int64
# keys into fit; prefetch-gpu / raw-gpu: the same with GPU tables (with
# --gpu-table); *-together: the fields in one HashEmbeddingCollection;
# baseline: keras Hashing + Embedding.
VARIANTS = (
    "prefetch",
    "raw",
    "raw-together",
    "prefetch-gpu",
    "raw-gpu",
    "raw-gpu-together",
    "baseline",
)
OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"


def device_description():
    backend = keras.backend.backend()
    try:
        if backend == "jax":
            import jax

            d = jax.devices()[0]
            return f"jax {d.platform}: {getattr(d, 'device_kind', d)}"
        if backend == "tensorflow":
            import tensorflow as tf

            gpus = tf.config.list_physical_devices("GPU")
            return f"tensorflow: {gpus[0].name if gpus else 'CPU'}"
        if backend == "torch":
            import torch

            if torch.cuda.is_available():
                return f"torch cuda: {torch.cuda.get_device_name(0)}"
            return "torch: CPU"
    except Exception as e:  # noqa: BLE001
        return f"{backend}: unknown ({e})"
    return backend


def _head(parts, inputs):
    h = keras.layers.Concatenate()(parts)
    h = keras.layers.Dense(64, activation="relu", name="mlp")(h)
    out = keras.layers.Dense(1, activation="sigmoid", name="head")(h)
    model = keras.Model(inputs, out)
    model.compile(keras.optimizers.Adagrad(), "binary_crossentropy")
    return model


def hash_model(capacity, table_device="cpu", key_dtype="int32", together=False):
    """One DistributedHashEmbedding per field (``together``: all in one
    `HashEmbeddingCollection`, one table call per step).

    int32 inputs: fed through `prefetch` (row codes). int64 inputs: raw keys
    straight into fit; the layer maps them in its host callback.
    """
    keras.utils.set_random_seed(0)
    # int32: the prefetch stage hands the layer int32 row codes; the 64-bit
    # keys never enter the JAX program.
    inputs = {
        f"cat_{f}": keras.Input((), dtype=key_dtype, name=f"cat_{f}")
        for f in range(FIELDS)
    }
    layers = {
        name: DistributedHashEmbedding(
            DIM,
            capacity=capacity,
            combiner=None,
            optimizer="adagrad",
            table_device=table_device,
            name=f"hash_emb_{f}",
        )
        for f, name in enumerate(inputs)
    }
    if together:
        outs = HashEmbeddingCollection(layers, name="hash_fields")(inputs)
    else:
        outs = {name: layer(inputs[name]) for name, layer in layers.items()}
    return _head([outs[name] for name in inputs], inputs)


def baseline_model(num_bins):
    """keras Embedding(num_bins) per field, fed bins from keras Hashing."""
    keras.utils.set_random_seed(0)
    inputs, parts = {}, []
    for f in range(FIELDS):
        k = keras.Input((), dtype="int32", name=f"cat_{f}")
        inputs[f"cat_{f}"] = k
        parts.append(keras.layers.Embedding(num_bins, DIM, name=f"emb_{f}")(k))
    return _head(parts, inputs)


def _splitmix64_bins(v, num_bins):
    """A strong 64-bit mix, modulo num_bins (used where TF is missing)."""
    with np.errstate(over="ignore"):
        z = v.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(num_bins)).astype(np.int32)


def hash_on_host(keys, num_bins):
    """keras.layers.Hashing over full int64 keys, per field, on the host.

    Keras' Hashing layer needs TensorFlow; on a machine without it (the GPU
    image) a NumPy splitmix64 hash modulo ``num_bins`` stands in: a uniform
    64-bit hash collides like FarmHash at these sizes. Returns the name used.
    """
    try:
        import tensorflow  # noqa: F401

        layer = keras.layers.Hashing(num_bins)
        name = "keras.layers.Hashing"

        def hash_fn(v):
            return np.asarray(keras.ops.convert_to_numpy(layer(v))).astype(np.int32)

    except ImportError:
        name = "NumPy splitmix64 (TensorFlow not installed)"

        def hash_fn(v):
            return _splitmix64_bins(v, num_bins)

    t0 = time.perf_counter()
    bins = {k: hash_fn(v) for k, v in keys.items()}
    return bins, time.perf_counter() - t0, name


def collision_stats(keys, bins, capacity):
    """Distinct keys sharing a bin with another key; lookups hitting those."""
    distinct = collided = lookups = collided_lookups = 0
    worst = (0.0, "")
    over = 0  # fields with more distinct keys than rows
    for name, k in keys.items():
        uniq, first, inverse = np.unique(k, return_index=True, return_inverse=True)
        ubins = bins[name][first]  # the bin of each distinct key
        per_bin = np.bincount(ubins)
        key_collided = per_bin[ubins] > 1
        distinct += uniq.shape[0]
        over += int(uniq.shape[0] > capacity)
        collided += int(key_collided.sum())
        lookups += k.shape[0]
        collided_lookups += int(key_collided[inverse].sum())
        frac = float(key_collided.mean())
        if frac > worst[0]:
            worst = (frac, f"{name} ({uniq.shape[0]:,} distinct keys)")
    return {
        "distinct": distinct,
        "key_frac": collided / distinct,
        "lookup_frac": collided_lookups / lookups,
        "worst": worst,
        "fields_over": over,
    }


def epoch_on_arrays(model, x, y, batch):
    """A callable fitting one epoch over in-memory arrays, in order."""
    return lambda: model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)


def timed_fits(fit, repeats):
    fit()  # warm-up epoch: compiles (and fills the hash tables); excluded
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        history = fit()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, float(history.history["loss"][-1])


def markdown(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


def plot(rows, coll, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [2, 1]}
    )
    names = [r["short"] for r in rows]
    vals = [r["sps"] for r in rows]
    bars = ax1.bar(names, vals, color=[f"C{i}" for i in range(len(rows))])
    ax1.bar_label(bars, labels=[f"{v:,.0f}" for v in vals], fontsize=8)
    ax1.set_ylabel("model.fit samples/s (median)")
    ax1.set_title("fit throughput, 26 fields, equal rows")
    ax1.tick_params(axis="x", labelsize=8)
    cvals = [100 * coll["key_frac"], 100 * coll["lookup_frac"]]
    bars = ax2.bar(["distinct keys", "lookups"], cvals, color="tab:red")
    ax2.bar_label(bars, labels=[f"{v:.1f}%" for v in cvals], fontsize=8)
    ax2.set_ylabel("% in a collided bin")
    ax2.set_title("Hashing + Embedding collisions")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--capacity-per-field", type=int, default=None)
    parser.add_argument("--scale", type=float, default=0.01,
                        help="criteo_like cardinality scale")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2,
                        help="prefetch worker threads")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="CI smoke size")
    parser.add_argument("--gpu-table", action="store_true",
                        help="add a row with the tables on the GPU (CuPy)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="",
                        help="a comma-separated subset of: " + ",".join(VARIANTS),
                        )  # fmt: skip
    args = parser.parse_args()
    quick = dict(samples=1 << 15, batch_size=4096, capacity_per_field=1 << 12,
                 repeats=2)  # fmt: skip
    full = dict(samples=1 << 18, batch_size=8192, capacity_per_field=1 << 14,
                repeats=3)  # fmt: skip
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    cap, batch, n = args.capacity_per_field, args.batch_size, args.samples

    print(
        f"backend={keras.backend.backend()} device=[{device_description()}] "
        f"cores={os.cpu_count()}\nsamples={n:,} batch={batch} "
        f"capacity/bins per field={cap:,} (total rows {FIELDS * cap:,}, "
        f"dim {DIM}) scale={args.scale} repeats={args.repeats}\n"
    )

    features, labels = criteo_like(
        n, hashed_keys=True, scale=args.scale, seed=args.seed
    )
    keys = {f"cat_{f}": features[f"cat_{f}"] for f in range(FIELDS)}
    assert all(v.dtype == np.int64 for v in keys.values())

    # Baseline input: keras Hashing on the host (full int64 keys).
    bins, hash_s, hasher = hash_on_host(keys, cap)
    print(f"baseline hashing: {hasher}")
    coll = collision_stats(keys, bins, cap)

    on_cpu = device_description().startswith("jax cpu")
    wanted = set(args.only.split(",")) if args.only else set(VARIANTS)
    if not args.gpu_table:
        wanted -= {"prefetch-gpu", "raw-gpu", "raw-gpu-together"}
    rows, stats = [], None
    # 1) DistributedHashEmbedding through the prefetch stage.
    if "prefetch" in wanted:
        hmodel = hash_model(cap)
        with prefetch(
            (keys, labels), hmodel, batch_size=batch, threads=args.threads, capacity=4
        ) as stage:
            t_hash, ts, loss = timed_fits(
                lambda: hmodel.fit(stage, epochs=1, verbose=0), args.repeats
            )
            stats = stage.stats()
        rows.append(dict(name="DistributedHashEmbedding (prefetch, 64-bit keys)",
                         short="DistributedHash\nEmbedding", sps=n / t_hash,
                         t=t_hash, ts=ts, loss=loss))  # fmt: skip

    if "raw" in wanted and keras.backend.backend() == "jax":
        # 1b) CPU tables, raw int64 keys straight into fit: the compiled step
        # reaches the tables through its callbacks, both routes side by side
        # on a CPU; a GPU step reaches CPU tables through io_callback only.
        for in_place in (True, False) if on_cpu else (False,):
            jax_step_mapping.IN_PLACE_CALLBACKS = in_place
            rmodel = hash_model(cap, key_dtype="int64")
            t_raw, ts, loss = timed_fits(
                epoch_on_arrays(rmodel, keys, labels, batch), args.repeats
            )
            route = "in-place buffer callback" if in_place else "io_callback"
            rows.append(dict(name=f"DistributedHashEmbedding (raw keys, {route})",
                             short=f"DistributedHash\n(raw, {route.split()[0]})",
                             sps=n / t_raw, t=t_raw, ts=ts, loss=loss))  # fmt: skip
        jax_step_mapping.IN_PLACE_CALLBACKS = True
    if "raw-together" in wanted and keras.backend.backend() == "jax":
        # 1b') The same, all fields in one HashEmbeddingCollection: one
        # callback per step maps every field.
        tmodel = hash_model(cap, key_dtype="int64", together=True)
        t_tog, ts, loss = timed_fits(
            epoch_on_arrays(tmodel, keys, labels, batch), args.repeats
        )
        rows.append(dict(name="HashEmbeddingCollection (raw keys, one callback)",
                         short="HashEmbedding\nCollection (raw)", sps=n / t_tog,
                         t=t_tog, ts=ts, loss=loss))  # fmt: skip

    if "prefetch-gpu" in wanted:
        # 1c) Tables on the GPU (CuPy), driven by the prefetch workers.
        pmodel = hash_model(cap, table_device="gpu")
        with prefetch(
            (keys, labels), pmodel, batch_size=batch, threads=args.threads, capacity=4
        ) as stage:
            t_p, ts, loss = timed_fits(
                lambda: pmodel.fit(stage, epochs=1, verbose=0), args.repeats
            )
        rows.append(dict(name="DistributedHashEmbedding (prefetch, GPU tables)",
                         short="DistributedHash\n(prefetch, GPU)", sps=n / t_p,
                         t=t_p, ts=ts, loss=loss))  # fmt: skip
    if "raw-gpu" in wanted:
        # 1d) Tables on the GPU (CuPy), raw int64 keys straight into fit,
        # through both routes: the in-place GPU-buffer callback (keys and
        # rows stay on the GPU, the CuPy table runs on XLA's stream) and the
        # io_callback (keys through the host).
        for in_step in (True, False):
            jax_step_mapping.GPU_BUFFERS_IN_STEP = in_step
            gmodel = hash_model(cap, table_device="gpu", key_dtype="int64")
            t_gpu, ts, loss = timed_fits(
                epoch_on_arrays(gmodel, keys, labels, batch), args.repeats
            )
            route = jax_step_mapping.choose_route(gmodel.get_layer("hash_emb_0"))
            name = f"DistributedHashEmbedding (GPU tables, raw keys, {route})"
            rows.append(dict(name=name, short=f"DistributedHash\n(GPU, {route})",
                             sps=n / t_gpu, t=t_gpu, ts=ts, loss=loss))  # fmt: skip
        jax_step_mapping.GPU_BUFFERS_IN_STEP = True
    if "raw-gpu-together" in wanted:
        # 1d') GPU tables, all fields in one HashEmbeddingCollection: one
        # kernel launch per step maps every field (GPU-buffer route).
        gmodel = hash_model(cap, table_device="gpu", key_dtype="int64", together=True)
        t_gt, ts, loss = timed_fits(
            epoch_on_arrays(gmodel, keys, labels, batch), args.repeats
        )
        rows.append(dict(name="HashEmbeddingCollection (GPU tables, raw keys, "
                         "one launch)", short="HashEmbedding\nCollection (GPU)",
                         sps=n / t_gt, t=t_gt, ts=ts, loss=loss))  # fmt: skip

    # 2) Hashing (host, excluded) + Embedding.
    if "baseline" in wanted:
        bmodel = baseline_model(cap)
        t_base, ts, loss = timed_fits(
            epoch_on_arrays(bmodel, bins, labels, batch), args.repeats
        )
        rows.append(dict(name="Hashing + Embedding (host hashing excluded)",
                         short="Hashing+Embedding\n(hashing excl.)", sps=n / t_base,
                         t=t_base, ts=ts, loss=loss))  # fmt: skip
        rows.append(dict(name="Hashing + Embedding (host hashing added back)",
                         short="Hashing+Embedding\n(hashing incl.)",
                         sps=n / (t_base + hash_s), t=t_base + hash_s, ts=None,
                         loss=loss))  # fmt: skip

    print("### model.fit throughput, equal table rows\n")
    print(
        markdown(
            [
                "variant",
                "samples/s",
                "vs first row",
                "epoch s (median)",
                "timed epochs s",
                "last loss",
            ],
            [
                (
                    r["name"],
                    f"{r['sps']:,.0f}",
                    f"{r['sps'] / rows[0]['sps']:.2f}x",
                    f"{r['t']:.2f}",
                    ", ".join(f"{t:.2f}" for t in r["ts"]) if r["ts"] else "-",
                    f"{r['loss']:.4f}",
                )
                for r in rows
            ],
        )  # fmt: skip
    )
    print(
        f"\nHashing + Embedding collisions ({FIELDS} fields x {cap:,} bins, "
        f"{coll['distinct']:,} distinct keys in the data):\n"
    )
    print(
        markdown(
            [
                "distinct keys in a collided bin",
                "lookups hitting a collided bin",
                "worst field (distinct keys collided)",
            ],
            [
                (
                    f"{100 * coll['key_frac']:.2f}%",
                    f"{100 * coll['lookup_frac']:.2f}%",
                    f"{coll['worst'][1]}: {100 * coll['worst'][0]:.1f}%",
                )
            ],
        )  # fmt: skip
    )
    print(
        "\nNotes: keras.layers.Hashing is TF-backed and cannot run inside a "
        "JAX-traced model, so the baseline hashes on the host before fit "
        f"({hash_s:.2f} s for all {n:,} x {FIELDS} keys, excluded from the "
        "'excluded' row, added once per epoch in the 'added back' row). "
        + (
            "The hash layer gets its 64-bit keys through keras_sparse.data."
            f"prefetch ({args.threads} worker threads; table work "
            f"{stats['table_s']:.2f} s in the workers over all "
            f"{stats['batches']} batches incl. warm-up, main thread waited "
            f"{stats['wait_s']:.2f} s). "
            if stats
            else ""
        )
        + "jax_enable_x64 is not enabled. "
        f"{coll['fields_over']} of {FIELDS} fields have more distinct keys than "
        f"{cap:,} rows: there the hash layer evicts (LRU) instead of colliding. "
        "The hash layer additionally keeps a "
        "key table (64-bit keys + LRU state) beside its embedding rows; "
        "'equal memory' counts embedding rows only. Losses are after "
        f"{args.repeats + 1} epochs over the same data."
    )
    png = OUT_DIR / "hash_embedding.png"
    plot(rows, coll, png)
    print(f"\nwrote {png.relative_to(OUT_DIR.parents[1])}")


if __name__ == "__main__":
    main()
