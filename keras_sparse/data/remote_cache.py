"""A schedule of remote rows cached on the devices that read them (planned).

With a row-sharded table, every row a device reads that another device owns
travels at every step: the id and the vector in the forward pass, the id and
the gradient in the backward pass. When one device reads the same remote row
at several steps in a row and no other device reads it in between, that
device can instead pull the row once (with its optimizer slots), train it in
a local cache, and give it back only when another device needs it (Herald's
on-demand synchronization). The input stage knows the coming batches, so it
can decide all of this ahead of the steps.

`plan_remote_cache` makes that decision for a window of batches. Per step it
returns, for each device: the remote rows it reads from its cache (hits), the
rows it pulls into its cache before the step (from the owner, or from the
device that held the row last), the rows it pushes back to their owners
before the step (another device reads them now, or the cache is full), the
rows it reads through the owners as today (the normal path), and the rows
pushed back after the step at a flush (a checkpoint, the end of the window).

Exactness (synchronous training): a row is held by at most one non-owner
device, and only while no other device reads it; so at every step each row
has one place with its latest value (owner or holder), and every read of the
step sees that value, from the cache or from a pull made this step. Rows two
devices read in one step go through the owner, as without a cache.

The plan is a planning tool: the compiled step does not use it yet, so the
bytes it reports (`RemoteCachePlan.bytes`) are computed from the schedule.

Example (row 0 of a 2-row table on 2 devices is owned by device 0; device 1
reads it at three steps; device 0 reads it at the fourth):

>>> import numpy as np
>>> batches = [[[], [0]], [[], [0]], [[], [0]], [[0], []]]
>>> plan = plan_remote_cache(batches, owner=2, remote_cache_rows=1, dim=4)
>>> [len(s.hits.ids) for s in plan.steps]  # cache hits per step
[0, 1, 1, 0]
>>> plan.steps[0].pulls.source.tolist(), plan.steps[3].pushes.device.tolist()
([0], [1])
>>> int(plan.bytes.sum()), int(plan.baseline_bytes.sum())  # 2 x 36 vs 3 x 40
(72, 120)
"""

import dataclasses
import time

import numpy as np

from keras_sparse.data.routing import rows_per_shard

__all__ = ["Moves", "RemoteCachePlan", "StepPlan", "plan_remote_cache"]

_NEVER = np.iinfo(np.int64).max  # a "next use" key: not within the look-ahead


@dataclasses.dataclass(frozen=True)
class Moves:
    """Rows of one kind of move in one step: ``device[i]`` moves ``ids[i]``;
    ``source[i]`` (pulls only) is the device the row comes from."""

    device: np.ndarray
    ids: np.ndarray
    source: np.ndarray = None

    def of(self, device):
        """The ids of ``device`` (sorted)."""
        return np.sort(self.ids[self.device == device])


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step's schedule.

    Attributes:
        pushes: rows a holder returns to their owner before the step (another
            device reads them now, or its cache needs the room).
        pulls: rows moved into ``device``'s cache before the step, from
            ``source`` (the owner, or the device that held the row).
        hits: remote rows ``device`` reads from its cache (held before).
        remote: remote rows read through their owner (the normal path).
        flushes: rows returned to their owners after the step (a flush).
        bytes: int64 ``[D]``, bytes each device sends this step.
        baseline_bytes: int64 ``[D]``, the same without a cache.
    """

    pushes: Moves
    pulls: Moves
    hits: Moves
    remote: Moves
    flushes: Moves
    bytes: np.ndarray
    baseline_bytes: np.ndarray


@dataclasses.dataclass(frozen=True)
class RemoteCachePlan:
    """What `plan_remote_cache` returns.

    Attributes:
        steps: a `StepPlan` per batch.
        bytes: int64 ``[T, D]``, bytes each device sends per step.
        baseline_bytes: int64 ``[T, D]``, the same without the cache (every
            remote row through its owner: `remote_read_bytes` each).
        counts: total rows per kind of move (``hits``, ``pulls``,
            ``pushes``, ``remote``, ``flushes``).
        seconds: planning time of the whole window.
        remote_read_bytes: bytes of one remote read (id and vector forward,
            id and gradient backward).
        row_bytes: bytes of one pull or push (id, row, optimizer slots).
    """

    steps: list
    bytes: np.ndarray
    baseline_bytes: np.ndarray
    counts: dict
    seconds: float
    remote_read_bytes: int
    row_bytes: int

    @property
    def seconds_per_batch(self):
        """Planning time per batch of the window."""
        return self.seconds / max(1, len(self.steps))

    @property
    def saved_fraction(self):
        """1 - bytes / baseline bytes (0 when nothing is remote)."""
        base = int(self.baseline_bytes.sum())
        return 1.0 - int(self.bytes.sum()) / base if base else 0.0


def plan_remote_cache(
    batches,
    owner,
    remote_cache_rows,
    *,
    dim,
    slots=1,
    lookahead=None,
    flush_after=(),
    final_flush=True,
    id_bytes=4,
    value_bytes=4,
):
    """Plans which remote rows each device caches, pulls and pushes back.

    Args:
        batches: the window: per step, per device, the ids the device looks
            up (any int array; negative ids are padding). ``D`` is the
            number of devices of the first step.
        owner: the number of rows of a row-sharded table (owner of row ``r``:
            ``r // ceil(rows / D)``, as the sharded layers place rows; a
            key-sharded hash layer's global rows too), or a function from an
            int64 id array to its owner devices.
        remote_cache_rows: rows each device may hold for other owners (0: no
            cache; the plan then equals the normal path).
        dim: the table's vector size.
        slots: optimizer slot vectors per row (SGD 0, Adagrad 1, Adam 2),
            pulled and pushed with the row.
        lookahead: batches after a step that its decisions may see (the
            input stage's ``capacity``); None: the whole window.
        flush_after: steps after which every cache is flushed to the owners
            (checkpoints).
        final_flush: flush after the last step too (the owners then hold
            every row's latest value).
        id_bytes: bytes of an id.
        value_bytes: bytes of a vector element.

    Returns:
        A `RemoteCachePlan`.

    Decisions: a device caches a remote row it alone reads now when the
    reads of its coming run (the steps at which it alone keeps reading the
    row, within ``lookahead``) cost more through the owner than a pull and a
    push; a full cache keeps the rows it reads soonest (evicting those it
    reads last or not at all within the look-ahead, pushed back).
    """
    t0 = time.perf_counter()
    batches, capacity, d = _check(batches, remote_cache_rows, dim, slots, lookahead)
    owner_fn = _row_owner(int(owner), d) if _is_int(owner) else owner
    vector = int(dim) * int(value_bytes)
    # A remote read: the reader sends the id forward and the id and the
    # gradient backward, the owner the vector. A pull or push: id, row, slots.
    cost = (
        2 * int(id_bytes) + vector,
        vector,
        int(id_bytes) + vector * (1 + int(slots)),
    )
    steps_n = len(batches)
    reads = _distinct_reads(batches, d)
    t_of, u_of, dev_of, uniq = reads
    owners = np.asarray(owner_fn(uniq), np.int64).reshape(-1)
    if owners.shape != uniq.shape or (
        owners.size and (owners.min() < 0 or owners.max() >= d)
    ):
        raise ValueError(
            f"plan_remote_cache: `owner` must map each id to a device in "
            f"[0, {d}); got {owners.size} owners for {uniq.size} ids, in "
            f"[{owners.min(initial=0)}, {owners.max(initial=0)}]"
        )
    ent = _entries(t_of, u_of, dev_of, owners, lookahead, steps_n, cost)
    flush_at = {int(s) for s in flush_after}
    if final_flush:
        flush_at.add(steps_n - 1)
    holder = np.full(uniq.size, -1, np.int64)  # device caching the row, or -1
    next_use = np.full(uniq.size, _NEVER, np.int64)  # its holder's next read
    read_at = np.searchsorted(t_of, np.arange(steps_n + 1))
    ent_at = np.searchsorted(ent["t"], np.arange(steps_n + 1))
    steps = []
    for t in range(steps_n):
        e, r = slice(ent_at[t], ent_at[t + 1]), slice(read_at[t], read_at[t + 1])
        state = (uniq, owners, holder, next_use, capacity, d, cost)
        step_ent = {k: v[e] for k, v in ent.items()}
        steps.append(_plan_step(state, step_ent, u_of[r], dev_of[r], t in flush_at))
    sent = np.array([s.bytes for s in steps], np.int64).reshape(steps_n, d)
    base = np.array([s.baseline_bytes for s in steps], np.int64).reshape(steps_n, d)
    counts = {
        k: int(sum(getattr(s, k).ids.size for s in steps))
        for k in ("hits", "pulls", "pushes", "remote", "flushes")
    }
    seconds = time.perf_counter() - t0
    return RemoteCachePlan(
        steps, sent, base, counts, seconds, cost[0] + cost[1], cost[2]
    )


def _plan_step(state, ent, read_u, read_dev, flush):
    """One step: updates the holders in place and returns the step's plan.

    ``ent``: one entry per distinct id read now (``u``: its index in
    ``uniq``; ``who``: its only reader, or -1; ``worth``: caching it pays;
    ``next``: the only reader's next read in its run); ``read_u`` /
    ``read_dev``: the step's distinct (id, device) reads.
    """
    uniq, owners, holder, next_use, capacity, d, cost = state
    u, who = ent["u"], ent["who"]
    held = holder[u]
    hit = (held >= 0) & (held == who)
    # Read now by someone other than their holder: they leave the holder.
    leaving = (held >= 0) & ~hit
    # Candidates: the only reader is not the owner and caching pays.
    cand = (who >= 0) & (who != owners[u]) & ~hit & ent["worth"]
    cand &= capacity > 0
    admit, evict_u = _fit(holder, next_use, u, who, hit, cand, ent["next"], capacity, d)
    transfer = admit & leaving  # straight from the holder to the new reader
    push_u = np.concatenate([u[leaving & ~transfer], evict_u])
    push_dev = holder[push_u]
    pull_u, pull_dev = u[admit], who[admit]
    pull_src = np.where(leaving[admit], held[admit], owners[pull_u])
    holder[push_u] = -1
    next_use[push_u] = _NEVER
    keep = hit | admit
    holder[u[keep]] = who[keep]
    next_use[u[keep]] = ent["next"][keep]
    # A cached row has one reader now, its holder; every other read of a row
    # another device owns goes through the owner.
    cached = np.zeros(uniq.size, bool)
    cached[u[keep]] = True
    remote = read_dev != owners[read_u]
    normal = remote & ~cached[read_u]
    flush_u = np.flatnonzero(holder >= 0) if flush else np.zeros(0, np.int64)
    flush_dev = holder[flush_u]
    holder[flush_u] = -1
    next_use[flush_u] = _NEVER
    reader_b, owner_b, row_b = cost
    moved = np.concatenate([push_dev, pull_src, flush_dev])

    def by_sender(sel):
        return (
            np.bincount(read_dev[sel], minlength=d) * reader_b
            + np.bincount(owners[read_u[sel]], minlength=d) * owner_b
        )

    sent = by_sender(normal) + np.bincount(moved, minlength=d) * row_b
    return StepPlan(
        pushes=Moves(push_dev, uniq[push_u]),
        pulls=Moves(pull_dev, uniq[pull_u], pull_src),
        hits=Moves(who[hit], uniq[u[hit]]),
        remote=Moves(read_dev[normal], uniq[read_u[normal]]),
        flushes=Moves(flush_dev, uniq[flush_u]),
        bytes=sent.astype(np.int64),
        baseline_bytes=by_sender(remote).astype(np.int64),
    )


def _fit(holder, next_use, u, who, hit, cand, nxt, capacity, d):
    """Which candidates a device's cache admits, and which cached rows it
    evicts for them: hits stay; the other cached rows and the candidates
    share the room left, soonest next read first (cached rows first on
    ties). Returns (admit mask over the entries, evicted row indices)."""
    empty = np.zeros(0, np.int64)
    if not cand.any():
        return cand, empty
    read_now = np.zeros(holder.size, bool)
    read_now[u] = True
    idle = np.flatnonzero((holder >= 0) & ~read_now)
    room = capacity - np.bincount(who[hit], minlength=d)
    idle_dev, cand_i = holder[idle], np.flatnonzero(cand)
    wanted = np.bincount(idle_dev, minlength=d) + np.bincount(who[cand_i], minlength=d)
    if np.all(wanted <= room):
        return cand, empty
    dev = np.concatenate([idle_dev, who[cand_i]])
    key = np.concatenate([next_use[idle], nxt[cand_i]])
    kind = np.concatenate([np.zeros(idle.size, np.int8), np.ones(cand_i.size, np.int8)])
    order = np.lexsort((kind, key, dev))
    dev_sorted = dev[order]
    first = np.searchsorted(dev_sorted, dev_sorted, side="left")
    kept = np.empty(order.size, bool)
    kept[order] = (np.arange(order.size) - first) < room[dev_sorted]
    admit = np.zeros(cand.size, bool)
    admit[cand_i[kept[idle.size :]]] = True
    return admit, idle[~kept[: idle.size]]


def _entries(t_of, u_of, dev_of, owners, lookahead, steps_n, cost):
    """Per step and distinct id read (sorted by step, then id): ``t``,
    ``u``, ``who`` (its only reader, or -1 when several devices read it),
    ``next`` (that reader's next read in its run, within the look-ahead)
    and ``worth`` (the run's reads within the look-ahead cost more through
    the owner than a pull plus a push). A run: consecutive reads of a row
    by the same only reader, no other device reading it in between."""
    new = np.ones(t_of.size, bool)
    new[1:] = (t_of[1:] != t_of[:-1]) | (u_of[1:] != u_of[:-1])
    start = np.flatnonzero(new)
    readers = np.diff(np.append(start, t_of.size))
    t, u = t_of[start], u_of[start]
    who = np.where(readers == 1, dev_of[start], -1)
    order = np.lexsort((t, u))  # by row, then step
    ts, us, ws = t[order], u[order], who[order]
    brk = np.ones(ts.size, bool)
    brk[1:] = (us[1:] != us[:-1]) | (ws[1:] != ws[:-1]) | (ws[1:] < 0)
    run = np.cumsum(brk) - 1
    ahead = steps_n if lookahead is None else int(lookahead)
    span = steps_n + ahead + 2
    key = run * span + ts
    last = np.searchsorted(key, run * span + ts + ahead, side="right")
    left = last - np.arange(ts.size)  # this read and the run's next ones seen
    nxt = np.full(ts.size, _NEVER, np.int64)
    more = left > 1
    nxt[np.flatnonzero(more)] = ts[np.flatnonzero(more) + 1]
    reader_b, owner_b, row_b = cost
    worth = left * (reader_b + owner_b) > 2 * row_b
    out = {"t": t, "u": u, "who": who}
    out["next"] = np.empty_like(nxt)
    out["next"][order] = nxt
    out["worth"] = np.empty_like(worth)
    out["worth"][order] = worth
    return out


def _distinct_reads(batches, d):
    """Distinct (step, id, device) reads, sorted: steps, indices into the
    window's distinct ids ``uniq``, devices, and ``uniq``."""
    ts, devs, ids = [], [], []
    for t, step in enumerate(batches):
        for dev, part in enumerate(step):
            a = np.asarray(part).reshape(-1)
            if a.size and not np.issubdtype(a.dtype, np.integer):
                raise ValueError(
                    f"plan_remote_cache: `batches[{t}][{dev}]` must hold integer "
                    f"ids; got dtype {a.dtype}"
                )
            a = a.astype(np.int64)[a >= 0]
            ids.append(a)
            ts.append(np.full(a.size, t, np.int64))
            devs.append(np.full(a.size, dev, np.int64))
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    # Sort-based: NumPy's hash-based np.unique is many times slower here.
    order = _argsort(ids)
    first = _firsts(ids[order])
    uniq = ids[order][first]
    inv = np.empty(ids.size, np.int64)
    inv[order] = np.cumsum(first) - 1
    n_u = max(1, uniq.size)
    key = _sorted_unique(
        (np.concatenate(ts) * n_u + inv.reshape(-1)) * d + np.concatenate(devs)
    )
    rest = key % (n_u * d)
    return key // (n_u * d), rest // d, rest % d, uniq


def _argsort(ids):
    """``np.argsort`` of non-negative int64 ids; a plain sort of the ids
    packed with their positions where they fit (several times faster)."""
    bits = max(1, int(ids.size).bit_length())
    if not ids.size or int(ids.max()) >= 1 << (63 - bits):
        return np.argsort(ids)
    return np.sort((ids << bits) | np.arange(ids.size)) & ((1 << bits) - 1)


def _firsts(sorted_a):
    """Mask of the first of each run of equal values of a sorted array."""
    first = np.ones(sorted_a.size, bool)
    first[1:] = sorted_a[1:] != sorted_a[:-1]
    return first


def _sorted_unique(a):
    a = np.sort(a)
    return a[_firsts(a)]


def _row_owner(num_rows, d):
    if num_rows < 1:
        raise ValueError(
            f"plan_remote_cache: `owner` as a row count must be >= 1; got {num_rows}"
        )
    rps = rows_per_shard(num_rows, d)
    return lambda ids: np.asarray(ids, np.int64) // rps


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check(batches, rows, dim, slots, lookahead):
    """Validates the arguments; returns (batches as a list, capacity,
    devices)."""
    batches = list(batches)
    if not batches:
        raise ValueError("plan_remote_cache: `batches` must hold at least one step")
    d = len(batches[0])
    if d < 1 or any(len(step) != d for step in batches):
        raise ValueError(
            "plan_remote_cache: every step of `batches` must hold one id array "
            f"per device, the same number (>= 1) each; got "
            f"{[len(step) for step in batches]}"
        )
    for name, value, low in (
        ("remote_cache_rows", rows, 0),
        ("dim", dim, 1),
        ("slots", slots, 0),
    ):
        if not _is_int(value) or value < low:
            raise ValueError(
                f"plan_remote_cache: `{name}` must be an integer >= {low}; "
                f"got {value!r}"
            )
    if lookahead is not None and (not _is_int(lookahead) or lookahead < 0):
        raise ValueError(
            f"plan_remote_cache: `lookahead` must be None or an integer >= 0; "
            f"got {lookahead!r}"
        )
    return batches, int(rows), d
