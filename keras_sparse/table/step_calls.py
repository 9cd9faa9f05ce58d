"""The hash fields of a training step in at most two launches
(`step_rows_together`, for `keras_sparse.table.HashTable`s on a GPU).

Tables of up to `insert_call.MAX_KEYS` keys run one block each in one
``ks_insert_calls`` launch; larger ones share one cooperative
``ks_insert_grid`` launch, whose teams of blocks run them side by side
(each team its share one after another, in the team's workspace).
"""

from __future__ import annotations

import contextlib
import itertools

# CuPy and the launches are imported by the calls that need them: CPU
# tables take none of this module's GPU path.


def step_rows_together(tables, keys, use, bounds, out):
    """`HashTable.step_rows` of several GPU tables in one kernel launch.

    ``tables[i]`` maps the flat device keys ``keys[a:b]`` for ``(a, b) =
    bounds[i]`` (``use`` masks padding, or None) and writes ``out[0][a:b]``
    (int32 rows) and ``out[1][a:b]`` (fresh flags), as its own `step_rows`
    call would. Returns the indices of the tables it left out, in order, for
    the caller to call one by one afterwards: CPU tables, tables
    `step_rows` refuses (``eviction=None``, admission counts), tables with
    a time to live and a table's repeated appearances. Batches above 64K
    keys share a second launch, whose teams of blocks run them side by
    side.

    Example (on a GPU):

    >>> import cupy as cp                                  # doctest: +SKIP
    >>> from keras_sparse.table import HashTable           # doctest: +SKIP
    >>> a, b = (HashTable(64, device="gpu") for _ in "ab")  # doctest: +SKIP
    >>> out = (cp.empty(5, cp.int32), cp.empty(5, cp.bool_))  # doctest: +SKIP
    >>> step_rows_together([a, b], cp.arange(5), None, [(0, 3), (3, 5)], out)
    ... # doctest: +SKIP
    []
    """
    on_gpu = [
        i
        for i, t in enumerate(tables)
        if getattr(t._impl, "step_rows", None)
        and t._impl.ttl is None
        and t._impl.changes is None
    ]
    if not on_gpu:
        return list(range(len(tables)))
    from .insert_call import FusedInsert

    k, _ = tables[on_gpu[0]]._convert(keys, "keys")
    gpu_tables = [tables[i] for i in on_gpu]
    with contextlib.ExitStack() as held:
        for t in sorted({id(t): t for t in gpu_tables}.values(), key=id):
            held.enter_context(t._lock)  # a fixed order: no deadlock
        fused = [FusedInsert.of(t._impl) for t in gpu_tables]
        try:
            left = step_rows_many(fused, k, use, [bounds[i] for i in on_gpu], out)
        except BaseException:
            # Some calls may have run: no serving map may pass for current.
            for t in gpu_tables:
                t._version += 1
            raise
        for j, t in enumerate(gpu_tables):
            t._version += j not in left
    left = {on_gpu[j] for j in left}
    return [i for i in range(len(tables)) if i not in on_gpu or i in left]


def step_rows_many(fused, keys, use, bounds, out):
    """`FusedInsert.step_rows` of several tables in one launch (two when
    some tables take more than `MAX_KEYS` keys: those share one grid
    launch, side by side on teams of blocks).

    Table ``i`` (``fused[i]``) maps ``keys[a:b]`` for ``(a, b) = bounds[i]``
    and writes ``out[0][a:b]`` (int32 rows) and ``out[1][a:b]`` (fresh);
    each block of the launch runs one table's call, so the results equal
    separate `step_rows` calls. Returns the indices of the tables left out
    (not eligible alone, or a table's later appearances: two blocks on one
    table would race), which the caller must then call itself, in order.
    """
    import cupy as cp

    from .insert_call import clocks_kept_on_error
    from .insert_call import workspace_words
    from .launches import any_failed
    from .launches import grid_teams
    from .launches import launch
    from .launches import launch_grid
    from .launches import team_workspaces

    joined, left, seen = [], [], set()
    for i, (f, (a, b)) in enumerate(zip(fused, bounds)):
        # After a table's first appearance its later ones wait their turn,
        # whether or not the first joins the launch.
        if id(f) in seen or f.table.eviction is None or not f.eligible(b - a):
            left.append(i)
        else:
            joined.append(i)
        seen.add(id(f))
    if not joined:
        return left
    rows32, fresh = out
    flat = (keys, use, rows32, fresh)
    by_pointer = _contiguous(flat, (cp.int64, cp.bool_, cp.int32, cp.bool_))
    with contextlib.ExitStack() as held:
        for f in sorted({id(fused[i]): fused[i] for i in joined}.values(), key=id):
            held.enter_context(f.lock)  # a fixed order: no deadlock
        sizes = [int(bounds[i][1]) - int(bounds[i][0]) for i in joined]
        on_grid = [fused[i].route(m) == "grid" for i, m in zip(joined, sizes)]
        owner, spaces, teams = None, [], 1
        if any(on_grid):
            # Each team of the grid runs its records one after another: they
            # share the team's workspace (lent by the first grid table).
            owner = fused[joined[on_grid.index(True)]]
            need = max(workspace_words(m) for m, g in zip(sizes, on_grid) if g)
            spaces = team_workspaces(owner, grid_teams(sum(on_grid), need), need)
            teams = len(spaces)
        with clocks_kept_on_error([fused[i].table for i in joined]):
            records, nth = [], itertools.count()
            # The grid's record j runs on team j % teams: its workspace.
            space = [spaces[next(nth) % teams] if g else None for g in on_grid]
            if by_pointer:  # no views: each table's part is a pointer sum
                k0, r0, f0 = keys.data.ptr, rows32.data.ptr, fresh.data.ptr
                u0 = f0 if use is None else use.data.ptr
                for i, w in zip(joined, space):
                    a, b = (int(v) for v in bounds[i])
                    records.append(
                        fused[i].record_at(
                            b - a,
                            k0 + 8 * a,
                            u0 + a,
                            use is not None,
                            True,
                            None,
                            r0 + 4 * a,
                            f0 + a,
                            True,
                            workspace=w,
                        )
                    )
            else:
                for i, w in zip(joined, space):
                    a, b = bounds[i]
                    part = None if use is None else use[a:b]
                    slots = (rows32[a:b], fresh[a:b])
                    records.append(
                        fused[i].record(keys[a:b], part, True, None, slots, w)[0]
                    )
            small = [r for r, g in zip(records, on_grid) if not g]
            if small:
                launch(small)
            wide, flags = [], None
            if owner is not None:
                large = [(i, r) for i, r, g in zip(joined, records, on_grid) if g]
                flags = launch_grid([r for _, r in large], owner, teams)
                wide = [fused[i] for i, r in large if r[4] > fused[i].table.capacity]
            # Held like a record's own arrays (until this table's next call).
            fused[joined[0]].held += [a for a in flat if a is not None]
        # More keys than rows: a call may have failed (too many distinct
        # keys), which must fail this step (one host read). The launch ran:
        # every table keeps its advanced clock, as the CPU twin's would.
        if wide and any_failed(flags):
            for f in wide:
                f.read()
    return left


def _contiguous(arrays, dtypes):
    """True when each array (or None) is C-contiguous of its dtype."""
    return all(
        a is None or (a.dtype == d and a.flags.c_contiguous and a.ndim == 1)
        for a, d in zip(arrays, dtypes)
    )
