"""A `DistributedHashEmbedding`'s row store in model files and on disk:
its rows written to and read from a model's asset files
(`keras_sparse.layers.store_assets`), and `flush_store`."""

import numpy as np

from keras_sparse.layers import store_assets
from keras_sparse.layers.hash.host_keys import to_numpy as _to_numpy
from keras_sparse.layers.row_tier import SCORE
from keras_sparse.layers.row_tier import VALUES
from keras_sparse.layers.stored_rows import not_cached
from keras_sparse.layers.stored_rows import write_back


class RecordStore:
    """Mixin of `DistributedHashEmbedding`: its row store's saves."""

    def save_assets(self, dir_path):
        """Writes the row store's rows (if any) into the asset folder
        ``dir_path``, chunk by chunk (`keras_sparse.layers.store_assets`)."""
        tier = getattr(self, "row_tier", None)
        if tier is None or not store_assets.expected() or self._partial():
            return
        store = tier.store
        # Keys with a row are in the weights; their stored copies are stale.
        # (The table is read before the store's lock is taken: a table call
        # holds the table's lock while it asks the store.)
        table_keys = self.cached_keys()
        with tier.lock:
            chunks = not_cached(
                store.chunks(store_assets.rows_per_chunk(store.fields)), table_keys
            )
            total = tier.stored_size(table_keys)
            store_assets.save(self.name, store.fields, chunks, total, dir_path)

    def load_assets(self, dir_path):
        """Streams the store rows a model file holds into the layer's row
        store; a layer without a store imports them into its table, as
        `import_` does (hottest first; a warning says what was dropped)."""
        expected, self._assets_rows = getattr(self, "_assets_rows", None), None
        if expected is None:
            return
        if store_assets.saved_rows(dir_path) != expected:
            # Keras reads the assets after the weights, which are loaded.
            raise ValueError(
                f"Layer '{self.name}': the file's weights say its row store "
                f"held {expected:,} keys, but its asset files hold "
                f"{store_assets.saved_rows(dir_path)} (None: no saved rows); "
                "the file is incomplete. The layer holds the keys of the "
                f"file's weights only: those {expected:,} keys are missing. "
                "Load a complete file (or save the trained model again)."
            )
        tier = getattr(self, "row_tier", None)
        fields = self._saved_store_fields()
        if tier is not None:
            with tier.lock:
                store_assets.load(self.name, fields, dir_path, tier.store.write)
            return
        parts = []
        store_assets.load(
            self.name, fields, dir_path, lambda k, r: parts.append((k, r))
        )
        if parts:
            self.import_(
                np.concatenate([np.asarray(k) for k, _ in parts]),
                np.concatenate([np.asarray(r[VALUES]) for _, r in parts]),
                slots={
                    name: np.concatenate([np.asarray(r[name]) for _, r in parts])
                    for name in self.slots
                },
                scores=np.concatenate(
                    [np.asarray(r[SCORE]).reshape(-1) for _, r in parts]
                ),
            )

    def flush_store(self):
        """Writes every row the table holds down to the layer's row store
        (vector, optimizer slots, score), empties the table (the LRU clock
        and admission counts are kept) and flushes the store to disk: it
        then holds every trained row, so ``ks.store.Disk(path,
        reopen=True)`` reopens it as it is. Training may go on (keys come
        back from the store when seen)."""
        tier = getattr(self, "row_tier", None)
        if tier is None:
            raise ValueError(
                f"Layer '{self.name}': flush_store() needs a row store "
                "(`store=`); this layer has none."
            )
        # The table's lock first, as a table call takes it before asking
        # the store (`held`).
        with self.table._lock, tier.lock:
            if tier.pending():
                raise ValueError(
                    f"Layer '{self.name}': flush_store(): {tier.pending()} "
                    "batch(es) were mapped but not trained yet (an input "
                    "stage runs ahead); call it when their steps have run."
                )
            keys, rows, scores = (_to_numpy(x) for x in self.table.export())
            if keys.size:
                state = self._host_state()
                write_back(tier, keys, rows, scores, state)
                clock, pending = self._table_clock(), self._pending_state(None)
                self.table.clear()
                self._table_clock(clock)
                if pending is not None:
                    with self.table._lock:
                        self._admission_counts().load_state(*pending)
            tier.store.flush()

    def _saved_store_fields(self):
        """The fields a keyed store of this layer holds (see row_tier)."""
        from keras_sparse.store import FieldSpec

        tier = getattr(self, "row_tier", None)
        if tier is not None:
            return tier.store.fields
        fields = [FieldSpec(VALUES, self.output_dim, _dtype(self.embeddings))]
        for name, var in self.slots.items():
            fields.append(FieldSpec(name, int(var.shape[1]), _dtype(var)))
        return (*fields, FieldSpec(SCORE, 1, "int64"))


def _dtype(variable):
    return np.dtype(str(variable.dtype).split(".")[-1]).name
