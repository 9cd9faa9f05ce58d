"""The hash fields of a training step in at most two launches
(`step_rows_many`, behind `keras_sparse.table.step_rows_together`).

Tables of up to `insert_call.MAX_KEYS` keys run one block each in one
``ks_insert_calls`` launch; larger ones run one after another on every
block of one cooperative ``ks_insert_grid`` launch, in one shared workspace.
"""

from __future__ import annotations

import contextlib

import cupy as cp

from .insert_call import any_failed
from .insert_call import clocks_kept_on_error
from .insert_call import launch
from .insert_call import launch_grid
from .insert_call import workspace_words


def step_rows_many(fused, keys, use, bounds, out):
    """`FusedInsert.step_rows` of several tables in one launch (two when
    some tables take more than `MAX_KEYS` keys: those run one after another
    in one grid launch).

    Table ``i`` (``fused[i]``) maps ``keys[a:b]`` for ``(a, b) = bounds[i]``
    and writes ``out[0][a:b]`` (int32 rows) and ``out[1][a:b]`` (fresh);
    each block of the launch runs one table's call, so the results equal
    separate `step_rows` calls. Returns the indices of the tables left out
    (not eligible alone, or a table's later appearances: two blocks on one
    table would race), which the caller must then call itself, in order.
    """
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
        owner = shared = None
        if any(on_grid):
            # The grid runs its records one after another: they share one
            # workspace (the first grid table's), not one each.
            owner = fused[joined[on_grid.index(True)]]
            need = max(workspace_words(m) for m, g in zip(sizes, on_grid) if g)
            if owner.workspace.shape[0] < need:
                owner.workspace = cp.empty(need, dtype=cp.int64)
            shared = owner.workspace
        with clocks_kept_on_error([fused[i].table for i in joined]):
            records = []
            if by_pointer:  # no views: each table's part is a pointer sum
                k0, r0, f0 = keys.data.ptr, rows32.data.ptr, fresh.data.ptr
                u0 = f0 if use is None else use.data.ptr
                for i, g in zip(joined, on_grid):
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
                            workspace=shared if g else None,
                        )
                    )
            else:
                for i, g in zip(joined, on_grid):
                    a, b = bounds[i]
                    part = None if use is None else use[a:b]
                    slots = (rows32[a:b], fresh[a:b])
                    records.append(
                        fused[i].record(
                            keys[a:b], part, True, None, slots, shared if g else None
                        )[0]
                    )
            small = [r for r, g in zip(records, on_grid) if not g]
            if small:
                launch(small)
            wide, scratch = [], None
            if owner is not None:
                large = [(i, r) for i, r, g in zip(joined, records, on_grid) if g]
                scratch = launch_grid([r for _, r in large], owner)
                wide = [fused[i] for i, r in large if r[4] > fused[i].table.capacity]
            # Held like a record's own arrays (until this table's next call).
            fused[joined[0]].held += [a for a in flat if a is not None]
        # More keys than rows: a call may have failed (too many distinct
        # keys), which must fail this step (one host read). The launch ran:
        # every table keeps its advanced clock, as the CPU twin's would.
        if wide and any_failed(scratch):
            for f in wide:
                f.read()
    return left


def _contiguous(arrays, dtypes):
    """True when each array (or None) is C-contiguous of its dtype."""
    return all(
        a is None or (a.dtype == d and a.flags.c_contiguous and a.ndim == 1)
        for a, d in zip(arrays, dtypes)
    )
