"""Locality-aware sample routing for data-parallel training on row-sharded tables.

With ``R`` data-parallel replicas and every embedding table row-sharded over
the same ``R`` devices (the owner of row ``r`` is ``r // rows_per_shard``,
``rows_per_shard = ceil(num_rows / R)``), every id looked up by a sample held
by replica ``p`` whose owner is not ``p`` crosses the network: the id goes to
its owner and the vector comes back in the forward pass, and the id and the
gradient go again in the backward pass. Keras' data parallelism hands replica
``p`` the contiguous block ``[p * B / R, (p + 1) * B / R)`` of each global
batch, so permuting the samples of a batch decides which replica trains them.

`locality_assignment` picks that permutation greedily, in the spirit of
Herald's location-aware sample allocation: each sample is scored per replica
by the (byte-weighted) number of its ids that replica owns; samples are
placed in order of their strongest preference, each on the replica with the
most local ids that still has room, with exactly ``B / R`` samples per
replica. It runs in at most ``R + 1`` vectorized rounds: in a round every
unplaced sample proposes to its best replica with room, and each replica
accepts its strongest proposals up to its remaining room (ties: lower
sample index first). The result is deterministic.

Across processes (JAX multi-process), each process holds only its part of a
global batch, which Keras splits over that process's own replicas; its stage
then routes over those (``local``: their positions among the ``R``), while
owners still count over all ``R`` shards: an id owned by another process's
replica is remote wherever this process puts its sample.

Example:

>>> import numpy as np
>>> owners = [np.array([[1, 1], [0, 0], [1, 0], [0, 0]])]
>>> perm = locality_assignment(owners, 2)
>>> perm.tolist()  # replica 0 gets samples 1, 3; replica 1 gets 0, 2
[1, 3, 0, 2]
"""

import numpy as np

__all__ = [
    "exchanged_bytes",
    "locality_assignment",
    "owner_counts",
    "rows_per_shard",
]


def rows_per_shard(num_rows, replicas):
    """Rows per shard when ``num_rows`` rows are split over ``replicas``."""
    return max(1, -(-int(num_rows) // int(replicas)))


def owner_counts(owners, replicas, weights=None):
    """``[B, R]`` float64: per sample, the (weighted) ids each replica owns.

    Args:
        owners: list of int arrays ``[B, ...]``, one per table; the owning
            replica of each id, ``-1`` for ids that are not looked up.
        replicas: ``R``.
        weights: optional per-table weight (e.g. bytes per remote id).
    """
    counts = None
    for t, own in enumerate(owners):
        own = np.asarray(own)
        b = own.shape[0]
        own = own.reshape(b, -1)
        w = 1.0 if weights is None else float(weights[t])
        if counts is None:
            counts = np.zeros((b, replicas), np.float64)
        ok = own >= 0
        sample = np.broadcast_to(np.arange(b)[:, None], own.shape)[ok]
        np.add.at(counts, (sample, own[ok]), w)
    return counts


def locality_assignment(owners, replicas, weights=None, local=None):
    """Permutation of a batch's samples; block ``p`` goes to replica ``p``.

    Returns ``perm`` (int64 ``[B]``) such that ``batch[perm]`` puts on replica
    ``p`` (samples ``perm[p*B/R:(p+1)*B/R]``) the samples placed there. Each
    block keeps its samples in their original order. If ``B`` is not a
    multiple of ``R`` the identity is returned.

    ``local``: the replicas this batch is split over, in block order (one
    process's replicas in a multi-process run); block ``q`` goes to replica
    ``local[q]``. None: all ``R``.
    """
    counts = owner_counts(owners, replicas, weights)
    if local is not None:
        counts = counts[:, _local(local, replicas)]
        replicas = counts.shape[1]
    b = counts.shape[0]
    if replicas <= 1 or b % replicas:
        return np.arange(b)
    room = np.full(replicas, b // replicas, np.int64)
    placed = np.full(b, -1, np.int64)
    pending = np.arange(b)
    while pending.size:
        score = counts[pending].copy()
        score[:, room == 0] = -np.inf
        best = np.argmax(score, axis=1)
        strength = score[np.arange(pending.size), best]
        accepted = np.zeros(pending.size, bool)
        for p in np.unique(best):
            cand = np.flatnonzero(best == p)
            # Strongest preference first; stable, so lower index wins ties.
            cand = cand[np.argsort(-strength[cand], kind="stable")][: room[p]]
            placed[pending[cand]] = p
            room[p] -= cand.size
            accepted[cand] = True
        pending = pending[~accepted]
    return np.argsort(placed, kind="stable")


def exchanged_bytes(owners, replicas, bytes_per_id, perm=None, local=None):
    """All-to-all bytes of one step: remote ids x bytes per remote id.

    ``owners`` as in `owner_counts`; ``bytes_per_id[t]`` is the cost of one
    remote id of table ``t`` (see `remote_id_bytes`); ``perm`` the routing
    permutation (None: Keras' default contiguous split); ``local`` as in
    `locality_assignment`. Returns an int.
    """
    total = 0
    first = np.asarray(owners[0])
    b = first.shape[0]
    local = np.arange(replicas) if local is None else _local(local, replicas)
    if b % local.size:
        return 0
    holder = np.repeat(local, b // local.size)
    if perm is not None:
        inverse = np.empty(b, np.int64)
        inverse[np.asarray(perm)] = np.arange(b)
        holder = holder[inverse]  # replica holding original sample i
    for t, own in enumerate(owners):
        own = np.asarray(own).reshape(b, -1)
        remote = (own >= 0) & (own != holder[:, None])
        total += int(remote.sum()) * int(bytes_per_id[t])
    return total


def _local(local, replicas):
    local = np.asarray(local, np.int64).reshape(-1)
    if local.size == 0 or local.min() < 0 or local.max() >= replicas:
        raise ValueError(
            f"locality routing: `local` replicas must be a non-empty list of "
            f"positions in [0, {replicas}); got {local.tolist()}"
        )
    return local


def remote_id_bytes(dim, id_bytes=4, value_bytes=4):
    """Bytes one remote id costs per step: (id + vector) forward + (id +
    gradient) backward."""
    return 2 * (int(id_bytes) + int(dim) * int(value_bytes))
