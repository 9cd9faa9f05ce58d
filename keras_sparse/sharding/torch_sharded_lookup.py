"""PyTorch: a table sharded over torch.distributed processes, looked up with
the sparse update on the rows' owners.

``D`` processes of one process group (`torch_placement.process_group`,
never DDP's: the exchanges must not interleave with its gradient
all-reduce), one table part each:

``row``    process ``d`` holds rows ``[d * B, (d + 1) * B)``, ``B =
           ceil(rows / D)`` (zero padding rows at the end, never reached).
           Forward: the local ids are sorted by owner (``id // B``, stable:
           each owner gets them in local order); an ``all_to_all_single`` of
           the per-owner counts, then of the ids (as offsets in the owner's
           part); owners gather their rows; a mirror ``all_to_all_single``
           returns them. Backward: the row gradients go to the owners the same
           way, and each owner applies the sparse optimizer to its part
           (`keras_sparse.ops.torch.lookup.apply_sparse_update`).
``column`` process ``d`` holds columns ``[d * dim / D, (d + 1) * dim / D)``
           of every row. Forward: the local id counts, then every process's
           ids go to every process (an ``all_to_all_single`` of the ids
           repeated ``D`` times: batches may differ in size, which
           ``all_gather`` does not allow); each process gathers its columns
           for all ids and an ``all_to_all_single`` hands each process its
           ids' column slices. Backward: the mirror exchange of the gradient
           slices; each process updates its columns of all ids (element-wise
           optimizers only).

The owners receive the ids and gradients in source-rank order, each
source's in local order: the global batch order of one process on the
concatenated batches, so duplicates are summed in the same order. The
gradients are divided by ``D``, as DDP averages dense gradients.

Bytes one process hands to the collectives per step, for ``n`` local ids
(8-byte ids, 4-byte floats, ``dim`` the full width; about ``(D - 1) / D``
of it leaves the process when ids spread over the parts):

* row: ``16 D`` (counts) ``+ 8 n`` (ids) ``+ 4 n dim`` (rows back, on
  average) ``+ 4 n dim`` (gradients, training only);
* column: ``16 D`` ``+ 8 D n`` (ids to every process) ``+ 4 n dim``
  (column slices) ``+ 4 n dim`` (gradients, training only);
* data (replicated, `keras_sparse.ops.torch.distributed`): ``8 D`` ``+
  (8 + 4 dim) n`` sent, ``D`` times that received (all-gathers).
"""

import torch
import torch.distributed as dist

from keras_sparse.ops.torch import lookup as torch_lookup


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


class Route:
    """How one call's ids travel; ``strategy``, ``group``, ``d`` (processes),
    ``part`` (rows per process: row) and the exchange plan of the call."""

    def __init__(self, strategy, group, d, part):
        self.strategy, self.group, self.d, self.part = strategy, group, d, part

    def plan(self, ids, valid):
        """Fills ``self`` with this call's exchange; returns the ids (local
        to this process's part) whose rows this process serves."""
        if self.strategy == "row":
            owner = torch.where(valid, ids // self.part, self.d)
            order = torch.argsort(owner, stable=True)
            send = torch.bincount(owner, minlength=self.d + 1)[: self.d].tolist()
            self.order = order[: sum(send)]
            self.send, self.recv = send, _counts(send, self.group, ids.device)
            picked = self.order
            local = ids[picked] - owner[picked] * self.part
            return _exchange(local, self.send, self.recv, self.group)
        n = ids.shape[0]
        self.send = [n] * self.d
        self.recv = _counts(self.send, self.group, ids.device)
        marked = torch.where(valid, ids, -1)
        return _exchange(marked.repeat(self.d), self.send, self.recv, self.group)

    def rows(self, served, n):
        """``[n, dim]`` rows of this call's ids from the ``served`` rows."""
        back = _exchange(served, self.recv, self.send, self.group)
        if self.strategy == "row":
            out = served.new_zeros((n, served.shape[1]))
            return out.index_copy_(0, self.order, back)
        cols = served.shape[1]
        return back.view(self.d, n, cols).transpose(0, 1).reshape(n, self.d * cols)

    def grads(self, upstream):
        """The gradients of the served ids, in the order they were served."""
        if self.strategy == "row":
            return _exchange(upstream[self.order], self.send, self.recv, self.group)
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
        return route.rows(rows, ids.shape[0])

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
        return route.rows(rows, ids.shape[0])


def all_parts(part, group, axis):
    """Every process's ``part`` (equal shapes), concatenated along ``axis``."""
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts, axis)
