"""The two kernel launches of the GPU table's calls (records built by
`keras_sparse.table.insert_call.FusedInsert.record`).

``ks_insert_calls`` (`launch`) runs each record on one block.
``ks_insert_grid`` (`launch_grid`) runs larger calls on every block of one
cooperative launch (grid-wide barriers and prefix sums, one block per
multiprocessor). A step's larger calls share that launch side by side:
its blocks form teams (`grid_teams`), each with its own barrier and
scratch (`grid_scratch`) and its own workspace (`team_workspaces`), and
each team runs its share of the records one after another, so a hundred
large fields wait at a team's barriers, not at a hundred times the grid's.

The grid knobs (`GRID_BLOCKS`, `GRID_TEAMS`, `TEAM_SCRATCH_BYTES`) are read
here: set them on this module. Which calls take the grid (`MAX_KEYS`,
`GRID_ROUTE`) is `insert_call`'s.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from .cuda_modules import module

GRID_BLOCKS = None  # blocks of a grid call; None: one per multiprocessor
GRID_TEAMS = None  # teams of a step's grid launch; None: `grid_teams` chooses
TEAM_SCRATCH_BYTES = 2 << 30  # workspaces of side-by-side teams, at most
MIN_TEAM_BLOCKS = 4  # blocks of a team, at least (a call's passes stay wide)
THREADS = 512  # KS_FT in keras_sparse/kernels/insert_call.cu (both kernels)


def launch(records):
    """One ``ks_insert_calls`` launch running ``records`` (one block each).

    The descriptor may return to CuPy's pool as soon as this returns: the
    pool reuses memory in the order of the stream it was freed on."""
    desc = cp.asarray(np.asarray(records, dtype=np.int64).reshape(-1))
    module("insert_call.cu").get_function("ks_insert_calls")(
        (len(records),), (THREADS,), (desc,)
    )


def _device_facts():
    """``(cooperative launches?, multiprocessors)`` of the current device,
    read once (CuPy reads every attribute on each ``attributes`` call)."""
    device = cp.cuda.Device()
    facts = _FACTS.get(device.id)
    if facts is None:
        attributes = device.attributes
        facts = _FACTS[device.id] = (
            bool(attributes.get("CooperativeLaunch", 1)),
            int(attributes["MultiProcessorCount"]),
        )
    return facts


_FACTS = {}


def grid_available():
    """Whether the device runs cooperative launches (every block resident),
    which ``ks_insert_grid``'s barriers need."""
    return _device_facts()[0]


def grid_blocks():
    """Blocks of a ``ks_insert_grid`` launch: `GRID_BLOCKS`, or one per
    multiprocessor (a cooperative launch needs every block resident, and the
    kernel's 512 threads fill one multiprocessor's registers)."""
    # The kernel sums the blocks' prefix sums one per thread: at most THREADS.
    if GRID_BLOCKS:
        return min(int(GRID_BLOCKS), THREADS)
    return min(_device_facts()[1], THREADS)


def grid_teams(records, words):
    """Teams of a grid launch running ``records`` calls whose workspaces
    take ``words`` words each: `GRID_TEAMS`, or as many as there are
    records, within `TEAM_SCRATCH_BYTES` of workspaces and at least
    `MIN_TEAM_BLOCKS` blocks per team. Side by side, the teams share out
    the barriers that a launch running the calls one after another on every
    block would wait at (a step of a hundred large fields)."""
    blocks = grid_blocks()
    if GRID_TEAMS:
        return max(1, min(int(GRID_TEAMS), records, blocks))
    by_memory = TEAM_SCRATCH_BYTES // max(8 * words, 1)
    return max(1, min(records, by_memory, blocks // MIN_TEAM_BLOCKS))


def grid_scratch(owner, blocks, teams=1):
    """``owner``'s (a `FusedInsert`'s) ``ks_insert_grid`` scratch of
    ``teams`` teams of ``blocks // teams`` blocks (a flag per team, then
    each team's barrier, counters, block totals and sort counts: KsGrid in
    the kernel); zeroed when allocated, after which each barrier keeps its count at
    zero. One per layout, kept: a table's own calls (one team) and a
    step's launches (several) alternate without zeroing anew."""
    scratches = owner.__dict__.setdefault("_grid_scratch", {})
    scratch = scratches.get((blocks, teams))
    if scratch is None:
        tb = blocks // teams
        words = _team_base(teams) + teams * (8 + 2 * tb + 8 * tb * THREADS)
        scratch = scratches[(blocks, teams)] = cp.zeros(words, dtype=cp.int64)
    return scratch


def team_workspaces(owner, teams, words):
    """Up to ``teams`` workspaces of at least ``words`` words each, for
    the teams of one grid launch (the first is ``owner``'s own, a
    `FusedInsert`'s, which lends them all): one only when the device has
    no room for the others, so a step runs with fewer teams rather than
    fail."""
    if owner.workspace.shape[0] < words:
        owner.workspace = cp.empty(words, dtype=cp.int64)
    if teams == 1:
        return [owner.workspace]
    cached = owner.__dict__.get("_team_workspaces")
    if cached is None or len(cached) + 1 < teams or cached[0].shape[0] < words:
        owner._team_workspaces = None  # the old ones go back first
        try:
            whole = cp.empty((teams - 1, words), dtype=cp.int64)
        except MemoryError:  # CuPy's OutOfMemoryError is one
            return [owner.workspace]
        cached = owner._team_workspaces = list(whole)
    return [owner.workspace, *cached[: teams - 1]]


def launch_grid(records, owner, teams=1):
    """One cooperative ``ks_insert_grid`` launch: ``teams`` teams of blocks,
    team ``j`` running records ``j, j + teams, ...`` one after another on
    all its blocks (records of different teams must name different tables
    and workspaces); ``owner`` (a `FusedInsert` whose lock the caller holds)
    lends its grid scratch. Returns the teams' failure flags, for
    `any_failed`."""
    blocks = grid_blocks() // teams * teams
    scratch = grid_scratch(owner, blocks, teams)
    desc = cp.asarray(np.asarray(records, dtype=np.int64).reshape(-1))
    kernel = module("insert_call.cu").get_function("ks_insert_grid")
    # CuPy's RawKernel launches cooperatively only when its module was
    # compiled for cooperative groups (relocatable code); its Function takes
    # the launch flag as it is.
    function = getattr(kernel, "kernel", kernel)
    function(
        (blocks,),
        (THREADS,),
        (desc, np.int32(len(records)), scratch, np.int32(teams)),
        enable_cooperative_groups=True,
    )
    return scratch[:teams]


def any_failed(flags):
    """Whether a call of a grid launch (its `launch_grid` flags) failed or
    met an unread failure (one host sync)."""
    return bool(flags.get().any())


def _team_base(teams):
    """Words of a grid scratch's team flags (ks_team_base in the kernel)."""
    return (teams + 7) & ~7
