"""Key-sharded hash layer: 1 process x 8 devices vs 2 processes x 4 devices.

Beside it, the same comparison for a model of fixed-vocabulary tables only
(row-, column- and data-sharded): what the cross-process collectives cost
any model here.

Runs ``examples/multiprocess_train.py --hash`` (a key-sharded
``DistributedHashEmbedding`` with 64-bit keys, LRU eviction and admission
after two sightings, beside a row-sharded table; gloo collectives over
loopback) in both layouts, alternately for ``--rounds`` rounds, and prints
the median training step time and samples/s of each (steps after the first
``--skip`` of a run; each step's wall time includes reading its loss), with
their ratio. Both layouts train the same model on the same global batches
(the tests check they match key by key).

On a 2-core machine the 8 CPU "devices" of one process share one Python
interpreter, so their host callbacks (the key routing and the owners' table
calls) take turns holding its lock; two processes split them over two
interpreters. The numbers show what that is worth here, not a network.

    python benchmarks/key_sharding_processes.py [--steps 24] [--batch 1024]
        [--rounds 2]
"""

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "multiprocess_train.py"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, records, model):
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    extra = ["--hash", "--records-out", records] if model == "hash" else []
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(ROOT),
    )


def _result(proc, timeout):
    out, _ = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"run failed (rc {proc.returncode}):\n{out[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def run(model, layout, steps, batch, tmp, timeout=900):
    """Step times (s) of one run of ``model`` ("hash" or "fixed") in
    ``layout`` ("1x8" or "2x4")."""
    common = ["--steps", str(steps), "--batch-size", str(batch)]
    common += ["--watchdog", "600", "--hash-capacity", "65536"]
    if layout == "1x8":
        proc = _launch(
            [*common, "--num-processes", "1", "--local-devices", "8"],
            str(tmp / "ref.json"),
            model,
        )
        return _result(proc, timeout)["step_s"]
    port = str(_free_port())
    procs = [
        _launch(
            [*common, "--num-processes", "2", "--port", port, "--process-id", str(i)],
            str(tmp / f"p{i}.json"),
            model,
        )
        for i in range(2)
    ]
    result = _result(procs[0], timeout)
    _result_or_rc(procs[1], timeout)
    return result["step_s"]


def _result_or_rc(proc, timeout):
    proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"process 1 failed (rc {proc.returncode})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=1024, help="global batch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip", type=int, default=4, help="warm-up steps")
    args = parser.parse_args(argv)
    runs = [(m, layout) for m in ("hash", "fixed") for layout in ("1x8", "2x4")]
    times = {run_: [] for run_ in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for model, layout in runs:
                steps = run(model, layout, args.steps, args.batch, pathlib.Path(tmp))
                times[model, layout] += steps[args.skip :]
                print(f"  round {r + 1} {model} {layout}: done", flush=True)
    print(
        f"\nglobal batch {args.batch}, {args.steps} steps x {args.rounds} rounds "
        f"(first {args.skip} of each run skipped); hash: a key-sharded hash "
        "layer + a row-sharded table; fixed: row-, column- and data-sharded "
        "tables (no hash layer)\n"
    )
    print("| model | layout | median step ms | samples/s |")
    print("|---|---|---|---|")
    med = {k: statistics.median(v) for k, v in times.items()}
    for (model, layout), m in med.items():
        print(f"| {model} | {layout} | {m * 1000:.1f} | {args.batch / m:,.0f} |")
    print()
    for model in ("hash", "fixed"):
        ratio = med[model, "1x8"] / med[model, "2x4"]
        print(f"{model}: 2 processes x 4 vs 1 x 8: {ratio:.2f}x samples/s")


if __name__ == "__main__":
    main()
