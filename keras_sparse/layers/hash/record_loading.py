"""Loads of a `DistributedHashEmbedding`'s checkpoints
(`load_own_variables`): all of it checked before any change, keys put back
at their saved rows in the same geometry, else re-placed hottest first."""

import warnings
from typing import NamedTuple

import numpy as np

from keras_sparse.layers import store_assets
from keras_sparse.layers.hash import deltas
from keras_sparse.layers.hash import ttl_state
from keras_sparse.layers.hash.host_keys import to_numpy as _to_numpy
from keras_sparse.layers.hash.record_placement import greedy_rows
from keras_sparse.layers.hash.record_placement import hottest_first
from keras_sparse.layers.hash.record_placement import load_drop_message
from keras_sparse.layers.hash.record_progress import LOAD_STAGES
from keras_sparse.layers.hash.record_saving import GEOMETRY_ENTRIES
from keras_sparse.layers.hash.record_saving import IN_ASSETS
from keras_sparse.layers.record_checks import Records
from keras_sparse.layers.record_checks import checked_int
from keras_sparse.layers.record_checks import checked_int_array
from keras_sparse.layers.record_checks import checked_keys
from keras_sparse.layers.record_checks import checked_step_count
from keras_sparse.layers.record_checks import subset
from keras_sparse.progress import tracker
from keras_sparse.table.scores import SCORE_LIMIT


class RecordLoading:
    """Mixin of `DistributedHashEmbedding`: its checkpoints read back."""

    def load_own_variables(self, store):
        """Restores a checkpoint written by `save_own_variables`.

        Same capacity, bucket size and seed: every key returns to its saved
        row. Otherwise keys are placed hottest first and those that find no
        row are dropped with a warning. Missing entries, and counters or
        seeds outside their valid range (the clock, scores, step count,
        admission counts), raise ValueError before anything changes.
        """
        if not self.built:
            self.build()
        in_assets = None
        if IN_ASSETS in set(store.keys()):
            in_assets = checked_int(
                self.name, IN_ASSETS, store[IN_ASSETS][...], 0, 2**62, "(keys)"
            )
            if not store_assets.expected():
                raise store_assets.missing_assets_error(self.name, in_assets)
        n = _saved_count(store)
        title = f"Layer '{self.name}': loading {n:,} keys"
        with tracker(n, title, LOAD_STAGES) as progress:
            progress.stage("checkpoint")
            saved = self._read_checkpoint(store)
            last_seen = ttl_state.checked(self, store)
            changes = deltas.checked(self, store)
            # Key-sharded across processes: the keys this process's shards own.
            records = self._held_here(saved.records)
            progress.stage("rows")
            rows = self._rows_for_load(records, saved.geometry, progress)
            kept = rows >= 0
            self.table.clear()
            self._table_clock(saved.clock)
            if getattr(self, "row_tier", None) is not None:
                # The keys without a row go down to the store, not away.
                self.row_tier.reset(subset(records, ~kept))
                kept[:] = True
                rows_kept = rows >= 0
                records = subset(records, rows_kept)._replace(rows=rows[rows_kept])
            else:
                records = subset(records, kept)._replace(rows=rows[kept])
            self._store_records(records, progress)
            ttl_state.load(self, last_seen)
            deltas.load(self, changes)
        self.sparse_iterations.assign(saved.iterations)
        self.seed_generator.state.assign(saved.seed_state)
        self._load_admission(saved.admission)
        # `load_assets` (called next by Keras) brings the store's rows.
        self._assets_rows = in_assets
        if not kept.all():
            warnings.warn(
                load_drop_message(self, saved.geometry, len(rows), int(kept.sum())),
                stacklevel=2,
            )

    def _read_checkpoint(self, store):
        """`_Checkpoint` of ``store``, all of it checked before any change."""
        names = set(store.keys())
        self._check_entries(names)
        geometry = None
        if all(name in names for name in GEOMETRY_ENTRIES):
            geometry = tuple(
                checked_int(self.name, name, store[name][...], low, high, meaning)
                for name, (low, high, meaning) in GEOMETRY_ENTRIES.items()
            )
        slot_names = [spec.name for spec in self.sparse_optimizer.slot_specs()]
        # Saved rows only mean something in a table with the same buckets.
        with_rows = "record_rows" in names and geometry == self._geometry()
        records = self._checked_records(
            store["record_keys"][...],
            store["record_values"][...],
            {n: store[f"record_{n}"][...] for n in slot_names},
            store["record_scores"][...],
            store["record_rows"][...] if with_rows else None,
            saved=True,
        )
        # Any value of the generator's dtype (uint32, int32 or int64 by
        # backend) is a valid state.
        seed_bounds = np.iinfo(np.dtype(self.seed_generator.state.dtype))
        scalars = {
            "sparse_iterations": checked_step_count(
                self.name, store["sparse_iterations"][...], self.sparse_iterations
            ),
            "seed_state": checked_int_array(
                self.name,
                "seed_state",
                store["seed_state"][...],
                tuple(self.seed_generator.state.shape),
                "(the seed generator's)",
                int(seed_bounds.min),
                int(seed_bounds.max) + 1,
            ),
        }
        admission = None
        if self._admission_counts() is not None:
            admission = self._checked_admission(store, names)
        return _Checkpoint(
            records,
            geometry,
            self._saved_clock(store, names, records),
            scalars["sparse_iterations"],
            scalars["seed_state"],
            admission,
        )

    def _check_entries(self, names):
        """Raises for a checkpoint missing an entry this layer would
        otherwise reset silently, or holding another optimizer's slots."""
        slot_names = [spec.name for spec in self.sparse_optimizer.slot_specs()]
        required = ["record_keys", "record_values", "record_scores"]
        required += [f"record_{n}" for n in slot_names]
        required += ["sparse_iterations", "seed_state"]
        if self._admission_counts() is not None and "admission_counts" not in names:
            # (a checkpoint of the older count-min sketch: see _checked_admission)
            required += ["admission_keys", "admission_sightings"]
        missing = [name for name in required if name not in names]
        if missing:
            raise ValueError(
                f"Layer '{self.name}': the saved state lacks {missing}, so "
                f"loading it would reset them; nothing was loaded. The layer "
                f"(optimizer {type(self.sparse_optimizer).__name__}, "
                f"admit_after={self.admit_after}) needs {required}; the saved "
                f"state has {sorted(names)}."
            )
        known = {"keys", "values", "scores", "rows", *slot_names}
        foreign = sorted(
            n for n in names if n.startswith("record_") and n[7:] not in known
        )
        if foreign:
            raise ValueError(
                f"Layer '{self.name}': the saved state holds optimizer slots "
                f"{foreign} that this layer's optimizer "
                f"({type(self.sparse_optimizer).__name__}, slots {slot_names}) "
                "does not keep; nothing was loaded. Use `layer.import_` to "
                "carry vectors over to another optimizer."
            )

    def _saved_clock(self, store, names, records):
        """The saved LRU step counter; older checkpoints lack it, and then the
        newest saved step keeps restored keys from looking recent."""
        if "table_clock" in names:
            # See keras_sparse.table.scores: room for the steps to come.
            return checked_int(
                self.name,
                "table_clock",
                store["table_clock"][...],
                0,
                SCORE_LIMIT,
                "(the LRU step counter)",
            )
        if self.eviction == "lru" and len(records.scores):
            return int(records.scores.max())
        return 0

    def _rows_for_load(self, records, geometry, progress):
        """Row per saved key in the cleared table, -1 for keys that find none:
        the saved rows where they fit, else hottest-first placement."""
        b1, b2 = (_to_numpy(b) for b in self.table.candidate_buckets(records.keys))
        # Same geometry but other buckets: hash functions changed since saving.
        if records.rows is not None and geometry == self._geometry():
            # Rows -1 (keys a row store held) stay there when this layer
            # has a store too; otherwise every key is placed again.
            placed = records.rows >= 0
            if getattr(self, "row_tier", None) is None:
                placed = np.ones_like(placed)
            bucket = records.rows[placed] // self.table.bucket_size
            hit = (bucket == b1[placed]) | (bucket == b2[placed])
            if bool((hit & (records.rows[placed] >= 0)).all()):
                return records.rows
        return greedy_rows(
            b1,
            b2,
            hottest_first(records.scores, len(records.keys)),
            self.table.num_buckets,
            self.table.bucket_size,
            progress,
        )

    def _checked_admission(self, store, names):
        """Saved pending admission counts ``(keys, counts)``; a checkpoint
        of the older count-min sketch (``admission_counts``) has no per-key
        counts: None, and the load warns."""
        if "admission_keys" not in names:
            return None
        keys = checked_keys(self.name, "admission_keys", store["admission_keys"][...])
        counts = checked_int_array(
            self.name,
            "admission_sightings",
            store["admission_sightings"][...],
            (len(keys),),
            "(one count per admission key)",
            0,
            SCORE_LIMIT,
        )
        return keys, counts.astype(np.int64)

    def _load_admission(self, admission):
        """Restores the pending admission counts (keys past the table's
        memory cap, or owned by another process's shards, are dropped)."""
        pending = self._admission_counts()
        if pending is None:
            return
        if admission is None:
            with self.table._lock:
                pending.load_state(np.zeros(0, np.int64), np.zeros(0, np.int64))
            warnings.warn(
                f"Layer '{self.name}': the checkpoint holds count-min admission "
                "counters, not per-key counts; keys not admitted yet start "
                "counting their sightings from zero.",
                stacklevel=3,
            )
            return
        with self.table._lock:
            pending.load_state(*admission)


def _saved_count(store):
    """The number of saved keys, read from the entry's shape (0 if none)."""
    if "record_keys" not in set(store.keys()):
        return 0
    return int(np.shape(store["record_keys"])[0])


class _Checkpoint(NamedTuple):
    """A layer's saved state, checked before the layer changes."""

    records: Records
    geometry: object  # (capacity, bucket_size, seed) of the saving table, or None
    clock: int
    iterations: np.ndarray
    seed_state: np.ndarray
    admission: object  # (keys, counts), or None (none saved)
