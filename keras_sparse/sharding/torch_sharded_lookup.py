"""PyTorch: a table sharded over torch.distributed processes, looked up with
the sparse update on the rows' owners.

``D`` processes of one process group (`torch_placement.process_group`,
never DDP's: the exchanges must not interleave with its gradient
all-reduce), one table part each:

``row``    process ``d`` holds rows ``[d * B, (d + 1) * B)``, ``B =
           ceil(rows / D)`` (zero padding rows at the end, never reached).
           Forward: the local ids are sorted by owner (``id // B``, stable:
           each owner gets them in local order) and go to their owners (as
           offsets in the owner's part) in one ``all_to_all_single`` of
           per-owner blocks, each with a header giving its count; owners
           gather their rows; a mirror ``all_to_all_single`` returns them.
           Backward: the row gradients go to the owners the same way, and
           each owner applies the sparse optimizer to its part
           (`keras_sparse.ops.torch.lookup.apply_sparse_update`).
``column`` process ``d`` holds columns ``[d * dim / D, (d + 1) * dim / D)``
           of every row. Forward: every process's ids go to every process
           in one ``all_to_all_single`` of blocks with headers (batches may
           differ in size, which ``all_gather`` does not allow); each
           process gathers its columns for all ids and an
           ``all_to_all_single`` hands each process its ids' column slices.
           Backward: the mirror exchange of the gradient slices; each
           process updates its columns of all ids (element-wise optimizers
           only).

So a training step runs three collectives on the tables' group (ids,
vectors, gradients) besides DDP's all-reduce of the dense gradients, and
reads one small tensor on the host (the block counts, for the split sizes).
The blocks of the id exchange are ``capacity`` ids wide (`ExchangeSizes`, a
quarter above the largest block of the placement's previous call; every
process derives it from the same headers): a call with a larger block sends
the rest in a second ``all_to_all_single`` (the first call always does).

Each process exchanges its DISTINCT ids once (while
`exchange_buckets.DEDUP_EXCHANGE` is on, the default): repeated positions
read their id's row, and their gradients are summed on the process (in
local order) before they travel. The owners receive the ids and gradients
in source-rank order: an id's gradient is the sum over the global batch
grouped by process, so float rounding may differ from one process's in the
last bits (the sharded results equal one process's within 1e-5; with the
setting off every position travels and duplicates are summed in the global
batch order). The gradients are divided by ``D``, as DDP averages dense
gradients.

Bytes one process hands to the collectives per step, for ``n`` local ids
(``n`` counts the distinct ids with `DEDUP_EXCHANGE`; ids as 4 bytes while
``D * B`` fits int32, else 8; 4-byte floats, ``dim``
the full width, ``C`` the capacity: about ``1.25 n / D`` for ids spread
over the row parts, ``n`` for column; about ``(D - 1) / D`` of it leaves
the process when ids spread over the parts):

* row: ``4 D (3 + C)`` (ids with headers) ``+ 4 n dim`` (rows back, on
  average) ``+ 4 n dim`` (gradients, training only);
* column: ``4 D (3 + n)`` ``+ 4 n dim`` (column slices) ``+ 4 n dim``
  (gradients, training only);
* data (replicated, `keras_sparse.ops.torch.distributed`): ``8 D`` ``+
  (8 + 4 dim) n`` sent, ``D`` times that received (all-gathers).

Where the time goes (`benchmarks/backend_sharding.py`, 2 processes on 2
CPU cores): the three exchanges are synchronization points inside the step,
so a process that reaches one first waits for its peer. With more OpenMP
threads than cores per process (torch's default: every core, in every
process) the waiting process's idle OpenMP workers spin on the cores its
peer computes on, which made the row path 3.5-18x slower than the replicated
one; launched as ``torchrun`` does (``OMP_NUM_THREADS`` = cores /
processes), it runs at about the replicated speed, and what remains is the
exchanges' latency (about 1-3 ms each there): the sorting, gathers and the
owners' update take well under a millisecond.
"""

import torch
import torch.distributed as dist

from keras_sparse.ops.torch import lookup as torch_lookup
from keras_sparse.sharding import exchange_buckets as buckets

# Header words of each per-peer id block: the ids in the block, the
# sender's valid ids, the sender's largest block.
_HEAD = 3


def _exchange(tensor, send, recv, group):
    """``all_to_all_single`` with per-peer split sizes (lists of ints)."""
    out = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=group)
    return out


def _counts(send, group, device):
    """What every peer sends this process, given what it sends each peer
    (on ``device``: NCCL exchanges GPU tensors only)."""
    send = torch.as_tensor(send, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def _swap(blocks, group):
    """``all_to_all_single`` of ``[D, w]`` blocks: row ``p`` goes to peer
    ``p``; row ``p`` of the result came from peer ``p``."""
    out = torch.empty_like(blocks)
    dist.all_to_all_single(out, blocks, group=group)
    return out


def id_blocks(src, counts, starts, offset, width):
    """``[D, width]``: row ``p`` holds ``src[starts[p] + offset + j]`` where
    ``offset + j < counts[p]``, zeros after (block ``p`` from its
    ``offset``-th id on)."""
    d = counts.shape[0]
    j = torch.arange(offset, offset + width, device=src.device)
    inside = j[None, :] < counts[:, None]
    at = torch.where(inside, starts[:, None] + j[None, :], src.shape[0])
    padded = torch.cat([src, src.new_zeros(1)])
    return padded[at.reshape(-1)].view(d, width)


class ExchangeSizes:
    """The per-peer id capacity of one placement's exchanges (ids a block
    carries in the first collective).

    Every process updates it from the same headers (each block carries its
    sender's largest block), so all agree on it without a collective."""

    def __init__(self):
        self.capacity = 0

    def update(self, need, most):
        """After a call whose largest block held ``need`` ids, of a sender
        of at most ``most`` valid ids: a quarter above ``need`` (never
        above ``most``) when ``need`` did not fit or used under half."""
        if need > self.capacity or 2 * need < self.capacity:
            self.capacity = min(most, -(-need * 5 // 4))


class Route:
    """How one call's ids travel; ``strategy``, ``group``, ``d`` (processes),
    ``part`` (rows per process: row), ``sizes`` (the placement's
    `ExchangeSizes`) and the exchange plan of the call."""

    def __init__(self, strategy, group, d, part, sizes=None):
        self.strategy, self.group, self.d, self.part = strategy, group, d, part
        self.sizes = ExchangeSizes() if sizes is None else sizes
        # Ids travel as int32 when every id (row: offset in a part) fits.
        self.dtype = torch.int32 if part * d < 2**31 else torch.int64

    def plan(self, ids, valid):
        """Fills ``self`` with this call's exchange; returns the ids (local
        to this process's part) whose rows this process serves."""
        d = self.d
        self.inverse = None  # position -> its distinct id (dedup only)
        if buckets.DEDUP_EXCHANGE:
            ids, self.inverse = torch.unique(
                torch.where(valid, ids, -1), return_inverse=True
            )
            valid = ids >= 0
        self.n = ids.shape[0]  # ids exchanged
        if self.strategy == "row":
            owner = torch.where(valid, ids // self.part, d)
            self.order = torch.argsort(owner, stable=True)
            counts = torch.bincount(owner, minlength=d + 1)[:d]
            local = (ids - owner * self.part).index_select(0, self.order)
            starts = torch.cumsum(counts, 0) - counts
            return self._send_ids(local, counts, starts)
        n = ids.shape[0]
        counts = torch.full((d,), n, dtype=torch.int64, device=ids.device)
        return self._send_ids(torch.where(valid, ids, -1), counts, counts * 0)

    def _send_ids(self, src, counts, starts):
        """The ids ``src[starts[p]:starts[p] + counts[p]]`` go to peer ``p``;
        returns those received, in source-rank order. One collective when
        every block fits the capacity: each block carries a header and up
        to ``capacity`` ids; a second one carries the rest."""
        d, capacity = self.d, self.sizes.capacity
        src = src.to(self.dtype)
        counts = counts.to(self.dtype)
        head = torch.stack([counts, counts.sum().expand(d), counts.max().expand(d)], 1)
        first = id_blocks(src, counts, starts, 0, capacity)
        got = _swap(torch.cat([head, first], 1), self.group)
        host = torch.cat([counts, got[:, :_HEAD].T.reshape(-1)]).tolist()
        self.send, self.recv = host[:d], host[d : 2 * d]
        need = max(host[3 * d :])
        ids = got[:, _HEAD:]
        if need > capacity:
            rest = id_blocks(src, counts, starts, capacity, need - capacity)
            ids = torch.cat([ids, _swap(rest, self.group)], 1)
        self.sizes.update(need, max(host[2 * d : 3 * d]))
        recv = torch.as_tensor(self.recv, device=ids.device)
        keep = torch.arange(ids.shape[1], device=ids.device)[None, :] < recv[:, None]
        return ids[keep].long()

    def rows(self, served):
        """``[n, dim]`` rows of this call's positions from the ``served``
        rows."""
        rows = self._rows(served, self.n)
        return rows if self.inverse is None else rows.index_select(0, self.inverse)

    def _rows(self, served, n):
        back = _exchange(served, self.recv, self.send, self.group)
        if self.strategy == "row":
            # Position of each id in the owner-sorted order; the invalid
            # ones (sorted last) read an appended zero row.
            at = torch.empty_like(self.order)
            at[self.order] = torch.arange(n, device=at.device)
            m = back.shape[0]
            if m < n:
                back = torch.cat([back, back.new_zeros((1, back.shape[1]))])
                at = at.clamp_max(m)
            return back.index_select(0, at)
        cols = served.shape[1]
        return back.view(self.d, n, cols).transpose(0, 1).reshape(n, self.d * cols)

    def grads(self, upstream):
        """The gradients of the served ids, in the order they were served."""
        if self.inverse is not None:  # one row per exchanged id
            summed = upstream.new_zeros((self.n,) + tuple(upstream.shape[1:]))
            upstream = summed.index_add_(0, self.inverse, upstream)
        if self.strategy == "row":
            sent = upstream.index_select(0, self.order[: sum(self.send)])
            return _exchange(sent, self.send, self.recv, self.group)
        n = upstream.shape[0]
        cols = upstream.shape[1] // self.d
        send = upstream.reshape(n, self.d, cols).transpose(0, 1).reshape(-1, cols)
        return _exchange(send, self.send, self.recv, self.group)


def _serve(route, table, ids, valid):
    """``(served ids, their validity, the rows they read)``."""
    served = route.plan(ids.long(), valid.bool())
    ok = served >= 0  # column: invalid ids travel as -1
    return served, ok, torch_lookup.gather_valid(table, served.clamp_min(0), ok)


class _ShardedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, ids, valid, route, context):
        table = context["state"]["table"]
        served, ok, rows = _serve(route, table, ids, valid)
        ctx.route, ctx.context = route, context
        ctx.save_for_backward(anchor, served, ok)
        return route.rows(rows)

    @staticmethod
    def backward(ctx, upstream):
        anchor, served, ok = ctx.saved_tensors
        route = ctx.route
        with torch.no_grad():
            grads = route.grads(upstream.contiguous()) / route.d
            torch_lookup.apply_sparse_update(ctx.context, served, ok, grads)
        return torch.zeros_like(anchor), None, None, None, None


@torch.compiler.disable
def lookup(route, state, batch):
    """``[n, dim]`` rows of ``batch.ids`` (``state``: a `TableState`); the
    backward pass updates the owners' parts."""
    context = torch_lookup.sparse_update_context(state, batch.iterations)
    return _ShardedLookup.apply(
        state.anchor_var.value, batch.ids, batch.valid, route, context
    )


@torch.compiler.disable
def gather(route, table_var, ids, valid):
    """``[n, dim]`` rows, no update (inference)."""
    with torch.no_grad():
        _, _, rows = _serve(route, table_var.value, ids, valid)
        return route.rows(rows)


def all_parts(part, group, axis):
    """Every process's ``part`` (equal shapes), concatenated along ``axis``."""
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts, axis)
