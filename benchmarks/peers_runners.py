"""One variant of the peers workload, run in this process.

`benchmarks/peers.py` starts one child process per variant and round; the
child builds the variant here for each table size it is given, warms each
up, and times its steps. With one size the child times ``--steps`` steps
in one go. With several (``peers.py --together``) it trains every size in
the same process and alternates them epoch by epoch (A B, B A, ...), so
that a slow spell of the machine slows every size alike and their ratio,
the growth of the step with table size, comes from one process.

Nothing here imports a deep-learning library at module level: TorchRec's
child runs under a Python without Keras, and the Keras children import
their backend only once ``KERAS_BACKEND`` is set.
"""

import resource
import statistics
import sys
import time

DIM = 16
BAG = 4
ZIPF_A = 1.1
HIDDEN = 64
LR = 0.01
FBGEMM_EPS = 1e-8
#: ``--optimizers`` choices: the tables' optimizer, ours and TorchRec's
#: (its fused module maps torch.optim.SGD to EXACT_SGD, torch.optim.Adagrad
#: to EXACT_ADAGRAD, torchrec.optim.RowWiseAdagrad to EXACT_ROWWISE_ADAGRAD
#: and torch.optim.Adam to ADAM).
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")
#: The TorchRec optimizer each is compared with. FBGEMM has no FTRL, and
#: its CPU mode no ADAM (only EXACT_SGD, EXACT_ADAGRAD and the row-wise
#: Adagrads: "Optimizer OptimType.ADAM is not supported in CPU mode"), so
#: Ftrl and Adam stand beside Adagrad (per-element state, as theirs) and
#: TorchRec does not run them.
PEER_OPTIMIZER = {o: o for o in OPTIMIZERS} | {"ftrl": "adagrad", "adam": "adagrad"}
VARIANTS = {  # name: (KERAS_BACKEND, model form); torchrec: no Keras
    "torchrec": (None, "torchrec"),
    "torchrec-thp": (None, "torchrec"),
    "ks-jax-layers": ("jax", "layers"),
    "ks-jax-layers-glibc": ("jax", "layers"),
    "ks-jax-collection": ("jax", "collection"),
    "ks-tf-layers": ("tensorflow", "layers"),
    "ks-tf-layers-glibc": ("tensorflow", "layers"),
    "ks-tf-collection": ("tensorflow", "collection"),
    "ks-torch-layers": ("torch", "layers"),
    "ks-torch-layers-glibc": ("torch", "layers"),
    "ks-torch-collection": ("torch", "collection"),
    "keras-dense": ("jax", "dense"),
}
# keras-sparse processes call ks.tune_cpu_allocator() (JAX: the allocator
# settings advised for JAX on a CPU and 2 MiB pages for the tables;
# TensorFlow, PyTorch: the pages alone), as the docs advise; the "-glibc"
# variants keep glibc's and the kernel's defaults (4 KiB pages). TorchRec
# runs as installed; "torchrec-thp" with THP_MEM_ALLOC_ENABLE=1 (PyTorch's
# allocator puts every allocation of 2 MiB or more on huge pages).
DEFAULT_ALLOCATOR = {name for name in VARIANTS if name.endswith("-glibc")}


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def load_data(path):
    """``(ids [n, tables, BAG] int32, labels [n, 1] float32)``."""
    import numpy as np

    with np.load(path) as data:
        return data["ids"], data["labels"]


def keras_model(form, names, rows, optimizer="adagrad"):
    """The compiled Keras model of the workload: ``form`` is "dense",
    "layers" or "collection", one table of ``rows`` per name in ``names``,
    the tables updated by ``optimizer`` (one of `OPTIMIZERS`; not "dense")
    (benchmarks/switch_ab.py builds it too)."""
    import keras

    import keras_sparse as ks

    keras.utils.set_random_seed(0)

    def sparse_optimizer():
        if optimizer in ("sgd", "adam", "ftrl"):  # each library's defaults
            return {"sgd": ks.optimizers.SGD, "adam": ks.optimizers.Adam,
                    "ftrl": ks.optimizers.Ftrl}[optimizer](LR)  # fmt: skip
        kind = {"adagrad": ks.optimizers.Adagrad,
                "rowwise_adagrad": ks.optimizers.RowWiseAdagrad}[optimizer]  # fmt: skip
        return kind(LR, initial_accumulator_value=0.0)

    inputs = {n: keras.Input((BAG,), dtype="int32", name=n) for n in names}
    if form == "dense":
        parts = [
            keras.ops.sum(keras.layers.Embedding(rows, DIM, name=f"t_{n}")(x), 1)
            for n, x in inputs.items()
        ]
    elif form == "layers":
        parts = [
            ks.AllToAllDenseEmbedding(
                rows, DIM, combiner="sum", optimizer=sparse_optimizer(),
                name=f"t_{n}",
            )(x)
            for n, x in inputs.items()
        ]  # fmt: skip
    else:
        collection = ks.EmbeddingCollection(
            {n: ks.TableConfig(rows, DIM, combiner="sum") for n in names},
            optimizer=sparse_optimizer(),
            name="tables",
        )
        outputs = collection(inputs)
        parts = [outputs[n] for n in names]
    hidden = keras.layers.Dense(HIDDEN, activation="relu")(
        keras.layers.Concatenate()(parts)
    )
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(
        optimizer=keras.optimizers.Adagrad(LR, initial_accumulator_value=0.0),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return model


def _version(module):
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - informational only
        return "?"


def _keras_setup(args):
    """Backend checks and settings once per process; the versions to report."""
    import keras

    import keras_sparse as ks

    backend = VARIANTS[args.variant][0]
    assert keras.backend.backend() == backend, keras.backend.backend()
    extra = {}
    if backend == "torch":
        import torch

        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        extra["torch_threads"] = torch.get_num_threads()
    if args.variant not in DEFAULT_ALLOCATOR:
        tuned = ks.tune_cpu_allocator(backend == "jax", huge_pages=True)
        extra["tuned_allocator" if backend == "jax" else "huge_pages"] = tuned
    return {"keras": keras.__version__, backend: _version(backend), **extra}


def keras_runner(args, rows, data):
    """``run(lo, hi)``: fits batches ``lo..hi`` of the data at ``data`` on
    the variant's model of ``rows`` per table; the gaps between batch ends
    and their process CPU times."""
    import numpy as np
    from step_timer import StepTimer

    ids, labels = load_data(data)
    names = [f"f{t}" for t in range(ids.shape[1])]
    model = keras_model(VARIANTS[args.variant][1], names, rows, args.optimizer)
    fit = dict(batch_size=args.batch, shuffle=False, verbose=0)

    def run(lo, hi):
        lo, hi = lo * args.batch, hi * args.batch
        feed = {n: np.ascontiguousarray(ids[lo:hi, t]) for t, n in enumerate(names)}
        timer = StepTimer()
        model.fit(feed, labels[lo:hi], callbacks=[timer], **fit)
        return timer.gaps, timer.cpu_gaps

    return run


def _torchrec_setup(args):
    import fbgemm_gpu
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    return {
        "torch": torch.__version__,
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
        "torchrec": _version("torchrec"),
        "torch_threads": torch.get_num_threads(),
    }


def torchrec_runner(args, rows, data):
    """As `keras_runner`, for TorchRec's fused EBC and a torch head."""
    import torch
    from torchrec import EmbeddingBagConfig
    from torchrec import KeyedJaggedTensor
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    ids, labels = load_data(data)
    tables = ids.shape[1]
    names = [f"f{t}" for t in range(tables)]
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(
            name=f"t_{n}", embedding_dim=DIM, num_embeddings=rows,
            feature_names=[n], weight_init_min=-0.05, weight_init_max=0.05,
        )
        for n in names
    ]  # fmt: skip
    if args.optimizer == "rowwise_adagrad":
        from torchrec.optim import RowWiseAdagrad as table_optimizer
    else:  # -> fused EXACT_SGD, EXACT_ADAGRAD
        table_optimizer = {"sgd": torch.optim.SGD,
                           "adagrad": torch.optim.Adagrad}[args.optimizer]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(
        tables=configs,
        optimizer_type=table_optimizer,
        optimizer_kwargs={"lr": LR, "eps": FBGEMM_EPS},
        device=torch.device("cpu"),
    )
    head = torch.nn.Sequential(
        torch.nn.Linear(tables * DIM, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )  # fmt: skip
    head_optimizer = torch.optim.Adagrad(head.parameters(), lr=LR)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    batches = []  # KJT layout: feature-major values, one length per bag
    lengths = torch.full((tables * args.batch,), BAG, dtype=torch.int64)
    for lo in range(0, len(ids), args.batch):
        block = ids[lo : lo + args.batch].transpose(1, 0, 2).reshape(-1)
        values = torch.from_numpy(block.astype("int64"))
        batches.append((values, torch.from_numpy(labels[lo : lo + args.batch])))

    def step(values, y):
        kjt = KeyedJaggedTensor(keys=names, values=values, lengths=lengths)
        head_optimizer.zero_grad()
        loss = loss_fn(head(ebc(kjt).values()), y)
        loss.backward()  # the tables are updated in here
        head_optimizer.step()
        return loss.item()

    hot = int(ids[0, 0, 0])  # a row the first step updates
    weight = ebc.embedding_bags[configs[0].name].weight
    before = weight[hot].clone()

    def run(lo, hi):
        gaps, cpu_gaps, last, last_cpu = [], [], None, None
        for values, y in batches[lo:hi]:
            step(values, y)
            now, cpu = time.perf_counter(), time.process_time()
            if last is not None:
                gaps.append(now - last)
                cpu_gaps.append(cpu - last_cpu)
            last, last_cpu = now, cpu
        # The fused update happened (a no-op step would time nothing).
        assert not torch.equal(before, weight[hot]), "the fused update left the tables"
        return gaps, cpu_gaps

    return run


def child(args):
    """Builds, warms up and times the variant at each of ``args.rows``
    (data files ``args.data``); prints one JSON line."""
    import json

    if VARIANTS[args.variant][0] is None:
        setup, runner = _torchrec_setup, torchrec_runner
    else:
        setup, runner = _keras_setup, keras_runner
    versions = setup(args)
    runs, warm_s = [], []
    for rows, data in zip(args.rows, args.data):
        run = runner(args, rows, data)
        t0 = time.perf_counter()
        run(0, args.warmup)  # compiles
        warm_s.append(time.perf_counter() - t0)
        runs.append(run)
    gaps = [[] for _ in runs]
    cpu_gaps = [[] for _ in runs]
    epochs = args.epochs if len(runs) > 1 else 1
    per = args.steps // epochs
    for e in range(epochs):
        lo = args.warmup + e * (per + 1)  # per + 1 batch ends: per gaps
        order = range(len(runs)) if e % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            wall, cpu = runs[i](lo, lo + per + 1)
            gaps[i] += wall
            cpu_gaps[i] += cpu
    sizes = {}
    for rows, g, c, w in zip(args.rows, gaps, cpu_gaps, warm_s):
        ms, cpu_ms = [1e3 * x for x in g], [1e3 * x for x in c]
        sizes[rows] = dict(
            ms=ms, median_ms=statistics.median(ms), cpu_ms=cpu_ms,
            median_cpu_ms=statistics.median(cpu_ms), warm_s=w,
        )  # fmt: skip
    result = dict(
        variant=args.variant, sizes=sizes, peak_rss_mib=peak_rss_mib(),
        versions=versions,
    )  # fmt: skip
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit("run benchmarks/peers.py")
