"""A table with ``cache_rows`` trained by torch.distributed processes under
DistributedDataParallel: a copy of the cache in every process, all equal.

Each process holds its own id map, store and cache variables, started
from identical contents: the store's initial rows are drawn per id from
the initializer's seed (`shared_seed` gives an unseeded initializer the
same seed in every process) and `check_copies` compares the copies at
the first training step of the processes. In each training step every
process all-gathers the batch's ids in rank order (`gather`), maps the
whole batch with its own map (so every copy makes the same mapping,
fills and write-backs) and looks up its own positions; the sparse
update's backward pass gathers every process's rows and gradients
(`keras_sparse.ops.torch.distributed`), so every copy applies the whole
batch's update, as a table without a cache does under DDP.
"""

from keras_sparse.layers.row_storage import cache_copies

_BUILDS = {}  # label -> stores opened in this process (`shared_seed`)


def _world():
    """``(torch.distributed module, processes)``; 1 when not running."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return dist, 1
    return dist, dist.get_world_size()


def training_group(name):
    """The DDP process group a training call of table ``name`` gathers its
    batch over, or None (one process, or processes updating independent
    tables: `ALLOW_LOCAL_UPDATES` outside DDP). Raises before the cache
    changes what the lookup would refuse (several processes, no DDP)."""
    from keras_sparse.ops.torch import distributed as torch_distributed

    _, world = _world()
    if world == 1:
        return None
    torch_distributed.check_replicated_training(name, False)
    ddp = torch_distributed.active_ddp()
    return None if ddp is None else ddp.process_group


def shared_seed(label, seed):
    """``seed`` (drawn for an unseeded initializer) or, across
    torch.distributed processes, the seed the first process to open the
    ``k``-th store of table ``label`` drew: every process's ``k``-th store
    then starts from the same rows. The processes' key-value store carries
    it, so no process waits on another (a process may build alone)."""
    dist, world = _world()
    if world == 1:
        return seed
    count = _BUILDS[label] = _BUILDS.get(label, 0) + 1
    try:
        store = dist.distributed_c10d._get_default_store()
        key = f"keras_sparse/cache_seed/{label}/{count}"
        shared = store.compare_set(key, "", str(int(seed)))
        return int(shared)
    except Exception:  # noqa: BLE001  (no shared store: `check_copies` tells)
        return seed


def gather(group, flat, use):
    """``(ids, use, start)``: every process's flat ``ids`` and ``use`` in
    rank order (each padded to the longest with unused positions), and
    where this process's positions start in them."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = int(flat.shape[0])
    # On the ids' device, as the backend's collectives want them.
    count = torch.tensor([n], dtype=torch.int64, device=flat.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    longest = max(int(c) for c in counts)
    ids = torch.zeros(longest, dtype=torch.int64, device=flat.device)
    used = torch.zeros(longest, dtype=torch.int32, device=flat.device)
    ids[:n] = flat.detach().long()
    used[:n] = use.detach().int()
    parts = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(parts, ids, group=group)
    flags = [torch.empty_like(used) for _ in range(world)]
    dist.all_gather(flags, used, group=group)
    return torch.cat(parts), torch.cat(flags).bool(), longest * rank


def check_copies(cache, group):
    """Raises ValueError naming the table when the processes' copies of
    ``cache`` differ (their stores' rows, their id maps, their cache
    variables) or when processes of one machine share a disk store's
    folder (`cache_copies`); once per process group (every process raises
    alike)."""
    import torch.distributed as dist
    from keras import ops

    checked = cache.__dict__.setdefault("_checked_groups", set())
    if id(group) in checked:
        return
    world = dist.get_world_size(group)
    variables = [cache.embeddings, *cache.slots.values()]
    mine = cache_copies.identity(cache, [ops.convert_to_numpy(v) for v in variables])
    found = [None] * world
    dist.all_gather_object(found, mine, group=group)
    cache_copies.refuse_differing(
        found,
        (mine[0], cache_copies.folder(cache)),
        f"Layer '{cache.owner_name}': `cache_rows` under torch.distributed "
        f"with {world} processes",
        "ks.store.Disk(f'{path}/rank{rank}')",
        "Build the layer after init_process_group in every process (an "
        "unseeded initializer then gets one seed)",
    )
    checked.add(id(group))
