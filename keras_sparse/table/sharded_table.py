"""Key-owned shards: ``D`` hash tables, each owning the keys that hash to it.

A key's owner is `owner_of`: a fixed 64-bit mix of the key (splitmix64 with
the salt `OWNER_SALT`, independent of any table seed), reduced to ``[0, D)``
by a multiply-shift of its high 32 bits. It depends only on the key and
``D``, so it is the same in every run, process and on every platform.

Shard ``d`` is an ordinary `HashTable` of ``B`` rows (``capacity / D``
rounded up to whole buckets); its local row ``r`` is global row ``d * B +
r``, so a ``[D * B, dim]`` table row-sharded over ``D`` devices holds each
shard's rows on its owner device. Every shard has its own eviction state: a
full shard evicts among its own keys only, even when another shard has free
rows (per-shard LRU/LFU). Each shard counts the sightings of the keys it
owns that are not admitted yet (`keras_sparse.table.admission`, exact), so
admission is the same for any shard count; the merged state is the union of
the shards' pending keys, and a load routes each key to its owner.

Each call reaches every local shard (with no keys if none are its), so the
shards' LRU clocks advance together and a batch means the same step
everywhere. Each shard's part of a call is atomic, as a `HashTable` call is;
a call refused by one shard (a full shard with ``eviction=None``, more
distinct keys than a shard has rows, a row outside a key's buckets) raises
naming the shard, and shards that took their keys before it keep them
(with ``eviction=None`` and ``admit_after=1`` a full shard is detected before
any shard changes).

Example:
    >>> import numpy as np
    >>> table = ShardedHashTable(256, num_shards=4, device="cpu")
    >>> rows = table.lookup_or_insert(np.array([7, 8, 7])).rows
    >>> bool(rows[0] == rows[2]), table.shard_rows
    (True, 64)
    >>> int(rows[0]) // table.shard_rows == int(owner_of(np.array([7]), 4)[0])
    True
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from .call_results import InsertResult
from .call_results import TableFullError
from .hash_table import HashTable
from .keys import mix64
from .keys import to_host
from .keys import to_numpy_keys
from .scores import check_scores

__all__ = ["OWNER_SALT", "ShardedHashTable", "key_words", "keys_of_words", "owner_of"]

#: Salt of the owner hash (the fractional bits of sqrt(3)); never change it:
#: checkpoints and running jobs route keys by it.
OWNER_SALT = np.uint64(0xBB67AE8584CAA73B)


def owner_of(keys, num_shards):
    """Owner shard (int32) of every int64 key, in ``[0, num_shards)``."""
    keys = np.asarray(keys, dtype=np.int64)
    h = mix64(keys.view(np.uint64), OWNER_SALT)
    high = h >> np.uint64(32)
    return ((high * np.uint64(num_shards)) >> np.uint64(32)).astype(np.int32)


_LOW = np.uint64(0xFFFFFFFF)


def key_words(keys):
    """int64 keys -> ``[n, 2]`` int32 (high word, low word): how 64-bit keys
    travel through 32-bit device arrays."""
    u = np.asarray(keys, dtype=np.int64).view(np.uint64)
    hi = (u >> np.uint64(32)).astype(np.uint32).view(np.int32)
    lo = (u & _LOW).astype(np.uint32).view(np.int32)
    return np.stack([hi, lo], axis=-1)


def keys_of_words(words):
    """Inverse of `key_words`."""
    words = np.asarray(words)
    hi = words[..., 0].view(np.uint32).astype(np.uint64)
    lo = words[..., 1].view(np.uint32).astype(np.uint64)
    return ((hi << np.uint64(32)) | lo).view(np.int64)


class _ShardClock:
    """The shards' common LRU clock and merged admission counts, where the layer's
    checkpoint code reads one table's (``table._impl``)."""

    def __init__(self, table):
        self._table = table

    @property
    def clock(self):
        return max(t._impl.clock for t in self._table.local_shards())

    @clock.setter
    def clock(self, value):
        for t in self._table.local_shards():
            t._impl.clock = int(value)

    @property
    def admission(self):
        first = self._table.local_shards()[0]
        if getattr(first._impl, "admission", None) is None:
            return None
        return _MergedCounts(self._table)


class _MergedCounts:
    """The local shards' pending admission counts seen as one."""

    def __init__(self, table):
        self._table = table

    def state(self):
        """``(keys, counts)`` of every local shard (disjoint: owned keys)."""
        parts = [t._impl.admission.state() for t in self._table.local_shards()]
        keys = np.concatenate([p[0] for p in parts])
        counts = np.concatenate([p[1] for p in parts])
        order = np.argsort(keys, kind="stable")
        return keys[order], counts[order]

    def load_state(self, keys, counts):
        """Each local shard takes the keys it owns; returns how many were
        kept (keys of other processes' shards are theirs to load)."""
        keys = np.asarray(keys, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        owner = owner_of(keys, self._table.num_shards)
        kept = 0
        for d in self._table.local:
            mine = owner == d
            with self._table.on_device(d):
                pending = self._table.shard(d)._impl.admission
                kept += pending.load_state(keys[mine], counts[mine])
        return kept


class ShardedHashTable:
    """``num_shards`` `HashTable` shards behind the `HashTable` interface.

    Rows are global (``shard * shard_rows + local row``). ``local`` lists the
    shards this process holds (default: all); keys owned by other shards are
    refused by the calls of this object (a multi-process step reaches each
    shard on its own process, see `shard`).

    Args:
        capacity: total rows wanted; each shard gets ``ceil(capacity /
            num_shards)`` rounded up to whole buckets (``shard_rows``), so
            ``capacity`` reports ``num_shards * shard_rows``.
        num_shards: ``D`` (the devices of a key-sharded layer).
        local: shard indices held here, or None for all.
        bucket_size: as for `HashTable`, the same for every shard.
        eviction: as for `HashTable`.
        admit_after: as for `HashTable`.
        device: as for `HashTable`.
        seed: as for `HashTable`.
        ttl_steps: as for `HashTable`; the shards' clocks advance together,
            so a key expires at the same step on any shard count.
        track_changes: as for `HashTable`.
        gpus: with ``device="gpu"``, a dict ``{shard: CUDA device}``
            (shards it leaves out live on device 0).
    """

    def __init__(
        self,
        capacity,
        num_shards,
        *,
        local=None,
        bucket_size=None,
        eviction="lru",
        admit_after=1,
        device="cpu",
        seed=0,
        gpus=None,
        ttl_steps=None,
        track_changes=False,
    ):
        if isinstance(num_shards, bool) or int(num_shards) < 1:
            raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
        self.num_shards = int(num_shards)
        self.local = tuple(range(self.num_shards) if local is None else local)
        per_shard = -(-int(capacity) // self.num_shards)
        # GPU shards: shard d on CUDA device gpus[d] (default 0).
        self._gpus = None if device == "cpu" else dict(gpus or {})
        self._shards = {}
        for d in self.local:
            with self.on_device(d):
                self._shards[d] = HashTable(
                    per_shard,
                    bucket_size=bucket_size,
                    eviction=eviction,
                    admit_after=admit_after,
                    device=device,
                    seed=seed,
                    ttl_steps=ttl_steps,
                    track_changes=track_changes,
                )
        first = self._shards[self.local[0]]
        self.shard_rows = first.capacity
        self._lock = threading.RLock()
        self._impl = _ShardClock(self)

    # ------------------------------------------------------------ properties
    def _first(self):
        return self._shards[self.local[0]]

    capacity = property(lambda self: self.num_shards * self.shard_rows)
    bucket_size = property(lambda self: self._first().bucket_size)
    num_buckets = property(lambda self: self.num_shards * self._first().num_buckets)
    eviction = property(lambda self: self._first().eviction)
    admit_after = property(lambda self: self._first().admit_after)
    device = property(lambda self: self._first().device)
    seed = property(lambda self: self._first().seed)
    ttl_steps = property(lambda self: self._first().ttl_steps)
    track_changes = property(lambda self: self._first().track_changes)

    @property
    def size(self):
        return sum(t.size for t in self._shards.values())

    @property
    def load_factor(self):
        return self.size / (self.shard_rows * len(self.local))

    @property
    def version(self):
        """Grows whenever a local shard's key->row map changes (see
        `HashTable.version`)."""
        return sum(t.version for t in self._shards.values())

    def __len__(self):
        return self.size

    def __repr__(self):
        return (
            f"ShardedHashTable(capacity={self.capacity}, num_shards="
            f"{self.num_shards}, local={len(self.local)}, eviction="
            f"{self.eviction!r}, size={self.size})"
        )

    def shard(self, index):
        """The `HashTable` of shard ``index`` (local rows); call it inside
        `on_device` (its results are CuPy arrays on a GPU shard)."""
        return self._shards[index]

    def on_device(self, index):
        """Context on the CUDA device of GPU shard ``index`` (a no-op for
        CPU shards)."""
        if self._gpus is None:
            return contextlib.nullcontext()
        import cupy

        return cupy.cuda.Device(self._gpus.get(index, 0))

    def local_shards(self):
        return [self._shards[d] for d in self.local]

    # ---------------------------------------------------------------- calls
    def _split(self, keys):
        """(flat int64 keys, shape, owner per key, {shard: positions})."""
        k, shape = to_numpy_keys(keys, "keys")
        owner = owner_of(k, self.num_shards)
        foreign = ~np.isin(owner, self.local)
        if foreign.any():
            raise ValueError(
                f"{int(foreign.sum())} keys belong to shards this process does "
                f"not hold (it holds {list(self.local)} of {self.num_shards})."
            )
        return k, shape, {d: np.flatnonzero(owner == d) for d in self.local}

    def _global(self, d, rows):
        rows = to_host(rows).astype(np.int64)
        return np.where(rows >= 0, rows + d * self.shard_rows, -1)

    def lookup(self, keys, count=True):
        k, shape, parts = self._split(keys)
        out = np.full(k.shape, -1, np.int64)
        with self._lock:
            for d, at in parts.items():
                with self.on_device(d):
                    found = self._shards[d].lookup(k[at], count)
                    out[at] = self._global(d, found)
        return out.reshape(shape)

    def lookup_or_insert_fresh(self, keys, step=None):
        """As `HashTable.lookup_or_insert_fresh`, with global rows; every
        local shard is called (its keys, maybe none) so clocks stay equal."""
        k, shape, parts = self._split(keys)
        rows = np.full(k.shape, -1, np.int64)
        fresh = np.zeros(k.shape, bool)
        new, ev_keys, ev_rows = [], [], []
        with self._lock:
            # A shard refusing its batch (full with eviction=None) must leave
            # every shard unchanged: check all before any inserts.
            for d, at in parts.items():
                self._check_fits(d, k[at])
            for d, at in parts.items():
                with self.on_device(d):
                    res, f = self._shards[d].lookup_or_insert_fresh(k[at], step)
                rows[at] = self._global(d, res.rows)
                fresh[at] = to_host(f)
                new.append(self._global(d, res.new_rows))
                ev_keys.append(to_host(res.evicted_keys))
                ev_rows.append(self._global(d, res.evicted_rows))
        result = InsertResult(
            rows.reshape(shape),
            np.concatenate(new),
            np.concatenate(ev_keys),
            np.concatenate(ev_rows),
        )
        return result, fresh.reshape(shape)

    def lookup_or_insert(self, keys, step=None):
        return self.lookup_or_insert_fresh(keys, step)[0]

    def _check_fits(self, d, keys):
        """Raises what shard ``d``'s call would raise for a batch that
        cannot fit (eviction=None and too few free rows), before any shard
        changes: the same `TableFullError` the table gives."""
        table = self._shards[d]
        if table.eviction is not None or not len(keys):
            return
        with self.on_device(d):
            found = to_host(table.lookup(keys, count=False))  # a probe
        missing = np.unique(keys[found < 0])
        free = table.capacity - table.size
        if len(missing) > free and table.admit_after == 1:
            raise TableFullError(
                f"shard {d} of {self.num_shards}: {len(missing)} new keys, "
                f"{free} free rows (shard capacity {table.capacity})"
            )

    def erase(self, keys):
        k, _, parts = self._split(keys)
        with self._lock:
            erased = 0
            for d, at in parts.items():
                with self.on_device(d):
                    erased += self._shards[d].erase(k[at])
            return erased

    def export(self):
        """``(keys, global rows, scores)`` of the local shards' entries."""
        keys, rows, scores = [], [], []
        with self._lock:
            for d in self.local:
                with self.on_device(d):
                    k, r, s = (to_host(x) for x in self._shards[d].export())
                keys.append(k.astype(np.int64))
                rows.append(self._global(d, r))
                scores.append(s)
        return np.concatenate(keys), np.concatenate(rows), np.concatenate(scores)

    def import_(self, keys, rows=None, scores=None):
        """As `HashTable.import_`; ``rows`` are global and must lie in the
        keys' owner shards."""
        k, shape, parts = self._split(keys)
        if rows is not None:
            rows = np.asarray(rows, dtype=np.int64).reshape(-1)
            wrong = (rows // self.shard_rows) != owner_of(k, self.num_shards)
            if rows.shape != k.shape or wrong.any():
                raise ValueError(
                    f"{int(np.sum(wrong))} rows lie outside their keys' owner "
                    f"shards ({self.shard_rows} rows per shard)."
                )
            # Rows outside a key's buckets are refused before any shard
            # changes (the shards would refuse them one after the other).
            b1, b2 = self.candidate_buckets(k)
            bucket = rows // self.bucket_size
            outside = (bucket != b1) & (bucket != b2)
            if outside.any():
                raise ValueError(
                    f"{int(outside.sum())} rows lie in neither candidate "
                    "bucket of their keys (another capacity, bucket size or "
                    "seed)."
                )
        if scores is not None:
            # Refused before any shard changes.
            scores, _ = to_numpy_keys(scores, "scores")
            check_scores(scores)
        out = np.full(k.shape, -1, np.int64)
        new, ev_keys, ev_rows = [], [], []
        with self._lock:
            for d, at in parts.items():
                local_rows = None if rows is None else rows[at] - d * self.shard_rows
                with self.on_device(d):
                    res = self._shards[d].import_(
                        k[at], local_rows, None if scores is None else scores[at]
                    )
                out[at] = self._global(d, res.rows)
                new.append(self._global(d, res.new_rows))
                ev_keys.append(to_host(res.evicted_keys))
                ev_rows.append(self._global(d, res.evicted_rows))
        return InsertResult(
            out.reshape(shape),
            np.concatenate(new),
            np.concatenate(ev_keys),
            np.concatenate(ev_rows),
        )

    def clear(self):
        with self._lock:
            for d, table in self._shards.items():
                with self.on_device(d):
                    table.clear()

    def stats(self):
        """Counters summed over the local shards, plus size, capacity (of
        all shards), load_factor (of the local ones) and ``shards``."""
        with self._lock:
            out = {}
            for table in self._shards.values():
                for name, value in table.stats().items():
                    if name not in ("size", "capacity", "load_factor"):
                        out[name] = out.get(name, 0) + value
            out.update(
                size=self.size,
                capacity=self.capacity,
                load_factor=self.load_factor,
                shards=self.num_shards,
            )
            return out

    def candidate_buckets(self, keys):
        """Global candidate buckets (``shard * shard_buckets + bucket``)."""
        k, shape, parts = self._split(keys)
        per_shard = self._first().num_buckets
        b1 = np.empty(k.shape, np.int64)
        b2 = np.empty(k.shape, np.int64)
        for d, at in parts.items():
            with self.on_device(d):
                c1, c2 = self._shards[d].candidate_buckets(k[at])
            b1[at] = to_host(c1) + d * per_shard
            b2[at] = to_host(c2) + d * per_shard
        return b1.reshape(shape), b2.reshape(shape)
