"""PyTorch: the sparse update rides on an autograd.Function.

Table and slots are parameters without gradients. A scalar trainable
"anchor" is the function's only differentiable input; its backward updates
the touched rows in place under no_grad and returns a zero anchor gradient.
Inside a DistributedDataParallel forward every process applies the update
of the global batch (see `keras_sparse.ops.torch.distributed`).
"""

import concurrent.futures
import os
import threading

import torch

from keras_sparse.ops import native_optimizers
from keras_sparse.ops.cpu_threads import available_cpus
from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState
from keras_sparse.ops.optimizer_rules import rule_of
from keras_sparse.ops.row_updates import TableBlocks
from keras_sparse.ops.torch import bag_updates
from keras_sparse.ops.torch import distributed as torch_distributed
from keras_sparse.ops.torch.row_updates import apply_row_updates
from keras_sparse.ops.torch.row_updates import compiled_route
from keras_sparse.ops.torch.row_updates import scratch_for
from keras_sparse.ops.torch.row_writes import write_rows

#: Whether a stack's tables update side by side on a CPU (`_update_tables`).
PARALLEL_TABLES = True
_POOL = {}
_POOL_LOCK = threading.Lock()
# Scales a layer's row-regularizer penalty (see `torch_distributed.replica_count`).
replica_count = torch_distributed.replica_count
# Refuses, before any state changes, what replicas cannot train exactly.
check_replicated_training = torch_distributed.check_replicated_training


def gather_valid(table, ids, valid):
    """``table[ids]`` where ``valid``, else zero rows (float32 from a
    16-bit table)."""
    if ids.device.type == "cpu" and bool(valid.all()):
        # The common case; a host check costs nothing on the CPU, and a
        # broadcast select over the rows is one of the dearer eager ops.
        return _compute(table.index_select(0, ids))
    rows = table.index_select(0, torch.where(valid, ids, torch.zeros_like(ids)))
    rows = torch.where(valid[:, None], rows, torch.zeros((), dtype=rows.dtype))
    return _compute(rows)


def _compute(rows):
    return rows.float() if rows.dtype in (torch.bfloat16, torch.float16) else rows


def _scratch(context):
    table = context["state"]["table"]
    return scratch_for(context["table_var"], table.shape[0] + 1, table.device)


def _update_rows(context, first, end, ids, valid, grads, segments=None, bag=1):
    """The sparse update of rows ``[first, end)`` of the state (a table of a
    stack, or the whole table) from ``ids`` relative to ``first``.

    The compiled route dedups in a scratch of its own, sized by the batch,
    and the input stage's ``segments`` need none; the torch route uses the
    table's scratch entries of those rows (and the one after), made on its
    first use."""
    state = {name: tensor[first:end] for name, tensor in context["state"].items()}
    scratch = None
    if segments is None and compiled_route(state["table"], grads) is None:
        scratch = _scratch(context)[first:]
    apply_row_updates(
        state,
        scratch,
        context["optimizer"],
        ids,
        valid,
        grads,
        context["iterations"],
        context["constraint"],
        segments,
        bag=bag,
        stochastic=context["stochastic"],
    )


def _apply_update(context, ids, valid, grads):
    """The sparse update of one backward pass, under no_grad."""
    with torch.no_grad():
        if context["group"] is not None:
            ids, valid, grads = torch_distributed.gather_batch(
                context["group"], ids, valid, grads
            )
        rows = context["state"]["table"].shape[0]
        blocks, segments = context["blocks"], context["segments"]
        if blocks is None or segments is not None:
            parts = [(ids, valid, grads, 0, rows)]
        else:
            parts = blocks.split(ids, valid, grads)
        _update_tables(
            [
                (
                    context,
                    first,
                    end,
                    part_ids,
                    part_valid,
                    part_grads,
                    segments,
                )
                for part_ids, part_valid, part_grads, first, end in parts
            ]
        )


def _update_tables(jobs):
    """`_update_rows` of each job (``(context, first, end, ids, valid,
    grads, segments, bag)``, disjoint row ranges of one state).

    On a CPU the tables of a stack update side by side on `_pool`'s
    threads, no more than torch's intra-op threads nor the CPUs this
    process may use (`available_cpus`: its affinity and cgroup quota): their
    compiled passes release the GIL, and each writes only its own rows and
    its own scratch. The result is the same bits as one
    after another. Only updates that stay in compiled code run side by
    side (no torch or Keras operations in the workers, whose thread-local
    settings they would not see), and only batches whose ids all fit their
    tables, so that a bad id fails as it does one table after another.
    """
    if not jobs:
        return
    workers = update_workers(len(jobs))
    if workers < 2 or not PARALLEL_TABLES or not all(map(_all_compiled, jobs)):
        for job in jobs:
            _update_rows(*job)
        return
    futures = [_pool(workers).submit(_update_rows_no_grad, *job) for job in jobs]
    concurrent.futures.wait(futures)
    for future in futures:
        future.result()


def update_workers(jobs):
    """Threads that update ``jobs`` tables side by side (1: one by one)."""
    most = min(jobs, torch.get_num_threads())
    # available_cpus reads the cgroup's files: not for one table or thread.
    return max(1, most if most < 2 else min(most, available_cpus()))


def _run_parts(update):
    """Runs a `bag_updates.BagUpdate`: its tables side by side on `_pool`'s
    threads where `_update_tables` would run them so (its C calls release
    the GIL and touch no torch state), else in one call."""
    workers = update_workers(len(update.tables)) if PARALLEL_TABLES else 1
    parts = update.parts(workers)
    if len(parts) < 2:
        for part in parts:
            update.run(part)
    else:
        futures = [_pool(workers).submit(update.run, part) for part in parts]
        concurrent.futures.wait(futures)
        for future in futures:
            future.result()
    update.finish()


def _all_compiled(job):
    """Whether `_update_rows` of ``job`` runs in compiled code only, with
    every valid id inside its table (checked here: a few vector ops)."""
    context, first, end, ids, valid, grads, segments = job[:7]
    if (
        context["constraint"] is not None
        or rule_of(context["optimizer"]) is None
        or not native_optimizers.FUSED_OPTIMIZERS
        # The torch route's dedup also writes the entry after its rows,
        # the next table's first.
        or compiled_route(context["state"]["table"], grads, segments) is None
    ):
        return False
    if ids.numel() == 0:
        return True
    # One pass over all ids; invalid positions may hold any id, so a miss
    # here checks the valid ones alone.
    low, high = torch.aminmax(ids)
    if int(low) < 0 or int(high) >= end - first:
        kept = ids[valid]
        return kept.numel() == 0 or (
            0 <= int(kept.min()) and int(kept.max()) < end - first
        )
    return True


def _update_rows_no_grad(*job):
    with torch.no_grad():  # grad mode is per thread
        _update_rows(*job)


def _pool(workers):
    """A process-wide thread pool of ``workers`` threads (made on demand).

    It lives as long as the process, on purpose: every training step uses
    it, and starting threads per step would cost more than the update of a
    small table. Its idle threads block (they never spin) and end with the
    interpreter; at most one pool per size is made (in practice one).
    """
    with _POOL_LOCK:
        pool = _POOL.get(workers)
        if pool is None:
            pool = _POOL[workers] = concurrent.futures.ThreadPoolExecutor(
                workers, thread_name_prefix="keras_sparse_rows"
            )
        return pool


def _forget_pools():
    # A forked child inherits the pools but not their threads: it would
    # wait forever on work no thread takes.
    _POOL.clear()
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


class _SparseLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, ids, valid, context):
        ctx.context = context
        ctx.save_for_backward(anchor, ids, valid)
        return gather_valid(context["state"]["table"], ids, valid)

    @staticmethod
    def backward(ctx, upstream):
        anchor, ids, valid = ctx.saved_tensors
        _apply_update(ctx.context, ids, valid, upstream)
        return torch.zeros_like(anchor), None, None, None


class _SparseBagSums(torch.autograd.Function):
    """Sums of bags: ``bags`` are ``[batch_t, bag_t]`` ids (table ``t`` of a
    stack, offset into it), the output their ``[sum of batch_t, dim]`` sums."""

    @staticmethod
    def forward(ctx, anchor, context, *bags):
        ctx.context = context
        ctx.save_for_backward(anchor, *bags)
        table = context["state"]["table"]
        if len({bag.shape[1] for bag in bags}) == 1:
            ids = bags[0] if len(bags) == 1 else torch.cat(bags)
            return torch.nn.functional.embedding_bag(ids, table, mode="sum")
        starts = [torch.arange(b.shape[0], device=b.device) * b.shape[1] for b in bags]
        base = 0
        for i, bag in enumerate(bags):
            starts[i], base = starts[i] + base, base + bag.numel()
        flat = torch.cat([bag.reshape(-1) for bag in bags])
        return torch.nn.functional.embedding_bag(
            flat, table, torch.cat(starts), mode="sum"
        )

    @staticmethod
    def backward(ctx, upstream):
        anchor, *bags = ctx.saved_tensors
        context = ctx.context
        with torch.no_grad():
            update = bag_updates.prepare(context, bags, upstream)
            if update is not None:
                _run_parts(update)
        if update is not None:
            return (torch.zeros_like(anchor), None) + (None,) * len(bags)
        ranges = context["row_ranges"] or [(0, context["state"]["table"].shape[0])]
        with torch.no_grad():
            start, jobs = 0, []
            for bag, (first, end) in zip(bags, ranges):
                ids = bag.reshape(-1) - first if first else bag.reshape(-1)
                every = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
                grads = upstream[start : start + bag.shape[0]]
                jobs.append(
                    (
                        context,
                        first,
                        end,
                        ids,
                        every,
                        grads,
                        None,
                        bag.shape[1],
                    )
                )
                start += bag.shape[0]
            _update_tables(jobs)
        return (torch.zeros_like(anchor), None) + (None,) * len(bags)


def reset_rows(state, optimizer, ids, mask, values):
    """Writes ``values[mask]`` to rows ``ids[mask]`` and slots to initial values."""
    with torch.no_grad():
        rows = ids[mask]
        write_rows(state["table"], rows, values[mask])
        for spec in optimizer.slot_specs():
            state[spec.name][rows] = spec.initial_value


@torch.compiler.disable
def lookup(state: TableState, batch: LookupBatch):
    """``batch.reset=(mask, values)``: see `reset_rows` (applied before the
    gather).

    ``batch.segments``: see `keras_sparse.ops.torch.row_updates.apply_row_updates`.
    ``batch.blocks``: ``(batch_major, extents, row_ranges)`` of a stack of
    tables, updated table by table (see
    `keras_sparse.ops.row_updates.TableBlocks`). A lookup with
    ``iterations`` always updates (``apply_update`` is JAX's);
    ``exchange_slot`` is not used.
    """
    reset, segments = batch.reset, batch.segments
    blocks = None if batch.blocks is None else TableBlocks(*batch.blocks)
    group = torch_distributed.replica_group(state.table_var, reset)
    if group is not None:
        segments = None  # they number this process's ids, not the gathered ones
        if blocks is not None and not blocks.batch_major:
            blocks = None  # the gathered batch repeats the table order

    context = _context(state, batch.iterations, segments, blocks, group)
    ids = batch.ids.long()
    if reset is not None:
        reset_rows(context["state"], state.optimizer, ids, reset[0].bool(), reset[1])
    return _SparseLookup.apply(state.anchor_var.value, ids, batch.valid.bool(), context)


def _context(state, iterations, segments=None, blocks=None, group=None):
    """What a lookup's backward pass needs for its update (``state``: a
    `TableState`)."""
    tensors = {"table": state.table_var.value}
    tensors.update({name: var.value for name, var in state.slot_vars.items()})
    return {
        "state": tensors,
        "table_var": state.table_var,
        "optimizer": state.optimizer,
        "iterations": iterations,
        "constraint": state.constraint,
        "stochastic": state.stochastic_rounding,
        "segments": segments,
        "blocks": blocks,
        "group": group,
    }


def sparse_update_context(state, iterations):
    """What `apply_sparse_update` needs: the tensors of ``state`` (a
    `TableState`; a sharded table's own part, for its owner's update)."""
    return _context(state, iterations)


def apply_sparse_update(context, ids, valid, grads):
    """The sparse update of ``context``'s state from ``ids`` (rows of that
    state), under no_grad; the backward pass of a sharded lookup uses it."""
    _apply_update(context, ids, valid, grads)


def bag_sums_apply(table_var, bags, valids):
    """Whether `bag_sums_with_sparse_update` serves a call: bags of ids
    (``[batch, bag]`` each) of a CPU table, every position valid, one
    process (no DDP)."""
    return (
        table_var.value.device.type == "cpu"
        # embedding_bag would sum 16-bit rows in 16 bits
        and table_var.value.dtype == torch.float32
        and all(len(bag.shape) == 2 and bag.shape[1] > 0 for bag in bags)
        and all(bool(valid.all()) for valid in valids)  # free host checks on CPUs
        and torch_distributed.replica_group(table_var, None) is None
    )


@torch.compiler.disable
def bag_sums_with_sparse_update(
    state: TableState, bags, iterations, row_ranges=None, valids=None
):
    """``[sum of batch_t, dim]``: the sums of each bag's rows, bag after bag.

    ``bags``: ``[batch_t, bag_t]`` ids, all valid (``valids`` unread:
    `bag_sums_apply` checked them), one per table of a stack
    (``row_ranges``, its tables' rows; None: one table, the whole variable)
    with the table's first row added. One fused gather-and-sum,
    ``embedding_bag``; its backward pass applies ``state.optimizer`` to the
    touched rows as `lookup` does, table by table, each position taking its
    bag's gradient.
    """
    context = _context(state, iterations)
    context["row_ranges"] = row_ranges
    bags = [bag.long() for bag in bags]
    return _SparseBagSums.apply(state.anchor_var.value, context, *bags)
