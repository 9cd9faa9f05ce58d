"""Checkpoints of a `DistributedHashEmbedding` (`save_own_variables`):
its records plus what fixes a key's candidate buckets (capacity, bucket
size, seed), the LRU clock and the pending admission counts."""

import numpy as np
from keras import ops

from keras_sparse.layers import store_assets
from keras_sparse.layers.hash import deltas
from keras_sparse.layers.hash import ttl_state
from keras_sparse.layers.hash.record_progress import SAVE_STAGES
from keras_sparse.progress import tracker

#: Weights entry of a model save whose store rows are in its asset files.
IN_ASSETS = "store_rows_in_assets"

# Saved geometry: (low, high, meaning) of each entry; a valid geometry other
# than the layer's only means keys are re-placed.
GEOMETRY_ENTRIES = {
    "table_capacity": (1, 2**62, "(the saving table's capacity)"),
    "table_bucket_size": (1, 2**62, "(the saving table's bucket size)"),
    "table_seed": (-(2**63), 2**63, "(the saving table's seed)"),
}


class RecordSaving:
    """Mixin of `DistributedHashEmbedding`: its checkpoints written."""

    def _geometry(self):
        """What fixes a key's candidate buckets, hence whether rows transfer."""
        return (self.table.capacity, self.table.bucket_size, self.table.seed)

    def _table_clock(self, value=None):
        """The table's LRU step counter; sets it when ``value`` is given."""
        with self.table._lock:
            if value is not None:
                self.table._impl.clock = int(value)
            return self.table._impl.clock

    def save_own_variables(self, store):
        local = getattr(self.table, "local", None)
        # PyTorch key sharding gathers every process's records (a collective).
        gather = getattr(self.placement, "gathered_records", None)
        if local is not None and len(local) < self.table.num_shards and not gather:
            raise ValueError(
                f"Layer '{self.name}': this process holds table shards "
                f"{list(local)} of {self.table.num_shards}, so a checkpoint "
                "written here would miss the other processes' keys; nothing "
                "was saved. Save each process's `layer.export()` records (and "
                "`import_` them into any layout), or save from a "
                "single-process run."
            )
        if not self.built:
            self.build()
        n = self.table.size
        title = f"Layer '{self.name}': saving {n:,} keys"
        trained = self._trained_table()
        tier = getattr(self, "row_tier", None)
        # A model save writes the store's rows to its asset files, chunked
        # (`save_assets`); elsewhere, and where each process holds its own
        # shards' stores (gathered with the records), they go with the
        # records, in memory.
        in_assets = tier is not None and store_assets.expected() and not self._partial()
        with tracker(n, title, SAVE_STAGES) as progress:
            records = self._records_out(True, progress, trained, not in_assets)
            table_keys = records["keys"]
            clock = self._table_clock() if trained is None else trained.clock
            admission = self._pending_state(trained)
            if gather:
                records, admission, clock = gather(records, admission, clock)
            progress.stage("store")
            for name in progress.each(records):
                store[f"record_{name}"] = records[name]
        for name, value in zip(GEOMETRY_ENTRIES, self._geometry()):
            store[name] = np.int64(value)
        store["table_clock"] = np.int64(clock)
        ttl_state.save(self, store, records["keys"], trained)
        deltas.save(self, store, records["keys"])
        store["sparse_iterations"] = ops.convert_to_numpy(self.sparse_iterations)
        store["seed_state"] = ops.convert_to_numpy(self.seed_generator.state)
        if admission is not None:
            store["admission_keys"], store["admission_sightings"] = admission
        if in_assets:
            store[IN_ASSETS] = np.int64(tier.stored_size(table_keys))

    def _partial(self):
        """Whether this process holds only some of the table's shards (its
        checkpoints gather the other processes' records)."""
        local = getattr(self.table, "local", None)
        return local is not None and len(local) < self.table.num_shards

    def _pending_state(self, trained):
        """``(keys, counts)`` of the keys awaiting admission, or None."""
        pending = self._admission_counts()
        if pending is None:
            return None
        if trained is not None:
            return trained.admission
        with self.table._lock:
            return pending.state()

    def _admission_counts(self):
        """The table's pending admission counts, or None (``admit_after=1``)."""
        return getattr(self.table._impl, "admission", None)
