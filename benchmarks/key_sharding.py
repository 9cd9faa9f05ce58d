"""Key-sharded vs gathered hash mapping: collective bytes and samples/s.

A `DistributedHashEmbedding` under `keras_sparse.sharding.distribution` on 8
(virtual CPU) devices maps keys to rows in one of two ways:

* ``sharding="key"``: a hash table shard per device
  (`keras_sparse.table.ShardedHashTable`); inside the step every device
  routes its own keys to their owners (all-to-alls of 64-bit keys as two
  int32 words + counts), the owners map them with one host callback each,
  and the rows come back by all-to-all into the row-sharded lookup
  (`keras_sparse.sharding.jax_key_mapping`).
* ``sharding="row"``: one host table; the batch's keys are gathered to one
  device by an ordered ``io_callback`` (`keras_sparse.layers.
  jax_step_mapping`), whose rows / fresh flags are then broadcast back, and
  the row-sharded lookup follows.
* ``sharding="data"``: the same gathered mapping, table replicated.

The model: ``--fields`` hash fields (``DistributedHashEmbedding(16,
capacity=2**16, combiner="sum", optimizer="adagrad")`` each, a bag of
``--bag`` int64 keys per sample, Zipf(1.2) ranks over 1e6 ids scrambled to
keys beyond 32 bits) -> Concatenate -> Dense(64, relu) -> Dense(1), MSE, keras
Adam for the dense part. Each variant is built under its own distribution
(``sharding.distribution(layers, devices=8)`` with the layers' sharding
pinned; ``--slack`` sets ``row_exchange_slack``), with the same seed.

Reported per variant:

- collective B/step: bytes each device hands to collectives per training
  step, read from the compiled step's HLO (``jax.jit(model.train_step)`` with
  Keras' own shardings, lowered on one batch and compiled) by
  `jax_exchange_bytes.hlo_collective_bytes`; this includes the dense part's
  gradient all-reduce and, for the gathered mapping, the gather of the keys
  and the broadcast of the callback's results (XLA replicates them: an
  all-gather of the keys, an all-reduce of rows + fresh flags). Collectives
  inside ``lax.cond`` branches run only when their branch is taken (the
  fresh-row draws of `keras_sparse.layers.hash.fresh_rows` have one branch per
  draw size), so the step's bytes are given as the smallest and the largest
  taken branch (equal when there is no such branch); "static" sums every
  collective of the HLO text;
- to / from host callback B/step: the operands (keys as int32 words + use
  masks, counts, statuses) and results (rows, fresh flags) of the step's
  side-effecting host callbacks on the busiest device, from the same HLO.
  The gathered mapping runs its ``io_callback`` on one device with the global
  batch (4 B per key + 1 B mask); key sharding runs its callbacks on every
  device with that device's shard (route: local keys; owner: the keys
  received, as two words each plus a count per slot);
- samples/s: ``model.train_on_batch`` over ``--steps`` batches per round,
  variants interleaved round-robin for ``--rounds`` rounds after a warm-up
  (compiles, fills the tables), median per variant; the loss is read after
  every call (a host sync); and the process CPU time per step, median
  over the rounds (less disturbed by other processes on a shared machine);
- keys held (all fields) and the last round's last loss, as sanity checks
  (key sharding draws fresh rows per key, so losses differ slightly).

On CPU the 8 "devices" share the machine's cores: samples/s measures compute,
callbacks and overheads, not a network; the byte columns are the portable
part. Compare ratios from one run only, with nothing else running.

A variant whose step hands a host callback an operand of 100 KiB or more is
compiled and its bytes reported, but it is not run on CPU: JAX's
``io_callback`` first puts each operand on CPU device 0, the CPU client makes
copies of that size asynchronously on the thread pool that runs the 8
virtual devices, and with all of them blocked (in callbacks or at the next
collective) the step deadlocks until XLA aborts the process (a pure-JAX
``io_callback`` inside ``shard_map`` runs at 98,304 bytes per operand and
hangs at 102,400). The gathered mapping hits this from ``batch * bag >=
25600`` (its one callback gets the global int32 keys). Key sharding's
callbacks read XLA's buffers in place on CPU devices and its exchange
buffers are sized to the expected keys per owner, so its largest operand
stays near ``12 * batch * bag / devices`` bytes.

A ``--slack`` too small for the skewed keys (2 at batch 4096) overflows the
row-sharded lookup's exchange buffers of "row" / "data": the step raises
``ExchangeOverflowError`` (reported in the table), or, on virtual CPU
devices, XLA may abort the whole process at a collective's 40 s timeout.
Under key sharding the slack sizes the key exchange only (distinct keys,
spread by hash); its row lookup reuses that exchange's packing (each
device's distinct keys' rows once, in the key exchange's slots per
destination). ``key-positions`` is the same layer with
``exchange_buckets.DEDUP_EXCHANGE`` off while its step is traced: the
earlier row lookup with full-size buffers (a slot per position).

    python benchmarks/key_sharding.py [--batch 2048] [--steps 4] [--rounds 5]
        [--fields 4] [--bag 4] [--slack S] [--png out.png]
    python benchmarks/key_sharding.py --batch 4096 --slack 4
"""

import argparse
import os
import pathlib
import re
import statistics
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_sparse as ks  # noqa: E402
from keras_sparse import sharding  # noqa: E402
from keras_sparse.data import zipf_ids  # noqa: E402
from keras_sparse.sharding import exchange_buckets as buckets  # noqa: E402
from keras_sparse.sharding import jax_exchange_bytes as jsl  # noqa: E402

D, DIM, CAPACITY, VOCAB, ZIPF = 8, 16, 1 << 16, 1_000_000, 1.2
VARIANTS = ("key", "key-positions", "row", "data")
# JAX's io_callback puts each operand on CPU device 0 before calling Python;
# the CPU client copies arrays of this size or more asynchronously, on the
# thread pool that also runs the 8 virtual devices' step. With every device
# blocked (in a callback reading its operand, or at the next collective
# waiting for the others) the copy never runs and XLA aborts the process
# after its 40 s rendezvous timeout. Such variants are reported, not run.
CPU_ASYNC_BYTES = 100 * 1024


def markdown(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def fmt(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


# ------------------------------------------------------------ HLO reading
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRUE_FALSE = re.compile(r"true_computation=%([\w.\-]+), false_computation=%([\w.\-]+)")
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8}  # fmt: skip
_CALLBACK = re.compile(
    r"=\s*(?P<out>\(.*?\)|\S+)\s+custom-call\(.*custom_call_target=\"[^\"]*"
    r"callback\""
)
_OPERANDS = "operand_layout_constraints={"


def _array_bytes(text):
    """Bytes of each array shape in ``text``."""
    out = []
    for dtype, dims in _SHAPE.findall(text):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        out.append(count * _DTYPE_BYTES.get(dtype, 0))
    return out


def _computations(hlo_text):
    """``{name: body text}`` of the HLO module's computations."""
    out, name, body = {}, None, []
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m and name is None:
            name, body = m.group("name"), []
        elif line.strip() == "}" and name is not None:
            out[name] = "\n".join(body)
            name = None
        elif name is not None:
            body.append(line)
    return out


def collective_bytes(hlo_text):
    """``(low, high, static)`` per-device collective bytes of one step.

    ``static`` counts every collective in the text; ``low`` / ``high``
    count each conditional's collectives once, for its cheapest / dearest
    branch (only one branch runs). Each is ``{op: bytes, "total": ...}``.
    """
    static = jsl.hlo_collective_bytes(hlo_text, D)
    comps = _computations(hlo_text)
    low, high = dict(static), dict(static)
    seen = set()
    for line in hlo_text.splitlines():
        if " conditional(" not in line:
            continue
        m = _BRANCHES.search(line)
        names = (
            [n.strip().lstrip("%") for n in m.group("names").split(",")]
            if m
            else list(_TRUE_FALSE.search(line).groups())
        )
        if seen.intersection(names):
            continue
        seen.update(names)
        per = [jsl.hlo_collective_bytes(comps.get(n, ""), D) for n in names]
        cheap = min(per, key=lambda b: b["total"])
        dear = max(per, key=lambda b: b["total"])
        for b in per:
            for op, v in b.items():
                low[op] -= v
                high[op] -= v
        for op, v in cheap.items():
            low[op] += v
        for op, v in dear.items():
            high[op] += v
    return low, high, static


def callback_bytes(hlo_text):
    """``(to host, from host, largest operand)``: bytes of the side-effecting
    host callbacks' operands and results in the per-device program (tokens
    count 0), and the largest single operand array."""
    to_host = from_host = largest = 0
    for line in hlo_text.splitlines():
        if "custom_call_has_side_effect=true" not in line:
            continue
        m = _CALLBACK.search(line)
        if m and _OPERANDS in line:
            start = line.index(_OPERANDS) + len(_OPERANDS)
            depth, end = 1, start
            while depth:  # the closing brace (layouts nest braces)
                depth += {"{": 1, "}": -1}.get(line[end], 0)
                end += 1
            ins = _array_bytes(line[start : end - 1])
            to_host += sum(ins)
            largest = max([largest, *ins])
            from_host += sum(_array_bytes(m.group("out")))
    return to_host, from_host, largest


# ------------------------------------------------------------ the model
def make_data(batch, steps, fields, bag, seed=0):
    """``steps`` batches of int64 keys per field (beyond 32 bits) and labels."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        x = {
            f"k{i}": (zipf_ids(batch * bag, VOCAB, ZIPF, rng) + 1).reshape(batch, bag)
            * 7_919_993_123
            + i
            for i in range(fields)
        }
        batches.append((x, rng.normal(size=(batch, 1)).astype("float32")))
    return batches


def build(strategy, fields, bag, slack):
    keras.utils.set_random_seed(0)
    layers = [
        ks.DistributedHashEmbedding(
            DIM, capacity=CAPACITY, combiner="sum", optimizer="adagrad",
            sharding=strategy, name=f"f{i}",
        )
        for i in range(fields)
    ]  # fmt: skip
    dist = sharding.distribution(layers, devices=D, row_exchange_slack=slack)
    strategies = {t.strategy for t in dist.keras_sparse_plan}
    if strategies != {strategy}:
        raise RuntimeError(f"planned {strategies}, asked for {strategy!r}")
    keras.distribution.set_distribution(dist)
    try:
        inputs = [
            keras.Input((bag,), dtype="int64", name=f"k{i}") for i in range(fields)
        ]
        h = keras.layers.Concatenate()([lay(x) for lay, x in zip(layers, inputs)])
        h = keras.layers.Dense(64, activation="relu")(h)
        model = keras.Model(inputs, keras.layers.Dense(1)(h))
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    finally:
        keras.distribution.set_distribution(None)
    return model, layers, dist


def compiled_hlo(model, dist, x, y):
    """HLO text of the compiled training step (Keras' jit and shardings)."""
    import jax

    model._symbolic_build(data_batch=(x, y, None))  # as train_on_batch does
    model.make_train_function()
    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables,
        model.metrics_variables,
    )
    state = tuple([v.value for v in group] for group in groups)

    def put(a):
        return jax.device_put(a, dist.get_data_layout(a.shape).backend_layout)

    xs = {k: put(v.astype("int32")) for k, v in x.items()}  # what the step sees
    step = jax.jit(
        model.train_step,
        donate_argnums=0,
        out_shardings=(None, model._get_state_sharding_spec()),
    )
    return step.lower(state, (xs, put(y))).compile().as_text()


def _flush_errors():
    """Drops a failed step's ordered-effect token: JAX feeds it to the next
    computation with ordered callbacks (another variant's), which would fail
    with the same error."""
    import jax
    from jax._src import dispatch

    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001  (the failed step's error, reported)
        dispatch.runtime_tokens.clear()


def run(args):
    import jax

    batches = make_data(args.batch, args.steps, args.fields, args.bag)
    variants = {}
    for s in VARIANTS:
        strategy = s.split("-")[0]
        model, layers, dist = build(strategy, args.fields, args.bag, args.slack)
        keras.distribution.set_distribution(dist)
        # Read when the step is traced (the HLO and the warm-up's compile).
        buckets.DEDUP_EXCHANGE = s != "key-positions"
        v = dict(model=model, layers=layers, dist=dist, sps=[], cpu=[], skip=None)
        variants[s] = v
        try:
            v["hlo"] = compiled_hlo(model, dist, *batches[0])
            largest = callback_bytes(v["hlo"])[2]
            if jax.default_backend() == "cpu" and largest >= CPU_ASYNC_BYTES:
                v["skip"] = (
                    f"not run: a host-callback operand of {fmt(largest)} "
                    f"(>= {fmt(CPU_ASYNC_BYTES)}) deadlocks the step on "
                    f"{D} virtual CPU devices"
                )
                continue
            t0 = time.perf_counter()
            try:
                for x, y in batches[:2]:  # compiles, fills the tables
                    float(model.train_on_batch(x, y))  # a step's errors show here
            except Exception as e:  # report it in the table
                why = [line for line in str(e).splitlines() if line.strip()]
                v["skip"] = f"failed: {type(e).__name__}: {why[-1][:240]}"
                _flush_errors()
                continue
            warm = time.perf_counter() - t0
            print(f"  warmed up {s}: {warm:.1f} s", file=sys.stderr, flush=True)
        finally:
            keras.distribution.set_distribution(None)
            buckets.DEDUP_EXCHANGE = True
    n = args.batch * args.steps
    live = [v for v in variants.values() if v["skip"] is None]
    for _ in range(args.rounds):
        for v in live:
            keras.distribution.set_distribution(v["dist"])
            try:
                t0, c0 = time.perf_counter(), time.process_time()
                for x, y in batches:
                    v["loss"] = float(v["model"].train_on_batch(x, y))
                v["sps"].append(n / (time.perf_counter() - t0))
                v["cpu"].append((time.process_time() - c0) / len(batches))
            finally:
                keras.distribution.set_distribution(None)
    rows = []
    for s, v in variants.items():
        low, high, static = collective_bytes(v["hlo"])
        to_host, from_host, largest = callback_bytes(v["hlo"])
        rows.append(
            dict(
                strategy=s, low=low, high=high, static=static, to_host=to_host,
                from_host=from_host, largest=largest, skip=v["skip"],
                sps=statistics.median(v["sps"]) if v["sps"] else None,
                cpu=statistics.median(v["cpu"]) if v["cpu"] else None,
                all_sps=v["sps"], loss=v.get("loss"),
                keys=sum(int(lay.table.size) for lay in v["layers"]),
            )
        )  # fmt: skip
    return rows


def plot(rows, path):
    try:
        import matplotlib
    except ImportError:
        print(f"\n(matplotlib not installed: no {path})")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f'sharding="{r["strategy"]}"' for r in rows]
    colors = [f"C{i}" for i in range(len(rows))]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    kib = [r["high"]["total"] / 1024 for r in rows]
    bars = ax1.bar(names, kib, color=colors)
    ax1.bar_label(bars, labels=[f"{v:,.0f}" for v in kib], fontsize=8)
    ax1.set_ylabel("KiB per device per step (HLO, dearest branch)")
    ax1.set_title("collective bytes")
    sps = [r["sps"] or 0 for r in rows]
    bars = ax2.bar(names, sps, color=colors)
    ax2.bar_label(bars, labels=[f"{v:,.0f}" for v in sps], fontsize=8)
    ax2.set_ylabel("train_on_batch samples/s (median)")
    ax2.set_title(f"throughput, {D} CPU devices")
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nwrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4, help="batches per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fields", type=int, default=4)
    parser.add_argument("--bag", type=int, default=4, help="keys per sample")
    parser.add_argument("--slack", type=float, default=None,
                        help="row_exchange_slack (default: full buffers)")  # fmt: skip
    parser.add_argument("--png", default=None, help="bar plot path (matplotlib)")
    args = parser.parse_args()
    if args.batch % D:
        parser.error(f"--batch must be a multiple of {D}")
    keys = args.batch * args.bag * args.fields
    print(
        f"devices={D} (virtual CPU) cores={os.cpu_count()} batch={args.batch} "
        f"fields={args.fields} bag={args.bag} ({keys:,} keys/step, "
        f"{keys // D:,}/device) dim={DIM} capacity={CAPACITY:,}/field "
        f"Zipf({ZIPF}) over {VOCAB:,} ids, slack={args.slack} "
        f"steps={args.steps} rounds={args.rounds}\n"
    )
    t0 = time.perf_counter()
    rows = run(args)

    def speed(r):
        return r["skip"] if r["skip"] else f"{r['sps']:,.0f}"

    print(
        markdown(
            [
                "sharding",
                "collective B/step/device (min-max branch)",
                "static HLO sum",
                "to host callback B/step",
                "from host callback B/step",
                "largest callback operand",
                "samples/s (median)",
                "process CPU ms/step (median)",
                "keys held",
                "last loss",
            ],
            [
                (
                    f'"{r["strategy"]}"',
                    fmt(r["low"]["total"])
                    + (
                        ""
                        if r["low"]["total"] == r["high"]["total"]
                        else " - " + fmt(r["high"]["total"])
                    ),
                    fmt(r["static"]["total"]),
                    fmt(r["to_host"]),
                    fmt(r["from_host"]),
                    fmt(r["largest"]),
                    speed(r),
                    "-" if r["cpu"] is None else f"{1e3 * r['cpu']:.0f}",
                    f"{r['keys']:,}",
                    "-" if r["loss"] is None else f"{r['loss']:.4f}",
                )
                for r in rows
            ],
        )
    )
    ops = sorted({op for r in rows for op in r["high"] if op != "total"})
    print("\nper collective (dearest branch), B/step/device:\n")
    print(
        markdown(
            ["sharding", *ops],
            [
                (f'"{r["strategy"]}"', *(fmt(r["high"].get(op, 0)) for op in ops))
                for r in rows
            ],
        )
    )
    by = {r["strategy"]: r for r in rows}

    def ratio(a, b):
        return "-" if a is None or b is None else f"{a / b:.2f}x"

    print("\nratios (key / other):\n")
    print(
        markdown(
            [
                "vs",
                "collective bytes (min branch)",
                "collective bytes (max branch)",
                "to host callback bytes",
                "samples/s",
            ],
            [
                (
                    f'key vs "{o}"',
                    ratio(by["key"]["low"]["total"], by[o]["low"]["total"]),
                    ratio(by["key"]["high"]["total"], by[o]["high"]["total"]),
                    ratio(by["key"]["to_host"], by[o]["to_host"]),
                    ratio(by["key"]["sps"], by[o]["sps"]),
                )
                for o in ("key-positions", "row", "data")
            ],
        )
    )
    print(
        "\nsamples/s per round: "
        + "; ".join(
            f"{r['strategy']}: " + (", ".join(f"{v:,.0f}" for v in r["all_sps"]) or "-")
            for r in rows
        )
    )
    print(f"\nwall {time.perf_counter() - t0:.0f} s (after imports)")
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
