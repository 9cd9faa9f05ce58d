"""A table with ``cache_rows`` trained by several processes, a copy of the
cache in every process, all equal: torch.distributed processes under
DistributedDataParallel, and a Keras distribution over several JAX
processes (`cache_jax_processes`, its step's host route).

Each process holds its own id map, store and cache variables, started
from identical contents: the store's initial rows are drawn per id from
the initializer's seed (`shared_seed` gives an unseeded initializer the
same seed in every process) and `check_copies` compares the copies once,
before the first training step of the processes. In each training step
every process sees the whole batch's ids in one order (PyTorch: all-
gathered in rank order, `gather`), maps the whole batch with its own map
(so every copy makes the same mapping, fills and write-backs) and looks
up its own positions; the sparse update sums every process's gradients
(`keras_sparse.ops.torch.distributed`, JAX's cross-device sums), so every
copy applies the whole batch's update, as a table without a cache does.
"""

import keras

from keras_sparse.layers.row_storage import cache_copies
from keras_sparse.layers.row_storage import cache_jax_processes

_BUILDS = {}  # label -> stores opened in this process (`shared_seed`)
_CHECKS = {}  # label -> copies checked in this process (JAX, `check_copies`)


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
    """``seed`` (drawn for an unseeded initializer) or, across processes
    (torch.distributed, JAX), the seed the first process to open the
    ``k``-th store of table ``label`` drew: every process's ``k``-th store
    then starts from the same rows. The processes' key-value store carries
    it, so no process waits on another (a process may build alone)."""
    if _processes() == 1:
        return seed
    count = _BUILDS[label] = _BUILDS.get(label, 0) + 1
    key = f"cache_seed/{label}/{count}"
    try:
        if keras.backend.backend() == "jax":
            return int(cache_jax_processes.compare_set(key, str(int(seed))))
        store = _world()[0].distributed_c10d._get_default_store()
        return int(store.compare_set(f"keras_sparse/{key}", "", str(int(seed))))
    except Exception:  # noqa: BLE001  (no shared store: `check_copies` tells)
        return seed


def _processes():
    """The processes holding copies of a cache on this backend (1: one)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.process_count()
    if backend == "torch":
        return _world()[1]
    return 1


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


def check_copies(cache, group=None):
    """Raises ValueError naming the table when the processes' copies of
    ``cache`` differ (their stores' rows, their id maps, their cache
    variables) or when processes of one machine share a disk store's
    folder (`cache_copies`); once per process group (every process raises
    alike). ``group``: the torch.distributed group; None: the JAX
    processes."""
    from keras import ops

    checked = cache.__dict__.setdefault("_checked_groups", set())
    if id(group) in checked:
        return
    variables = [cache.embeddings, *cache.slots.values()]
    mine = cache_copies.identity(cache, [ops.convert_to_numpy(v) for v in variables])
    if group is None:  # JAX: through the processes' key-value store
        count = _CHECKS[cache.owner_name] = _CHECKS.get(cache.owner_name, 0) + 1
        key = f"cache_copies/{cache.owner_name}/{count}"
        found = [
            (None if folder is None else tuple(folder), digest)  # JSON: lists
            for folder, digest in cache_jax_processes.all_gather_object(key, mine)
        ]
        what, start = "JAX processes", "jax.distributed.initialize"
    else:
        import torch.distributed as dist

        found = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, mine, group=group)
        what, start = "processes", "init_process_group"
    cache_copies.refuse_differing(
        found,
        (mine[0], cache_copies.folder(cache)),
        f"Layer '{cache.owner_name}': `cache_rows` under "
        f"{_backend_words()} with {len(found)} {what}",
        "ks.store.Disk(f'{path}/rank{rank}')",
        f"Build the layer after {start} in every process (an unseeded "
        "initializer then gets one seed)",
    )
    checked.add(id(group))


def _backend_words():
    if keras.backend.backend() == "jax":
        return "a Keras distribution"
    return "torch.distributed"
