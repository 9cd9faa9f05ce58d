"""The sparse update under torch DistributedDataParallel: one update for all.

DDP keeps a copy of the model in every process and averages the gradients
of the trainable parameters over its process group. The table and slots are
not such parameters (the backward pass writes them in place), so each
process would update its copy from its own slice of the batch only. Instead,
when the lookup runs inside a DDP forward, its backward all-gathers the ids
and row gradients of every process and each process applies the update of
the whole global batch, with the gradients averaged over the processes as
DDP averages dense ones: the copies stay identical and, with equal local
batches, equal one process training on the concatenated batch.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from keras_sparse.ops import hash_layer_refusal
from keras_sparse.ops import variable_layer_name

# torch.distributed running without DDP around the model is refused, since
# nothing would keep the tables equal across processes. True lets each
# process update its own tables from its own batch only (e.g. processes that
# train independent models).
ALLOW_LOCAL_UPDATES = False


def _active_ddp():
    # No public API tells a module that it runs inside DDP; DDP marks its
    # forward with this class attribute (for torch.compile's DDP support).
    return getattr(DistributedDataParallel, "_active_ddp_module", None)


def active_ddp():
    """The DistributedDataParallel module whose forward runs now, or None."""
    return _active_ddp()


def replica_count():
    """Processes whose batches one sparse update combines (1 outside DDP).

    A layer's row regularizer scales its penalty by it: DDP averages the
    gradients over the processes, but the penalty covers only this
    process's rows.
    """
    ddp = _active_ddp()
    if ddp is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(ddp.process_group)


def _group_and_world():
    """``(DDP process group or None, processes)``; world 1 when not running."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    ddp = _active_ddp()
    group = ddp.process_group if ddp is not None else None
    return group, dist.get_world_size(group)


def check_replicated_training(name, maps_keys):
    """Raises a clear error for what cannot train exactly on several
    processes: a layer that maps keys to rows on the host (``maps_keys``:
    each process would map its own keys) and a multi-process run without
    DDP (unless `ALLOW_LOCAL_UPDATES`). Called before the layer changes any
    state, and again in the lookup's forward pass."""
    group, world = _group_and_world()
    ddp = _active_ddp()
    if world == 1 or (ddp is None and ALLOW_LOCAL_UPDATES):
        return
    if ddp is None:
        raise RuntimeError(
            f"Layer '{name}': torch.distributed runs {world} processes, but "
            "the layer trains outside a DistributedDataParallel forward, so "
            "each process would update its tables from its own batch only. "
            "Wrap the model in torch.nn.parallel.DistributedDataParallel, or "
            "set keras_sparse.ops.torch.distributed.ALLOW_LOCAL_UPDATES = "
            "True if the processes train independent tables."
        )
    if maps_keys:
        where = f"DistributedDataParallel ({world} processes)"
        raise hash_layer_refusal(
            name,
            where,
            "with sharding='key' or 'auto', built after init_process_group "
            "(each process then owns the keys of its table shard), in one "
            "process",
        )


def replica_group(table_var, reset):
    """The DDP process group to gather over, or None for a local update
    (raising as `check_replicated_training` does)."""
    check_replicated_training(variable_layer_name(table_var), reset is not None)
    group, world = _group_and_world()
    if world == 1 or _active_ddp() is None:
        return None
    return group


def _all_gather(tensor, group):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


def _pad_rows(tensor, n, fill):
    if tensor.shape[0] == n:
        return tensor
    pad = tensor.new_full((n - tensor.shape[0],) + tuple(tensor.shape[1:]), fill)
    return torch.cat([tensor, pad])


def gather_batch(group, ids, valid, grads):
    """``(ids, valid, grads)`` of all processes, in rank order.

    ``all_gather`` needs equal shapes, so local batches are padded to the
    longest with invalid ids (which update nothing). The gradients are
    divided by the process count, as DDP averages dense gradients.
    """
    count = torch.tensor([ids.shape[0]], device=ids.device)
    longest = int(_all_gather(count, group).max())
    marked = _pad_rows(torch.where(valid, ids, -1), longest, -1)
    all_ids = _all_gather(marked, group)
    all_grads = _all_gather(_pad_rows(grads, longest, 0), group)
    return all_ids, all_ids >= 0, all_grads / dist.get_world_size(group)
