"""Compiled inference of hash layers: serving map vs host callback, samples/s.

Measures ``model.predict`` throughput (samples/s) of a small recommender:
``--fields`` inputs of ``--bag`` int64 keys per sample, each into
``DistributedHashEmbedding(16, capacity=C, combiner="sum",
optimizer="adagrad", key_dtype=...)`` -> Concatenate -> Dense(64, relu) ->
Dense(1). Each table is filled by ``layer.import_`` of ``--fill * C`` random
keys (fixed seeds); ``--known`` of the queried keys are among them (uniform),
the rest are unknown (zero vectors). All keys fit in int32, so every variant
predicts the same keys with the same model. Variants:

* ``jax-callback``: JAX, ``key_dtype="int64"``: each step reaches the host
  table through a callback (`keras_sparse.layers.hash.jax_step_mapping`).
* ``jax-serving-map``: JAX, ``key_dtype="int32"``: a bucketed search of the
  layer's serving map inside the step (`keras_sparse.layers.hash.serving_map`).
* ``tf-callback``: TensorFlow with ``serving_map.usable`` monkeypatched to
  return False before the model is built: this reproduces the old
  ``tf.numpy_function`` route, for comparison only.
* ``tf-serving-map``: TensorFlow, default (the serving map in graphs).

Each variant is its own process (this script with ``--variant``): it builds
the model, fills the tables and runs a warm-up ``predict`` (compiles,
refreshes the serving maps; its predictions go to a .npy file), then times
one ``predict`` of ``--batches`` batches whenever the parent asks. The
parent interleaves the rounds (one process timing at a time) and prints the
median per variant and its ratio to its backend's callback variant. It exits
1 unless both routes of a backend predict the same (max abs diff <= 1e-6)
and each variant took the key-mapping placement it names; a variant giving no
result within ``--timeout`` s is killed and reported as failed.

    python benchmarks/serving.py                  # fields 8, batch 4096
    python benchmarks/serving.py --quick          # CI smoke run
    python benchmarks/serving.py --only tf-serving-map --rounds 3

Run it alone on the machine and compare ratios from one run only.
"""

import argparse
import itertools
import json
import os
import pathlib
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIM = 16
VARIANTS = {  # name: (backend, key_dtype, placement expected in predict)
    "jax-callback": ("jax", "int64", "jax_step"),
    "jax-serving-map": ("jax", "int32", "serving_map"),
    "tf-callback": ("tensorflow", "int64", "tf_graph"),
    "tf-serving-map": ("tensorflow", "int64", "serving_map"),
}
BASE = {"jax": "jax-callback", "tensorflow": "tf-callback"}
TOLERANCE = 1e-6
HEADERS = (
    "variant|placement in predict|samples/s (median)|vs callback (same backend)"
    "|ms/batch|max abs diff vs callback|warm-up predict s"
)


def markdown(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ------------------------------------------------------------ child process
def make_keys(args, field):
    """``(known keys, queries [batches * batch, bag])`` of one field."""
    import numpy as np

    rng = np.random.default_rng(1000 + field)
    known_n = int(args.fill * args.capacity)
    pool = np.unique(rng.integers(-(2**31), 2**31, 2 * known_n, dtype=np.int64))
    known, unknown = np.split(rng.permutation(pool), [known_n])
    shape = (args.batches * args.batch, args.bag)
    hit = rng.random(shape) < args.known
    return known, np.where(hit, rng.choice(known, shape), rng.choice(unknown, shape))


def child(args):
    backend, key_dtype, _ = VARIANTS[args.variant]
    sys.path.insert(0, str(ROOT))
    import keras
    import numpy as np

    import keras_sparse as ks
    from keras_sparse.layers.hash import key_mapping
    from keras_sparse.layers.hash import serving_map

    assert keras.backend.backend() == backend, keras.backend.backend()
    if args.variant == "tf-callback":
        # Reproduces the old route for comparison: no serving map in graphs.
        serving_map.usable = lambda layer, keys: False
    seen = set()
    placement_of = key_mapping.placement_of

    def recording(*args, **kwargs):
        seen.add(where := placement_of(*args, **kwargs))
        return where

    key_mapping.placement_of = recording

    keras.utils.set_random_seed(0)
    inputs, parts, x = [], [], {}
    for f in range(args.fields):
        layer = ks.DistributedHashEmbedding(
            DIM, capacity=args.capacity, combiner="sum", optimizer="adagrad",
            key_dtype=key_dtype, name=f"f{f}",
        )  # fmt: skip
        inputs.append(keras.Input((args.bag,), dtype="int64", name=f"k{f}"))
        parts.append(layer(inputs[-1]))
        known, x[f"k{f}"] = make_keys(args, f)
        values = np.random.default_rng(f).normal(0, 0.1, (len(known), DIM))
        stored = layer.import_(known, values.astype("float32"))
        # A few keys may find both candidate buckets full at high fill;
        # both routes then read them as unknown alike.
        assert stored >= 0.999 * len(known), (stored, len(known))
    h = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()(parts))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))

    seen.clear()
    for line in itertools.chain(["warm-up"], sys.stdin):  # the parent asks
        if line.strip() not in ("warm-up", "round"):
            break
        t0 = time.perf_counter()
        out = model.predict(x, batch_size=args.batch, verbose=0)
        s = time.perf_counter() - t0
        if line == "warm-up":  # compiled, refreshed the serving maps
            np.save(args.out, out)
            result = dict(warm_s=s, routes=sorted(seen))
        else:
            result = dict(sps=args.batch * args.batches / s)
        print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------- parent process
class Variant:
    """A child process; its RESULT lines arrive through a reader thread."""

    def __init__(self, name, argv, tmp, timeout):
        self.name, self.timeout, self.sps, self.error = name, timeout, [], None
        self.npy, log = (pathlib.Path(tmp) / f"{name}.{e}" for e in ("npy", "log"))
        self.log = open(log, "w+")
        env = dict(os.environ, KERAS_BACKEND=VARIANTS[name][0],
                   TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *argv, "--variant", name, "--out", self.npy],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                self.lines.put(json.loads(line[len("RESULT ") :]))
        self.lines.put(None)  # the process ended

    def result(self, ask=None):
        """The next result (None on an error), after sending ``ask``."""
        if self.error:
            return None
        if ask:
            self.proc.stdin.write(ask + "\n")
            self.proc.stdin.flush()
        try:
            out = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            self.error = f"no result within --timeout {self.timeout:.0f} s"
            self.proc.kill()
            return None
        if out is None:
            self.error = f"exited with rc {self.proc.wait()}"
            self.log.seek(0)
            print(f"{self.name} {self.error}:\n{self.log.read()[-3000:]}")
        return out

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def parent(args, argv):
    import numpy as np

    bases = {BASE[VARIANTS[n][0]] for n in args.only}
    names = [n for n in VARIANTS if n in args.only or n in bases]
    print(
        f"cores={os.cpu_count()} fields={args.fields} bag={args.bag} "
        f"capacity={args.capacity:,}/field filled {args.fill:.0%}, "
        f"{args.known:.0%} of queried keys known, dim={DIM} batch={args.batch} "
        f"batches/round={args.batches} rounds={args.rounds} "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}\n"
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # Started together: building, filling and compiling are untimed.
        runs = {n: Variant(n, argv, tmp, args.timeout) for n in names}
        try:
            for v in runs.values():
                v.ready = v.result() or {}
                print(f"  {v.name}: {v.error or 'ready'} after "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
            for _ in range(args.rounds):
                for v in runs.values():  # one process timing at a time
                    v.sps += [r["sps"]] if (r := v.result("round")) else []
            preds = {n: np.load(v.npy) for n, v in runs.items() if v.npy.exists()}
        finally:
            for v in runs.values():
                v.close()
    failures, rows = [], []
    for name, v in runs.items():
        backend, _, route = VARIANTS[name]
        base = runs[BASE[backend]]
        sps = statistics.median(v.sps) if v.sps and not v.error else None
        diff = None
        if name in preds and base.name in preds:
            diff = float(np.max(np.abs(preds[name] - preds[base.name])))
        if v.error or diff is None or diff > TOLERANCE:
            failures.append(f"{name}: {v.error or f'max abs diff {diff}'}")
        elif v.ready["routes"] != [route]:
            failures.append(f"{name}: placements {v.ready['routes']}, want {route}")
        ratio = sps / statistics.median(base.sps) if sps and base.sps else None
        rows.append((
            name, "/".join(v.ready.get("routes", [])) or "-",
            f"{sps:,.0f}" if sps else v.error, f"{ratio:.2f}x" if ratio else "-",
            f"{1000 * args.batch / sps:.2f}" if sps else "-",
            "-" if diff is None else f"{diff:.1e}",
            f"{v.ready['warm_s']:.1f}" if "warm_s" in v.ready else "-",
        ))  # fmt: skip
    print(markdown(HEADERS.split("|"), rows))
    print("\nsamples/s per round: " + "; ".join(
        f"{n}: " + (", ".join(f"{s:,.0f}" for s in v.sps) or "-")
        for n, v in runs.items()))  # fmt: skip
    print(f"\nwall {time.perf_counter() - t0:.0f} s (after the parent's imports)")
    if failures:
        print("\nFAILED:\n" + "\n".join(failures))
        sys.exit(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fields", type=int, default=None)
    parser.add_argument("--bag", type=int, default=4, help="keys per sample")
    parser.add_argument("--capacity", type=int, default=None, help="per field")
    parser.add_argument("--fill", type=float, default=0.5,
                        help="keys imported per field / capacity")  # fmt: skip
    parser.add_argument("--known", type=float, default=0.9,
                        help="fraction of queried keys in the table")  # fmt: skip
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None, help="per round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="CI smoke size")
    parser.add_argument("--only", default=",".join(VARIANTS),
                        help="variants to run (their backend's callback "
                        "variant always runs too)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=None,
                        help="s to wait for a warm-up or a round")  # fmt: skip
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    quick = dict(fields=4, capacity=1 << 12, batch=512, batches=4, rounds=1,
                 timeout=120)  # fmt: skip
    full = dict(fields=8, capacity=1 << 16, batch=4096, batches=20, rounds=5,
                timeout=900)  # fmt: skip
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.variant:
        child(args)
        return
    args.only = args.only.split(",")
    if not set(args.only) <= set(VARIANTS):
        parser.error(f"--only: a comma-separated subset of {', '.join(VARIANTS)}")
    argv = []
    for k in ("fields", "bag", "capacity", "fill", "known", "batch", "batches"):
        argv += [f"--{k}", str(getattr(args, k))]
    parent(args, argv)


if __name__ == "__main__":
    main()
