"""PyTorch: a key-sharded hash layer's keys become rows on their owners.

Process ``d`` of ``D`` (the tables' process group) holds shard ``d`` of the
layer's `keras_sparse.table.ShardedHashTable` and rows ``[d * B, (d + 1) *
B)`` of its table and slots. Every call (training and inference) runs:

```
local keys ─► distinct used keys per owner (first-occurrence order) with
              their multiplicities ─► all_to_all_single(counts), then
              all_to_all_single(keys and multiplicities)
          ─► owner: one table call on the received keys (source rank major,
              each repeated by its multiplicity, so admission and LFU count
              every sighting, and the shard sees its keys as one run over
              the global batch would) ─► fresh rows drawn per key and
              re-initialized (values and slots) here, on the owner
          ─► all_to_all_single(global row and fresh flag) back
          ─► row per position
```

The rows are then looked up with the row-sharded primitive
(`keras_sparse.sharding.torch_sharded_lookup`), after the re-initialization.

Bytes one process hands to the collectives per call for ``m`` distinct keys
(``n`` positions): ``8 D`` (counts) ``+ 16 m`` (keys, multiplicities) ``+ 8
m`` (rows and fresh flags back), then the row lookup's (``4 D (3 + C) + 4
n dim``, and ``4 n dim`` gradients in training; see `torch_sharded_lookup`).
"""

import numpy as np
import torch

from keras_sparse.layers.hash.key_mapper import MappedKeys
from keras_sparse.layers.hash.key_mapper import UndoCollector
from keras_sparse.sharding.torch_sharded_lookup import _counts
from keras_sparse.sharding.torch_sharded_lookup import _exchange
from keras_sparse.table.keys import to_host
from keras_sparse.table.sharded_table import key_words
from keras_sparse.table.sharded_table import owner_of


def route(full, use, d):
    """Source half for one process's flat int64 ``full`` keys and bool ``use``.

    Returns ``(keys, counts, per_owner, where, first)``: the distinct used
    keys, owner major and first occurrence minor, with their multiplicities;
    how many go to each owner; each position's index into ``keys`` (-1
    where unused); True at the first position of each distinct key.
    """
    n = full.shape[0]
    where = np.full(n, -1, np.int64)
    first = np.zeros(n, bool)
    at = np.flatnonzero(use)
    if not at.size:
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(d, np.int64), where, first
    uniq, first_at, inverse, counts = np.unique(
        full[at], return_index=True, return_inverse=True, return_counts=True
    )
    arrival = np.argsort(first_at, kind="stable")  # distinct keys, batch order
    owner = owner_of(uniq[arrival], d)
    sent = arrival[np.argsort(owner, kind="stable")]  # owner major
    index = np.empty(len(uniq), np.int64)
    index[sent] = np.arange(len(uniq))
    where[at] = index[inverse.reshape(-1)]
    first[at[first_at]] = True
    return uniq[sent], counts[sent], np.bincount(owner, minlength=d), where, first


def owner_rows(shard, keys, counts, insert, row_tier=None):
    """Owner half: ``(local rows [m] int64, fresh [m] bool)`` of the received
    distinct-per-source ``keys`` (source major) and multiplicities.
    ``row_tier``: the shard's `keras_sparse.layers.row_tier.RowTier`, which
    records a training call's row moves (its evicted keys go down to the
    shard's store)."""
    fresh = np.zeros(len(keys), bool)
    repeated = np.repeat(keys, counts)
    starts = np.cumsum(counts) - counts
    if not insert:
        # A read (inference, a frozen layer): not counted in stats().
        rows = to_host(shard.lookup(repeated, count=False))
        return rows[starts].astype(np.int64), fresh
    undo = None if row_tier is None else UndoCollector()
    res, new = shard.lookup_or_insert_fresh(repeated, undo=undo)
    rows = to_host(res.rows)[starts].astype(np.int64)
    # A key sent by several processes is fresh once: at its first entry.
    _, once = np.unique(keys, return_index=True)
    fresh[once] = to_host(new)[starts][once]
    if row_tier is not None:
        row_tier.record(MappedKeys.of_table_call(keys, rows, fresh, undo.record))
    return rows, fresh


def reset_on_owner(layer, part, keys, rows, fresh, draw, row_tier=None):
    """Writes the first vectors of the ``fresh`` received keys (drawn per key
    by ``draw=(fn, seed)``) to their local ``rows`` of this process's part,
    and their slots to initial values. With the shard's ``row_tier``, its
    moves come first: the keys this call evicted are written back from
    their rows, and rows whose keys the store holds are filled from it
    (values and slots) instead."""
    from keras_sparse.ops.torch import lookup as torch_lookup

    state = {"table": part}
    state.update({name: var.value for name, var in layer.slots.items()})
    if row_tier is not None:
        fresh = fresh & ~_move_on_owner(row_tier, state, rows, fresh)
    if draw is None or not fresh.any():
        return
    at = np.flatnonzero(fresh)
    device = part.device
    words = torch.as_tensor(key_words(keys[at]), device=device)
    mask = torch.ones(len(at), dtype=torch.bool, device=device)
    values = draw[0](mask, words, draw[1])
    ids = torch.as_tensor(rows[at], device=device)
    torch_lookup.reset_rows(state, layer.sparse_optimizer, ids, mask, values)


def _move_on_owner(tier, state, rows, fresh):
    """`RowTier.move` of the owner's local ``rows``: writes the filled
    rows' values and slots into ``state``; returns the filled mask."""
    safe = torch.as_tensor(np.where(fresh, rows, 0))
    with torch.no_grad():
        before = {
            name: value[safe.to(value.device)].cpu().numpy()
            for name, value in state.items()
        }
        filled, fills = tier.move(rows, fresh, before)
        if filled.any():
            at = np.flatnonzero(filled)
            for name, value in state.items():
                ids = torch.as_tensor(rows[at], device=value.device)
                value[ids] = torch.as_tensor(fills[name][at], device=value.device)
    return filled


def _link_device(group):
    """Where the exchanged tensors live: NCCL moves GPU tensors only (the
    keys are mapped on the host either way)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def map_keys(placement, layer, keys, use, insert, draw):
    """``(rows int32 [n], fresh bool [n])`` torch tensors of a key-sharded
    layer's flat ``keys`` (any framework) and ``use``; see the module note.
    Every process of ``placement.group`` must call it together."""
    from keras_sparse.layers.hash.host_keys import host_array
    from keras_sparse.layers.hash.host_keys import host_keys

    group, d, me = placement.group, placement.devices, placement.rank
    full = host_keys(keys)
    use = host_array(use).astype(bool).reshape(-1)
    sent, counts, per_owner, where, first = route(full, use, d)
    cpu = torch.device("cpu")
    link = _link_device(group)
    send = per_owner.tolist()
    recv = _counts(send, group, link)
    pairs = torch.as_tensor(np.stack([sent, counts], axis=1)).to(link)
    got = _exchange(pairs, send, recv, group).cpu().numpy()
    got_keys, got_counts = got[:, 0].copy(), got[:, 1].copy()
    table = layer.table
    tier = None if layer.row_tier is None else layer.row_tier.shard(me)
    with table._lock, table.on_device(me):
        local, fresh = owner_rows(
            table.shard(me), got_keys, got_counts, insert, tier if insert else None
        )
        if insert:
            part = layer.embeddings.value
            reset_on_owner(layer, part, got_keys, local, fresh, draw, tier)
    shard_rows = table.shard_rows
    code = np.where(local >= 0, (local + me * shard_rows + 1) * 2 + fresh, 0)
    back = _exchange(torch.as_tensor(code).to(link), recv, send, group)
    back = back.cpu().numpy()
    rows = np.full(full.shape[0], -1, np.int64)
    fresh_at = np.zeros(full.shape[0], bool)
    used = where >= 0
    rows[used] = back[where[used]] // 2 - 1
    fresh_at[used] = (back[where[used]] % 2 == 1) & first[used]
    device = getattr(keys, "device", None)
    device = device if isinstance(device, torch.device) else cpu
    return (
        torch.as_tensor(rows.astype(np.int32), device=device),
        torch.as_tensor(fresh_at, device=device),
    )


def read_stored(placement, layer, keys, rows):
    """``(found bool [n], values [n, dim])`` torch tensors of a read-only
    call: where a key without a row (``rows`` -1) is held by its owner's
    store, and its stored vector. Each distinct such key goes to its owner,
    which reads its shard's store and sends the vector back; every process
    of ``placement.group`` must call it together."""
    from keras_sparse.layers.hash.host_keys import host_array
    from keras_sparse.layers.hash.host_keys import host_keys

    group, d, me = placement.group, placement.devices, placement.rank
    full = host_keys(keys)
    step_rows = host_array(rows).reshape(-1)
    sent, _, per_owner, where, _ = route(full, step_rows == -1, d)
    link = _link_device(group)
    send = per_owner.tolist()
    recv = _counts(send, group, link)
    got = _exchange(torch.as_tensor(sent).to(link), send, recv, group)
    got = got.cpu().numpy()
    dtype = np.dtype(str(layer.embeddings.dtype).split(".")[-1])
    hit, values = layer.row_tier.shard(me).read_missing(
        got, np.full(got.shape[0], -1), dtype
    )
    answer = np.concatenate([hit[:, None].astype(dtype), values], axis=1)
    back = _exchange(torch.as_tensor(answer).to(link), recv, send, group)
    back = back.cpu().numpy()
    n = full.shape[0]
    found = np.zeros(n, bool)
    out = np.zeros((n, layer.output_dim), dtype)
    used = where >= 0
    found[used] = back[where[used], 0] > 0
    out[used] = back[where[used], 1:]
    device = getattr(keys, "device", None)
    device = device if isinstance(device, torch.device) else torch.device("cpu")
    return torch.as_tensor(found, device=device), torch.as_tensor(out, device=device)
