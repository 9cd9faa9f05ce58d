"""Training throughput on a quiet machine and with one core kept busy.

Runs a training command (default: ``examples/dlrm.py --quick``) once per
backend on a quiet machine, then again while another process spins on one
core: unpinned (the scheduler places it) and pinned to the first CPU this
process may use. The command must print ``samples/s=<number>``, as
examples/dlrm.py does in its last line. The table gives the median samples/s
of each kind of run and busy / quiet, side by side:

    python benchmarks/busy_machine.py                        # torch
    python benchmarks/busy_machine.py --backends torch,jax
    python benchmarks/busy_machine.py --busy pinned --env OMP_NUM_THREADS=1
    python benchmarks/busy_machine.py --command "examples/dlrm.py --optimizer adam"

Each run is a fresh process, so compilation and warm-up repeat in each;
the samples/s are the command's own (examples/dlrm.py leaves its first
epoch out). Compare ratios from one run of this script only.
"""

import argparse
import os
import pathlib
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RATE = re.compile(r"samples/s=([0-9.]+)")
SPINNER = "while True:\n    pass\n"


def spinner(pinned):
    """A process spinning on one core (on the first usable CPU if pinned)."""
    cpus = sorted(os.sched_getaffinity(0))
    preexec = None
    if pinned:

        def preexec():
            os.sched_setaffinity(0, {cpus[0]})

    return subprocess.Popen(
        [sys.executable, "-c", SPINNER], preexec_fn=preexec,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def run(command, backend, extra_env, busy):
    """samples/s of one run of ``command`` (None when it printed none)."""
    env = dict(os.environ, KERAS_BACKEND=backend, **extra_env)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    spin = spinner(busy == "pinned") if busy != "quiet" else None
    try:
        if spin is not None:
            time.sleep(0.5)  # let it take its core
        done = subprocess.run(
            [sys.executable, *shlex.split(command)], cwd=ROOT, env=env,
            capture_output=True, text=True,
        )  # fmt: skip
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    rates = RATE.findall(done.stdout)
    if done.returncode != 0 or not rates:
        tail = (done.stdout + done.stderr)[-2000:]
        print(f"[{backend} {busy}] failed (rc={done.returncode}):\n{tail}", flush=True)
        return None
    return float(rates[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--command", default="examples/dlrm.py --quick")
    parser.add_argument("--backends", default="torch", help="comma-separated")
    parser.add_argument(
        "--busy", default="unpinned,pinned",
        help="busy runs: comma-separated among unpinned, pinned",
    )  # fmt: skip
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each kind, alternating; the table gives their medians",
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE",
        help="extra environment of the command (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.env)
    modes = [m for m in args.busy.split(",") if m]
    for mode in modes:
        if mode not in ("unpinned", "pinned"):
            parser.error(f"--busy: {mode!r} is not unpinned or pinned")
    print(
        f"command: {args.command}  env: {extra or '-'}\n"
        f"cpus usable={len(os.sched_getaffinity(0))} cores={os.cpu_count()} "
        f"python={platform.python_version()}\n",
        flush=True,
    )
    rows = []
    for backend in [b for b in args.backends.split(",") if b]:
        # Alternating quiet and busy runs, so that a load from elsewhere
        # slows both alike.
        rates = {}
        for _ in range(args.repeat):
            for mode in ["quiet", *modes]:
                rate = run(args.command, backend, extra, mode)
                print(f"[{backend} {mode}] samples/s={rate}", flush=True)
                if rate is not None:
                    rates.setdefault(mode, []).append(rate)
        median = {mode: statistics.median(r) for mode, r in rates.items()}
        for mode in modes:
            rows.append((backend, mode, median.get("quiet"), median.get(mode)))
    print("\n| backend | busy core | quiet samples/s | busy samples/s | busy / quiet |")
    print("|---|---|---:|---:|---:|")
    for backend, mode, quiet, busy in rows:
        ratio = f"{busy / quiet:.2f}" if quiet and busy else "-"
        q = f"{quiet:,.0f}" if quiet else "-"
        b = f"{busy:,.0f}" if busy else "-"
        print(f"| {backend} | {mode} | {q} | {b} | {ratio} |")
    return rows


if __name__ == "__main__":
    main()
