"""The row stores under a key-sharded hash layer: one `RowTier` per shard.

Under ``sharding="key"`` each device owns the keys hashing to it
(`keras_sparse.table.owner_of`), with its own table shard and block of
``shard_rows`` rows; a key never moves to another shard. So each shard's
evicted keys go down to a store of its own, and each shard's tier records
the plans of that shard's table calls (made on the owner, inside the
step: `keras_sparse.sharding.jax_key_mapping`). A step's moves split by
row block: shard ``d`` moves the fresh rows ``[d * B, (d + 1) * B)`` with
its own plan, in its own local rows. Training equals training with a
key-sharded table large enough for every key, shard by shard.

`ShardedRowTier` offers what the layer uses of a `RowTier` (moves,
read-only reads, export, save and load); its ``store`` routes keys to the
shards' stores by owner.
"""

import json
import os
import threading

import numpy as np

from keras_sparse.layers.record_checks import subset
from keras_sparse.table.sharded_table import owner_of

#: File in a shard's disk store folder: which shard of how many it serves.
SHARD_FILE = "key_shard.json"


class ShardStores:
    """The shards' stores as one keyed store: each key lives in its owner's
    store (the `RowStore` calls a layer's export, save and load make)."""

    def __init__(self, stores, num_shards):
        self.stores = dict(stores)  # shard -> store (this process's shards)
        self.num_shards = int(num_shards)

    @property
    def fields(self):
        return next(iter(self.stores.values())).fields

    @property
    def size(self):
        return sum(int(s.size) for s in self.stores.values())

    @property
    def nbytes(self):
        return sum(int(s.nbytes) for s in self.stores.values())

    def _parts(self, keys):
        keys = np.asarray(keys, np.int64).reshape(-1)
        owner = owner_of(keys, self.num_shards)
        foreign = ~np.isin(owner, list(self.stores))
        if foreign.any():
            raise ValueError(
                f"{int(foreign.sum())} keys belong to shards whose stores this "
                f"process does not hold (it holds {sorted(self.stores)} of "
                f"{self.num_shards})."
            )
        return keys, {d: np.flatnonzero(owner == d) for d in self.stores}

    def read(self, keys):
        keys, parts = self._parts(keys)
        found = np.zeros(keys.shape[0], bool)
        rows = {
            f.name: np.zeros((keys.shape[0], f.width), f.dtype) for f in self.fields
        }
        for d, at in parts.items():
            if at.size:
                hit, got = self.stores[d].read(keys[at])
                found[at] = hit
                for name in rows:
                    rows[name][at] = got[name]
        return found, rows

    def write(self, keys, rows):
        keys, parts = self._parts(keys)
        for d, at in parts.items():
            if at.size:
                self.stores[d].write(keys[at], {k: v[at] for k, v in rows.items()})

    def erase(self, keys):
        keys, parts = self._parts(keys)
        return sum(
            int(self.stores[d].erase(keys[at])) for d, at in parts.items() if at.size
        )

    def contains(self, keys):
        keys, parts = self._parts(keys)
        out = np.zeros(keys.shape[0], bool)
        for d, at in parts.items():
            if at.size:
                out[at] = self.stores[d].contains(keys[at])
        return out

    def chunks(self, rows_per_chunk=65536):
        for d in sorted(self.stores):
            yield from self.stores[d].chunks(rows_per_chunk)

    def clear(self):
        for store in self.stores.values():
            store.clear()

    def flush(self):
        for store in self.stores.values():
            store.flush()

    def close(self):
        for store in self.stores.values():
            store.close()

    def stats(self):
        return {"size": self.size, "nbytes": self.nbytes}


class ShardedRowTier:
    """A `RowTier` per table shard of a key-sharded layer (see the module)."""

    dense = False

    def __init__(self, layer_name, shards, num_shards, shard_rows):
        # shard -> its `RowTier` (this process's shards), in local rows.
        self.layer_name = layer_name
        self.shards = dict(shards)
        self.store = ShardStores(
            {d: tier.store for d, tier in self.shards.items()}, num_shards
        )
        self.num_shards = int(num_shards)
        self.shard_rows = int(shard_rows)
        self.scored = next(iter(self.shards.values())).scored
        # Held while the whole layer's stores are read or replaced (save,
        # load); each shard's moves take its own tier's lock.
        self.lock = threading.RLock()
        self.read_keys = None

    def shard(self, index):
        """Shard ``index``'s `RowTier` (its plans are in local rows)."""
        return self.shards[int(index)]

    def move(self, rows, fresh, before):
        """`RowTier.move` of a step's global ``rows``: each shard moves the
        fresh rows of its block with its own plan (every shard's call made
        one, maybe empty, so every shard pops one)."""
        rows = np.asarray(rows).reshape(-1).astype(np.int64)
        fresh = np.asarray(fresh, bool).reshape(-1)
        n = rows.shape[0]
        filled = np.zeros(n, bool)
        fills = {
            name: np.zeros((n,) + value.shape[1:], value.dtype)
            for name, value in before.items()
        }
        block = np.where(fresh, rows // self.shard_rows, -1)
        for d in sorted(self.shards):
            at = np.flatnonzero(block == d)
            local = rows[at] - d * self.shard_rows
            got, moved = self.shards[d].move(
                local,
                np.ones(at.size, bool),
                {name: value[at] for name, value in before.items()},
            )
            filled[at] = got
            for name in fills:
                fills[name][at] = moved[name]
        return filled, fills

    def read_missing(self, keys, rows, dtype):
        """`RowTier.read_missing`, each key read from its owner's store."""
        keys = np.asarray(keys, np.int64).reshape(-1)
        rows = np.asarray(rows).reshape(-1)
        found = values = None
        owner = owner_of(keys, self.num_shards)
        for d, tier in self.shards.items():
            at = np.flatnonzero(owner == d)
            hit, got = tier.read_missing(keys[at], rows[at], dtype)
            if found is None:
                found = np.zeros(keys.shape[0], bool)
                values = np.zeros((keys.shape[0], got.shape[1]), dtype)
            found[at], values[at] = hit, got
        return found, values

    def drop_plans(self):
        for tier in self.shards.values():
            tier.drop_plans()

    def pending(self):
        return max(tier.pending() for tier in self.shards.values())

    def drop_newest(self, count):
        for tier in self.shards.values():
            tier.drop_newest(count)

    def reset(self, records):
        """`RowTier.reset`: each shard's store gets the keys it owns."""
        with self.lock:
            owner = owner_of(records.keys, self.num_shards)
            for d, tier in self.shards.items():
                tier.reset(subset(records, owner == d))

    def stored_size(self, table_keys=None):
        """Keys the shards' stores hold that no table shard holds too (the
        table's keys read once, not once per shard)."""
        if table_keys is None:
            first = next(iter(self.shards.values()))
            if first.table_keys is not None:
                table_keys = first.table_keys()
        return sum(t.stored_size(table_keys) for t in self.shards.values())

    def stats(self):
        out = {"fills": 0, "write_backs": 0, "store_hits": 0}
        for tier in self.shards.values():
            for name in out:
                out[name] += tier.counts[name]
        # Stores keep copies of keys their shard's table holds again.
        out["store_size"] = self.stored_size()
        out["store_bytes"] = int(self.store.nbytes)
        return out


def check_shard_folder(layer_name, store, shard, num_shards):
    """Records in ``store``'s folder (disk stores) that it serves table
    shard ``shard`` of ``num_shards``; raises ValueError when a reopened
    folder holding keys served another shard or shard count (its keys
    would sit in a store that never reads them: lost)."""
    folder = getattr(store, "path", None)
    if folder is None:
        return
    want = {"shard": int(shard), "num_shards": int(num_shards)}
    mark = os.path.join(folder, SHARD_FILE)
    found = None
    if os.path.exists(mark):
        with open(mark) as f:
            found = json.load(f)
    if int(store.size) and found != want:
        if found is None:  # a folder from before the record: ask its keys
            wrong = any(
                (owner_of(keys, num_shards) != shard).any()
                for keys, _ in store.chunks()
            )
            found = "keys of other shards" if wrong else None
        if isinstance(found, dict):
            found = f"table shard {found.get('shard')} of {found.get('num_shards')}"
        if found is not None:
            raise ValueError(
                f"Layer '{layer_name}': `store` Disk(reopen=True): the "
                f"folder {folder} holds the store of {found}, but table "
                f"shard {shard} of {num_shards} would reopen it and its keys "
                "would be lost. Reopen under the shard count it was written "
                "with, or load a checkpoint (it moves keys to their new "
                "owners); nothing was opened."
            )
    with open(mark, "w") as f:
        json.dump(want, f)
