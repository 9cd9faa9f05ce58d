"""Where a large GPU table call's time goes, phase by phase (GPU only).

Builds ``keras_sparse/kernels/insert_call.cu`` a second time with
``KS_PROFILE``, whose marks record the time at which thread 0 of each team
of blocks passes each phase of ``ks_insert_body``, and prints the time per
phase of two calls, beside their wall time with the normal build:

* ``1M keys``: one ``lookup_or_insert`` of 1M keys (50% new) into a table
  of 2**26 rows at load 0.75 (the ``benchmarks/hash_table.py`` case);
* ``step of F fields``: one training step's ``step_rows_together`` over
  ``F`` tables of 16,384 rows, 655,360 keys each over 8,192 distinct
  (``benchmarks/many_fields.py``'s shape, every key a hit), for each
  number of side-by-side teams in ``--teams`` (``0``: the default choice).

    python benchmarks/gpu_call_phases.py
    python benchmarks/gpu_call_phases.py --fields 100 --teams 1,0,33
"""

import argparse
import collections
import os
import pathlib
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
from hash_table import best_of_events  # noqa: E402
from hash_table import fill  # noqa: E402
from hash_table import snapshot  # noqa: E402

from keras_sparse.kernel_sources import kernel_source  # noqa: E402
from keras_sparse.table import HashTable  # noqa: E402
from keras_sparse.table import cuda_modules  # noqa: E402
from keras_sparse.table import insert_call  # noqa: E402
from keras_sparse.table import launches  # noqa: E402
from keras_sparse.table import step_rows_together  # noqa: E402

PHASES = {
    1: "probe",
    2: "list absent keys",
    3: "dedup set",
    4: "unique, admitted",
    5: "checks, mark hits",
    6: "(placement loop)",
    7: "round: room, roomy list",
    8: "round: sort",
    9: "round: claims",
    10: "round: losers, evictions",
    11: "touch hits",
    12: "rows, fresh, counts",
    13: "record end, next start",
}
SOURCE = "insert_call.cu"


def builds():
    """The normal module and the ``KS_PROFILE`` one (None, with the reason
    printed, when it does not build: the wall times still print)."""
    plain = cuda_modules.module(SOURCE)
    try:
        profiled = cp.RawModule(
            code=kernel_source(SOURCE), options=("--std=c++17", "-DKS_PROFILE")
        )
        profiled.get_global("ks_prof_n")  # compiles it now
    except Exception as e:  # noqa: BLE001 - report and go on without phases
        print(f"no phase marks: {type(e).__name__}: {e}")
        profiled = None
    return plain, profiled


def use(mod):
    cuda_modules._MODULES[SOURCE] = mod


def phases(profiled, run):
    """Run ``run()`` once on the profiled build; µs per phase (summed over
    records, averaged over teams) and the number of teams seen."""
    if profiled is None:
        return {}, 0
    use(profiled)
    count = cp.zeros(1, cp.uint32)
    ptr = profiled.get_global("ks_prof_n")
    cp.cuda.runtime.memcpy(ptr.ptr, count.data.ptr, 4, 4)
    run()
    cp.cuda.runtime.deviceSynchronize()
    cp.cuda.runtime.memcpy(count.data.ptr, ptr.ptr, 4, 4)
    n = min(int(count.get()[0]), 65536)
    marks = cp.ndarray((n, 3), cp.uint64, profiled.get_global("ks_prof")).get()
    per = collections.defaultdict(float)
    teams = collections.defaultdict(list)
    for pid, block, now in marks.tolist():
        teams[block].append((now, pid))
    for seq in teams.values():
        seq.sort()
        for (t0, pid), (t1, _) in zip(seq, seq[1:]):
            per[pid] += (t1 - t0) / 1e3
    return {k: v / max(len(teams), 1) for k, v in per.items()}, len(teams)


def report(name, wall_us, per, teams):
    print(f"\n### {name}: {wall_us:,.0f} us per call (normal build), {teams} team(s)\n")
    print("| phase | us (per team) | share |")
    print("|---|---:|---:|")
    total = sum(per.values()) or 1.0
    for pid in sorted(per, key=per.get, reverse=True):
        label = PHASES.get(pid, str(pid))
        print(f"| {label} | {per[pid]:,.1f} | {per[pid] / total:.0%} |")


def one_large_call(plain, profiled, reps):
    rng = np.random.default_rng(75)
    batch = 1 << 20
    t = HashTable(1 << 26, eviction="lru", device="gpu")
    fill(t, int(0.75 * t.capacity), rng, xp=cp, chunk=1 << 23)
    live = t.export()[0]
    hits = live[cp.asarray(rng.integers(0, live.shape[0], batch // 2))]
    new = cp.asarray(rng.integers(-(2**63), 2**63 - 1, batch - batch // 2))
    mixed = cp.concatenate([hits, new])[cp.asarray(rng.permutation(batch))]
    restore = snapshot(t._impl)
    use(plain)
    t.lookup_or_insert(mixed)
    restore()
    wall = best_of_events(lambda: t.lookup_or_insert(mixed), reps, setup=restore)
    restore()
    per, teams = phases(profiled, lambda: t.lookup_or_insert(mixed))
    report("1M keys, load 0.75, 50% new", wall * 1e6, per, teams)
    print(f"\n{batch / wall:.3g} keys/s")


def field_step(plain, profiled, fields, team_choices, reps):
    rng = np.random.default_rng(8)
    per_field, vocab = 65536 * 10, 8192
    tables = [HashTable(2 * vocab, eviction="lru", device="gpu") for _ in range(fields)]
    keys = cp.asarray(rng.integers(0, vocab, fields * per_field, dtype=np.int64))
    bounds = [(i * per_field, (i + 1) * per_field) for i in range(fields)]
    out = (cp.empty(keys.shape[0], cp.int32), cp.empty(keys.shape[0], cp.bool_))

    def step():
        assert step_rows_together(tables, keys, None, bounds, out) == []

    use(plain)
    step()  # every key in: later steps are all hits
    for choice in team_choices:
        launches.GRID_TEAMS = choice or None
        need = insert_call.workspace_words(per_field)
        teams = choice or launches.grid_teams(fields, need)
        use(plain)
        step()
        wall = best_of_events(step, reps)
        per, seen = phases(profiled, step)
        report(
            f"step of {fields} fields x {per_field:,} keys, teams={teams}",
            wall * 1e6,
            per,
            seen,
        )
    launches.GRID_TEAMS = None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fields", type=int, default=100)
    p.add_argument("--teams", default="1,0", help="comma list; 0: the default")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-large", action="store_true")
    args = p.parse_args(argv)
    plain, profiled = builds()
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    if not args.skip_large:
        one_large_call(plain, profiled, args.reps)
    choices = [int(x) for x in args.teams.split(",") if x.strip()]
    field_step(plain, profiled, args.fields, choices, args.reps)


if __name__ == "__main__":
    main()
