"""Sparse training step vs TorchRec's fused FBGEMM kernels, side by side.

Workload (the same ids for every variant): ``--tables`` (26) tables of
``rows x 16``, one bag of 4 ids per table per sample drawn from a bounded
Zipf(1.1) law (`keras_sparse.data.zipf_ids`), sum pooling, the 26 pooled
vectors concatenated into a Dense(64)-ReLU-Dense(1) head, binary
cross-entropy on logits, batch 4096, Adagrad with learning rate 0.01 on the
embeddings and on the head. Reported: the median ms per training step over
``--steps`` steps after ``--warmup`` untimed ones (all rounds pooled), the
median process CPU time per step (``time.process_time``: on a busy machine
less disturbed than the wall clock), the child's peak RSS, and the ratios
to TorchRec's medians at the same table size.

Variants (each run in its own process; this script with ``--variant NAME
--rows R`` builds, warms up, times and prints one JSON line):

* ``torchrec``: ``torchrec.modules.fused_embedding_modules.
  FusedEmbeddingBagCollection(optimizer_type=torch.optim.Adagrad)``, the
  unsharded CPU module, whose tables live in one FBGEMM
  ``SplitTableBatchedEmbeddingBagsCodegen`` (``EmbeddingLocation.HOST``,
  ``ComputeDevice.CPU``) updated by ``EXACT_ADAGRAD`` inside the backward
  pass; the head is a ``torch.nn.Sequential`` with ``torch.optim.Adagrad``.
  Runs under the Python of a separate venv, ``--torchrec-python``; skipped
  (with a message) when that is not given or cannot ``import torchrec``.
* ``ks-{jax,tf,torch}-layers``: 26 ``ks.AllToAllDenseEmbedding(rows, 16,
  combiner="sum", optimizer=ks.optimizers.Adagrad(...))``.
* ``ks-{jax,tf,torch}-collection``: one ``ks.EmbeddingCollection`` of the 26
  tables (``ks.TableConfig(rows, 16, combiner="sum")``), same optimizer.
* ``keras-dense``: 26 ``keras.layers.Embedding`` + a sum over the bag, JAX;
  the model's Keras Adagrad updates every row of every table every step.

Every JAX process (``ks-jax-*``, ``keras-dense``) first calls
``ks.tune_cpu_allocator()``, as the docs advise for JAX on a CPU: XLA:CPU
allocates each step's temporary buffer afresh, and with glibc's defaults
every page of it faults in again on every step (14K faults, ~20 ms per
step here); it also puts the tables and slots on 2 MiB pages.
TensorFlow and PyTorch processes call ``ks.tune_cpu_allocator(False,
huge_pages=True)``: glibc's allocator as it is (they allocate per tensor
and gain nothing from the settings), tables and slots on 2 MiB pages. The
``-glibc`` variants (``ks-jax-layers-glibc``, ``ks-tf-layers-glibc``,
``ks-torch-layers-glibc``) leave out the call: glibc's and the kernel's
defaults, 4 KiB pages. TorchRec runs as installed (4 KiB pages);
``torchrec-thp`` sets ``THP_MEM_ALLOC_ENABLE=1``, PyTorch's own switch
that puts every CPU allocation of 2 MiB or more on huge pages (slower
here: 1.1-1.2x TorchRec's default step, its per-step buffers then fault
in 2 MiB at a time).

Keras variants train with ``model.fit`` over a fixed in-memory dataset
(``verbose=0, shuffle=False``); a step's time is the gap between consecutive
``on_train_batch_end`` callbacks (the loss is read there, so asynchronous
dispatch cannot hide work), i.e. it includes fit's own per-batch work
(slicing the arrays, host-to-device). TorchRec's step builds a
``KeyedJaggedTensor`` from per-batch tensors made before timing, then runs
``zero_grad``, forward, ``backward`` (the fused update), ``step`` and
``loss.item()``; it is timed the same way, between consecutive step ends.

Semantic differences to keep in mind (every variant uses learning rate
0.01 and an initial accumulator of 0; epsilons stay at each library's
default since their placement differs anyway):

* Keras ``keras.optimizers.Adagrad`` (head of every Keras variant, and the
  tables of ``keras-dense``): ``acc += g**2; w -= lr * g / sqrt(acc + eps)``,
  defaults ``initial_accumulator_value=0.1, epsilon=1e-7`` (eps inside the
  square root). Set here to ``initial_accumulator_value=0.0``.
* ``ks.optimizers.Adagrad`` (keras_sparse/optimizers/adagrad.py): the same
  update and the same defaults as Keras' (``learning_rate=0.001``,
  ``initial_accumulator_value=0.1``, ``epsilon=1e-7`` inside the root),
  applied only to the rows a batch touches, duplicate ids' gradients summed
  first. Set here to ``learning_rate=0.01, initial_accumulator_value=0.0``.
* FBGEMM ``EXACT_ADAGRAD`` (fbgemm_gpu/codegen/genscript/optimizers.py,
  ``adagrad()``; ``SplitTableBatchedEmbeddingBagsCodegen`` defaults
  ``learning_rate=0.01, eps=1e-8``): ``acc += g**2; w -= lr * g /
  (sqrt(acc) + eps)`` (eps outside the root), per element, on the touched
  rows (gradients of duplicate ids summed first); the ``momentum1`` state is
  allocated with ``torch.zeros``, so the initial accumulator is 0 and has no
  setting. ``eps=1e-8`` is passed explicitly. On the CPU this per-element
  update is a plain serial loop over the touched rows of each table
  (embedding_backward_split_cpu_template.cpp); only ``EXACT_ROWWISE_ADAGRAD``
  (``torchrec.optim.RowWiseAdagrad``, one accumulator per row) takes
  FBGEMM's vectorized, multi-threaded CPU kernel.
* ``--optimizers rowwise_adagrad``: ``ks.optimizers.RowWiseAdagrad``
  (keras_sparse/optimizers/rowwise_adagrad.py: ``acc += mean(g**2)`` over
  the row's 16 columns, one accumulator per row, ``w -= lr * g / sqrt(acc
  + eps)``) against ``torchrec.optim.RowWiseAdagrad``, which the fused
  module maps to FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (the same accumulator,
  eps outside the root). ``keras-dense`` keeps Keras' Adagrad whatever the
  option. With several ``--optimizers`` each variant runs with each, in
  the same interleaved rounds, and a table gives their ratio.
* ``--optimizers sgd``: ``ks.optimizers.SGD(0.01)`` against
  ``torch.optim.SGD``, FBGEMM's ``EXACT_SGD`` (``w -= lr * g``, both).
* ``--optimizers adam``: ``ks.optimizers.Adam(0.01)`` (Keras' defaults:
  betas 0.9, 0.999, ``eps=1e-7`` outside the root, bias correction in the
  step size; lazy: only touched rows and their moments change). The
  fused module maps ``torch.optim.Adam`` to FBGEMM's ``ADAM``, which its
  CPU mode refuses ("Optimizer OptimType.ADAM is not supported in CPU
  mode"; it runs EXACT_SGD, EXACT_ADAGRAD and the row-wise Adagrads):
  TorchRec runs its Adagrad child instead and Adam's "vs torchrec" is
  over that one (marked "its adagrad").
* ``--optimizers ftrl``: ``ks.optimizers.Ftrl(0.01)`` (Keras' defaults:
  power -0.5, initial accumulator 0.1, no regularization; two slots per
  element, accumulator and linear). FBGEMM has no FTRL: as for Adam,
  Ftrl's "vs torchrec" is over TorchRec's Adagrad.
* ``torch.optim.Adagrad`` (TorchRec's head): ``initial_accumulator_value=0,
  eps=1e-10`` outside the root, ``lr=0.01``.
* Initial values: Keras ``Embedding`` and ks tables draw ``uniform``
  (U(-0.05, 0.05)); TorchRec's tables are set to the same range
  (``weight_init_min/max``; its default is +-sqrt(1/rows)). The heads keep
  each library's default initializers (Keras glorot-uniform, torch
  kaiming-uniform).
* Keras' step includes ``fit``'s input pipeline; TorchRec's loop is a bare
  Python loop over prepared tensors. Keras on JAX/TF compiles the step (XLA
  / tf.function); Keras on torch and TorchRec run eagerly.
* In the ks variants the model's Keras Adagrad updates only the head: on
  JAX the tables and slots reach it marked ``overwrite_with_gradient`` (it
  assigns the updated tables the backward pass returns, with no slot of its
  own), elsewhere they are not trainable. ``keras-dense``'s Keras Adagrad
  updates the tables too (a dense ``[rows, 16]`` gradient and accumulator
  per table, every step).

``--together`` measures the growth of the step with table size within
one process: each child builds the variant at every ``--rows`` size and
alternates them epoch by epoch (``--epochs`` each, A B then B A), so a slow
spell of a noisy machine slows both sizes alike. Separate processes on a
2-core machine can differ by more than the growth itself (one process of
the same variant ran at 55 ms/step, the next at 80). The growth table then
gives each child's own ratio beside the pooled one.

Run it alone on the machine; compare ratios from one run only. torch's
OpenMP pool (TorchRec, Keras on torch) suffers most when other work shares
the cores: on the 2-core machine, with a test suite running beside it, a
batch-512 step took ~1.3 s (TorchRec; nearly all in FBGEMM's CPU backward)
and ~390 ms (ks-torch-layers) with torch's default 2 threads, 8-13 ms and
~80 ms with ``--torch-threads 1``.

    python benchmarks/peers.py --torchrec-python <torchrec-venv>/bin/python
    python benchmarks/peers.py --variants torchrec,ks-jax-layers --rows 1e5
    python benchmarks/peers.py --quick      # CI smoke run: ks variants, tiny
    python benchmarks/peers.py --rows 1e5 --optimizers adagrad,rowwise_adagrad \
        --variants ks-jax-layers,ks-tf-layers,ks-torch-layers
    python benchmarks/peers.py --together --variants torchrec,ks-tf-layers \\
        --torchrec-python <torchrec-venv>/bin/python   # growth 1e5 -> 1e6
    git archive <rev> | tar -x -C <old-checkout>
    python benchmarks/peers.py --variants ks-torch-layers --rows 1e5 \\
        --baseline <old-checkout>   # old and new keras_sparse, same rounds

With ``--baseline DIR`` every ks variant also runs as ``VARIANT@baseline``,
importing keras_sparse from ``DIR`` (everything else, this script and its
children's code included, from this checkout), interleaved with the others
in each round.

Writes a markdown table to stdout and a bar chart to
``<--out>/peers.png`` (default benchmarks/out).

TorchRec on the CPU, a separate venv (Python 3.11, x86_64; seen working
2026-11-25). torchrec declares the CUDA ``fbgemm-gpu`` package, so install
it with ``--no-deps`` next to the CPU build ``fbgemm-gpu-cpu``, whose
release must match torch's (each FBGEMM release is built against one torch
release: 1.4 <-> 2.9 and 1.5 <-> 2.10 in FBGEMM's compatibility table, and
by that cadence 1.8 <-> 2.13, the pair used here; the wheels themselves
declare no torch requirement); ``torch==2.13.0`` here is the
CPU wheel (``2.13.0+cpu``) that pip finds on this machine's disk, where a
bare ``torch`` requirement would pull a multi-GB CUDA build::

    python3 -m venv <torchrec-venv>
    <torchrec-venv>/bin/pip install torch==2.13.0
    <torchrec-venv>/bin/pip install fbgemm-gpu-cpu==1.8.0 numpy
    <torchrec-venv>/bin/pip install --no-deps torchrec==1.8.0
    <torchrec-venv>/bin/pip install tensordict torchmetrics==1.0.3 \\
        tqdm pyre-extensions

(Elsewhere, take torch 2.13.0's CPU build from PyTorch's CPU wheel index.)
pip then warns that "torchrec 1.8.0 requires fbgemm-gpu, which is not
installed"; ``fbgemm-gpu-cpu`` provides the same ``fbgemm_gpu`` module.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "benchmarks" / "out"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
# A ``--baseline`` child: keras_sparse from that checkout, all else from here.
if os.environ.get(BASELINE_ENV := "PEERS_KERAS_SPARSE_ROOT"):
    sys.path.insert(0, os.environ[BASELINE_ENV])

from peers_runners import BAG  # noqa: E402
from peers_runners import DEFAULT_ALLOCATOR  # noqa: E402
from peers_runners import DIM  # noqa: E402
from peers_runners import OPTIMIZERS  # noqa: E402
from peers_runners import PEER_OPTIMIZER  # noqa: E402
from peers_runners import VARIANTS  # noqa: E402
from peers_runners import ZIPF_A  # noqa: E402
from peers_runners import child  # noqa: E402

KS_VARIANTS = [n for n in VARIANTS if n.startswith("ks-")]
#: The label suffix of a ks variant run with ``--baseline``'s keras_sparse.
BASELINE = "@baseline"
HEADERS = (
    "variant", "rows", "median ms/step", "vs torchrec", "CPU ms/step",
    "CPU vs torchrec", "peak RSS MiB",
)  # fmt: skip


def markdown(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|---|" + "---:|" * (len(headers) - 1)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ----------------------------------------------------------- parent process
def make_data(rows, tables, n, seed, path):
    """Zipf ids per table (`keras_sparse.data.zipf_ids`, loaded from its file
    so that the parent imports no backend) and 0/1 labels, to ``path``."""
    import numpy as np

    spec = importlib.util.spec_from_file_location(
        "_ks_synthetic", ROOT / "keras_sparse" / "data" / "synthetic.py"
    )
    synthetic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(synthetic)
    rng = np.random.default_rng(seed)
    ids = np.stack(
        [synthetic.zipf_ids(n * BAG, rows, ZIPF_A, rng).reshape(n, BAG)
         for _ in range(tables)],
        axis=1,
    ).astype(np.int32)  # fmt: skip
    labels = (rng.random((n, 1)) < 0.25).astype(np.float32)
    np.savez(path, ids=ids, labels=labels)


def torchrec_python(args):
    """The interpreter for the torchrec variant, or None (and why)."""
    if not args.torchrec_python:
        return None, "no --torchrec-python given (see this script's docstring)"
    probe = "import torch, fbgemm_gpu, torchrec; print(torch.__version__)"
    try:
        done = subprocess.run(
            [args.torchrec_python, "-c", probe], capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{args.torchrec_python}: {e}"
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"`import torchrec` fails in {args.torchrec_python}: {tail}"
    return args.torchrec_python, None


def label(args, variant, optimizer):
    """A row's name: the variant, and its tables' optimizer where
    ``--optimizers`` names several."""
    return variant if len(args.optimizers) == 1 else f"{variant}/{optimizer}"


def run_list(args, variants):
    """``(label, variant, optimizer)`` of each child to run: every variant
    with every ``--optimizers`` entry, TorchRec's with the optimizer each is
    compared with (`PEER_OPTIMIZER`: Ftrl's is Adagrad), once each."""
    runs = []
    for variant in variants:
        for optimizer in args.optimizers:
            if VARIANTS[variant][0] is None:
                optimizer = PEER_OPTIMIZER[optimizer]
            entry = (label(args, variant, optimizer), variant, optimizer)
            if entry not in runs:
                runs.append(entry)
            if args.baseline and VARIANTS[variant][0] is not None:
                base = label(args, variant + BASELINE, optimizer)
                runs.append((base, variant, optimizer))
    return runs


def run_child(args, variant, optimizer, rows, data, baseline=False):
    """Runs one child for ``variant`` with ``optimizer`` on its tables at
    the table sizes ``rows`` (data files ``data``, one per size), with
    keras_sparse from ``--baseline`` if ``baseline``: its JSON result, or
    None and why."""
    backend = VARIANTS[variant][0]
    python = args.torchrec_python if backend is None else sys.executable
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.pop(BASELINE_ENV, None)
    if baseline:
        env[BASELINE_ENV] = str(args.baseline.resolve())
    if backend:
        env["KERAS_BACKEND"] = backend
    # PyTorch's allocator puts large allocations on 2 MiB pages with it.
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    if variant == "torchrec-thp":
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    cmd = [python, __file__, "--variant", variant,
           "--rows", ",".join(str(r) for r in rows),
           "--data", ",".join(str(d) for d in data), "--batch", str(args.batch),
           "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--epochs", str(args.epochs), "--optimizers", optimizer]  # fmt: skip
    if args.torch_threads and backend in (None, "torch"):
        env["OMP_NUM_THREADS"] = str(args.torch_threads)
        cmd += ["--torch-threads", str(args.torch_threads)]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=env, cwd=ROOT,
            timeout=args.timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, f"no result within --timeout {args.timeout:.0f} s"
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line), None
            except json.JSONDecodeError:
                break
    tail = (done.stderr + done.stdout).strip()[-3000:]
    return None, f"exited with rc {done.returncode}:\n{tail}"


def plot(summary, variants, rows_list, title, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.5 + 0.7 * len(variants) * len(rows_list), 4.5))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        heights = [summary.get((variant, r), {}).get("median", 0) for r in rows_list]
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(rows_list))]
        bars = ax.bar(xs, heights, width, label=variant)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(rows_list)), [f"{r:.0e} rows" for r in rows_list])
    lowest = min(s["median"] for s in summary.values())
    ax.set(
        yscale="log", ylabel="median ms / training step (log)", ylim=(lowest / 3, None)
    )
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def parent(args):
    variants = list(args.variants)
    skipped = {}
    torchrec_variants = [v for v in variants if VARIANTS[v][0] is None]
    if torchrec_variants:
        args.torchrec_python, why = torchrec_python(args)
        for variant in torchrec_variants if why else []:
            variants.remove(variant)
            skipped[variant] = why
            print(f"{variant}: skipped: {why}")
    print(
        f"cores={os.cpu_count()} python={platform.python_version()} "
        f"tables={args.tables} dim={DIM} bag={BAG} zipf={ZIPF_A} "
        f"batch={args.batch} warm-up={args.warmup} steps={args.steps} "
        f"rounds={args.rounds} rows={','.join(f'{r:.0e}' for r in args.rows)} "
        f"optimizers={','.join(args.optimizers)} "
        f"torch-threads={args.torch_threads or 'default'} "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    if not variants:
        print("nothing to run")
        return 1
    t0 = time.perf_counter()
    runs = run_list(args, variants)
    labels = [name for name, _, _ in runs]
    results = {(n, r): [] for n in labels for r in args.rows}
    growths = {n: [] for n in labels}  # --together: one ratio per child
    errors, versions = {}, {}
    epochs = args.epochs if args.together else 1
    n = (args.warmup + args.steps + epochs) * args.batch  # per epoch: steps+1 ends
    groups = [args.rows] if args.together else [[r] for r in args.rows]
    with tempfile.TemporaryDirectory() as tmp:
        data = {}
        for i, rows in enumerate(args.rows):
            data[rows] = pathlib.Path(tmp) / f"rows{rows}.npz"
            make_data(rows, args.tables, n, i, data[rows])
        for k in range(args.rounds):
            for group in groups:
                for variant, real_variant, optimizer in runs:
                    if (variant, group[0]) in errors:
                        continue
                    sizes = "+".join(f"{r:.0e}" for r in group)
                    out, error = run_child(
                        args, real_variant, optimizer, group,
                        [data[r] for r in group], BASELINE in variant,
                    )  # fmt: skip
                    if error:
                        errors.update({(variant, r): error for r in group})
                        print(f"  round {k + 1} {variant} rows={sizes}: {error}")
                        continue
                    versions[variant] = out["versions"]
                    per_size = [out["sizes"][str(r)] for r in group]
                    for rows, size in zip(group, per_size):
                        results[variant, rows].append(
                            dict(size, peak_rss_mib=out["peak_rss_mib"])
                        )
                    if len(group) > 1:
                        growths[variant].append(
                            per_size[-1]["median_ms"] / per_size[0]["median_ms"]
                        )
                    print(
                        f"  round {k + 1} {variant} rows={sizes}: median "
                        + ", ".join(f"{s['median_ms']:.1f}" for s in per_size)
                        + " ms/step (CPU "
                        + ", ".join(f"{s['median_cpu_ms']:.1f}" for s in per_size)
                        + f"), peak RSS {out['peak_rss_mib']:.0f} MiB, "
                        "warm-up " + ", ".join(f"{s['warm_s']:.1f}" for s in per_size)
                        + " s",
                        flush=True,
                    )  # fmt: skip
    summary = {}
    for key, outs in results.items():
        if outs and key not in errors:
            summary[key] = dict(
                median=statistics.median(ms for o in outs for ms in o["ms"]),
                cpu=statistics.median(ms for o in outs for ms in o["cpu_ms"]),
                rounds=[o["median_ms"] for o in outs],
                rss=max(o["peak_rss_mib"] for o in outs),
            )
    table = []
    for rows in args.rows:
        for variant, real_variant, optimizer in [*runs, *run_list(args, skipped)]:
            peer = PEER_OPTIMIZER[optimizer]
            base = summary.get((label(args, "torchrec", peer), rows))
            s = summary.get((variant, rows))
            if s is None:
                why = "skipped" if real_variant in skipped else "failed"
                table.append((variant, f"{rows:.0e}", why, "-", "-", "-", "-"))
                continue
            ratio = f"{s['median'] / base['median']:.2f}x" if base else "-"
            cpu_ratio = f"{s['cpu'] / base['cpu']:.2f}x" if base else "-"
            if base and peer != optimizer:
                ratio += f" (its {peer})"
                cpu_ratio += f" (its {peer})"
            table.append(
                (variant, f"{rows:.0e}", f"{s['median']:.1f}", ratio,
                 f"{s['cpu']:.1f}", cpu_ratio, f"{s['rss']:.0f}")
            )  # fmt: skip
    print()
    print(markdown(HEADERS, table))
    print(
        "\n(vs torchrec: this variant's ms/step / torchrec's; > 1 is slower. "
        "CPU: the process's CPU time per step, time.process_time)"
    )
    if args.together:
        print("(peak RSS: of the process that held both sizes)")
    if len(args.optimizers) > 1:
        print()
        print(optimizer_table(args, variants, summary))
    if len(args.rows) > 1:
        print()
        print(growth_table(args, labels, summary, growths))
    print("\nmedian ms/step per round: " + "; ".join(
        f"{v} {r:.0e}: " + ", ".join(f"{m:.1f}" for m in s["rounds"])
        for (v, r), s in summary.items()
    ))  # fmt: skip
    print("versions: " + "; ".join(
        f"{v}: " + ", ".join(f"{k} {x}" for k, x in d.items())
        for v, d in versions.items()
    ))  # fmt: skip
    if summary:
        path = args.out / "peers.png"
        title = (
            f"training step: {args.tables} tables x {DIM}, bag {BAG}, "
            f"sum, {'/'.join(args.optimizers)}, batch {args.batch}"
        )
        plot(summary, labels, args.rows, title, path)
        print(f"\nplot: {path}")
    print(f"wall {time.perf_counter() - t0:.0f} s")
    if errors:
        print("\nFAILED: " + ", ".join(f"{v} rows={r:.0e}" for v, r in errors))
        return 1
    return 0


def optimizer_table(args, variants, summary):
    """Markdown: each variant's ms/step with each further ``--optimizers``
    entry over its ms/step with the first, at each size."""
    first, others = args.optimizers[0], args.optimizers[1:]
    headers = ["variant", "rows", *(f"{o} / {first}" for o in others)]
    table = []
    for rows in args.rows:
        for variant in variants:
            base = summary.get((label(args, variant, first), rows))
            ratios = []
            for o in others:
                s = summary.get((label(args, variant, o), rows))
                ok = base is not None and s is not None
                ratios.append(f"{s['median'] / base['median']:.2f}x" if ok else "-")
            table.append([variant, f"{rows:.0e}", *ratios])
    return markdown(headers, table) + "\n(ms/step ratio within this run; < 1 is faster)"


def growth_table(args, variants, summary, growths):
    """Markdown: each variant's ms/step at the largest size over the
    smallest; with ``--together`` also the ratio of each child process."""
    small, large = args.rows[0], args.rows[-1]
    headers = ["variant", f"growth {large:.0e} / {small:.0e} (pooled medians)"]
    if args.together:
        headers.append("per process")
    table = []
    for variant in variants:
        a, b = summary.get((variant, small)), summary.get((variant, large))
        if a is None or b is None:
            continue
        row = [variant, f"{b['median'] / a['median']:.2f}x"]
        if args.together:
            row.append(", ".join(f"{g:.2f}" for g in growths[variant]))
        table.append(row)
    where = (
        "each child process trained both sizes; peak RSS is that process's"
        if args.together
        else "each size in its own processes"
    )
    return markdown(headers, table) + f"\n({where})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--variants",
        help="comma-separated, from: "
        + ", ".join(VARIANTS)
        + " (default: all but the -glibc ones and torchrec-thp)",
    )
    parser.add_argument("--rows", help="comma-separated table sizes (default 1e5,1e6)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 20)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 3)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3)")
    parser.add_argument("--batch", type=int, help="samples per step (default 4096)")
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument(
        "--together", action="store_true",
        help="each child trains every --rows size, alternating epochs, so the "
        "growth with table size is measured within one process",
    )  # fmt: skip
    parser.add_argument(
        "--epochs", type=int, default=4,
        help="with --together: alternating epochs per size (default 4)",
    )  # fmt: skip
    parser.add_argument(
        "--optimizers", default="adagrad",
        help="comma-separated tables' optimizers, from: " + ", ".join(OPTIMIZERS)
        + " (default adagrad); with several, each variant runs with each, "
        "interleaved, and a table gives their ratios",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, help="s per child (default 1800)")
    parser.add_argument("--torchrec-python", help="Python of a venv with torchrec")
    parser.add_argument(
        "--torch-threads", type=int,
        help="torch intra-op threads for torchrec and ks-torch-* (default: "
        "torch's, one per core)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", type=pathlib.Path,
        help="another checkout of this repository (e.g. `git archive REV | "
        "tar -x -C DIR`): each ks variant also runs with its keras_sparse, "
        f"labelled VARIANT{BASELINE}, in the same interleaved rounds",
    )  # fmt: skip
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR,
                        help="folder for peers.png")  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true",
        help="CI smoke run: rows 1e4, batch 512, 3 steps, 1 round, ks variants",
    )  # fmt: skip
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = dict(rows="1e4", batch=512, steps=3, warmup=1, rounds=1, timeout=300)
    full = dict(rows="1e5,1e6", batch=4096, steps=20, warmup=3, rounds=3,
                timeout=1800)  # fmt: skip
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.rows = [int(float(r)) for r in str(args.rows).split(",")]
    args.optimizers = args.optimizers.split(",")
    if set(args.optimizers) - set(OPTIMIZERS) or len(set(args.optimizers)) < len(
        args.optimizers
    ):
        parser.error(
            f"--optimizers: {args.optimizers}; choose distinct ones from "
            f"{', '.join(OPTIMIZERS)}"
        )
    if args.variant:
        args.optimizer = args.optimizers[0]
        args.data = args.data.split(",")
        child(args)
        return 0
    # The page-size variants on request only.
    on_request = {*DEFAULT_ALLOCATOR, "torchrec-thp"}
    default = [
        v for v in (KS_VARIANTS if args.quick else VARIANTS) if v not in on_request
    ]
    args.variants = args.variants.split(",") if args.variants else default
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(
            f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}"
        )
    if min(args.steps, args.warmup, args.rounds, args.batch, args.epochs) < 1:
        parser.error("--steps, --warmup, --rounds, --batch, --epochs must be >= 1")
    if args.together and (
        len(args.rows) < 2 or args.steps < 2 * args.epochs or args.steps % args.epochs
    ):
        parser.error(
            "--together needs two --rows sizes and --steps a multiple of "
            "--epochs, at least 2 x --epochs"
        )
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
