"""Per-key records of a `DistributedHashEmbedding`: export, import, checkpoints.

A record is a key with its row, vector, optimizer slots and score. Saving
stores records plus what fixes a key's candidate buckets (capacity, bucket
size, seed), the LRU clock and the admission counts, so a load into the same
geometry puts every key back at its row, and a load elsewhere re-places keys
hottest first and says what it dropped. Every argument is validated before
anything changes. Big tables show a progress bar (`keras_sparse.progress`).
"""

import warnings
from typing import NamedTuple

import numpy as np
from keras import ops

from keras_sparse.layers import placement
from keras_sparse.layers import store_assets
from keras_sparse.layers.hash import deltas
from keras_sparse.layers.hash import ttl_state
from keras_sparse.layers.hash.host_keys import to_numpy as _to_numpy
from keras_sparse.layers.hash.record_placement import greedy_rows
from keras_sparse.layers.hash.record_placement import hottest_first
from keras_sparse.layers.hash.record_placement import import_drop_reason
from keras_sparse.layers.hash.record_placement import load_drop_message
from keras_sparse.layers.record_checks import Records
from keras_sparse.layers.record_checks import check_distinct
from keras_sparse.layers.record_checks import checked_int
from keras_sparse.layers.record_checks import checked_int_array
from keras_sparse.layers.record_checks import checked_ints
from keras_sparse.layers.record_checks import checked_keys
from keras_sparse.layers.record_checks import checked_numbers
from keras_sparse.layers.record_checks import checked_step_count
from keras_sparse.layers.record_checks import subset
from keras_sparse.layers.row_tier import SCORE
from keras_sparse.layers.row_tier import VALUES
from keras_sparse.layers.stored_rows import evictions
from keras_sparse.layers.stored_rows import not_cached
from keras_sparse.layers.stored_rows import stored_chunks
from keras_sparse.layers.stored_rows import stored_records
from keras_sparse.layers.stored_rows import write_back
from keras_sparse.progress import silent
from keras_sparse.progress import tracker
from keras_sparse.table import TableFullError
from keras_sparse.table.scores import SCORE_LIMIT

# Seconds each stage took at 10M keys on a CPU host: the bar's pace (only
# the ratios matter). The table's own import_ ("place") is one vectorized
# step, so the bar waits at its start until it ends.
_EXPORT_STAGES = {"table": 1, "variables": 2, "gather": 2}
_SAVE_STAGES = {**_EXPORT_STAGES, "store": 2}
_WRITE_STAGES = {"place": 25, "variables": 3, "write": 1, "assign": 0.5}
_IMPORT_STAGES = {"check": 1.5, **_WRITE_STAGES}
_LOAD_STAGES = {"checkpoint": 1, "rows": 15, **_WRITE_STAGES}


class HashRecords:
    """Mixin of `DistributedHashEmbedding`: its records and checkpoints."""

    # ----------------------------------------------------------------- state
    def _host_state(self, progress=None):
        """NumPy copies of the table and slots keyed "table"/slot name.

        In a multi-process run only this process's shards of a sharded
        variable are filled (the rest are zeros): its table shards' keys
        live in those rows.
        """
        variables = self._state_variables()
        progress = progress or silent()
        # A placement holding this process's rows only (PyTorch key
        # sharding) gives them at their global rows; one holding a part per
        # replica (TensorFlow) gives the whole arrays.
        host = getattr(self.placement, "host_value", None)
        if host is None and self.placement is not None:
            hooks = placement.provider()
            # Written in place by loads: a read-only gathered array is copied.
            return {
                name: _writable(hooks.unpadded_value(self, variables[name]))
                for name in progress.each(variables)
            }
        host = host or _host_value
        return {name: host(variables[name]) for name in progress.each(variables)}

    def _state_variables(self):
        """The table and slot variables keyed "table"/slot name."""
        return {"table": self.embeddings, **self.slots}

    def export(self, include_rows=False, since_step=None):
        """Live records as NumPy, in row order: dict(keys, values, <slot
        name>..., scores), plus each key's ``rows`` with ``include_rows=True``
        (for `import_` into a table of the same capacity and seed).

        With ``since_step`` (a layer built with ``track_changes=True``): a
        delta, the records changed after that step plus ``removed_keys``
        and what describes it (see `keras_sparse.layers.hash.deltas`).

        Key-sharded across processes, each process exports the keys of the
        table shards it holds; together they are the whole table, and
        `import_` of their union places them under any layout.
        """
        if not self.built:
            self.build()
        n = self.table.size
        title = f"Layer '{self.name}': exporting {n:,} keys"
        with tracker(n, title, _EXPORT_STAGES) as progress:
            if since_step is not None:
                return deltas.delta_records(self, since_step, include_rows, progress)
            return self._records_out(include_rows, progress, self._trained_table())

    def _trained_table(self):
        """The table (`keras_sparse.table.undo.TableState`) as of the
        layer's last trained step, or None when it is the table as it is.

        A `keras_sparse.data.prefetch` stage maps batches ahead of their
        steps: their inserts, evictions, score and clock updates and
        admission counts are in the table before the rows are trained. The
        stage sets ``self.stage_lookahead``: given the layer's step counter, it
        returns the undo records of the table calls made for batches not
        trained yet, and the table computes its state before them. The
        variables need no undo: a row given to a key ahead of training is
        only reset in that key's step, so it still holds the vector and
        slots of the key it was taken from.
        """
        lookahead = self.stage_lookahead
        if lookahead is None:
            return None
        done = self.trained_steps()  # re-attaches what a JAX fit detached
        return self.table.state_before(lambda: lookahead(self, done))

    def cached_keys(self):
        """The keys the table holds as of the layer's last trained step
        (the keys whose row store copies, if any, are stale)."""
        trained = self._trained_table()
        entries = self.table.export() if trained is None else trained[:3]
        return _to_numpy(entries[0])

    def export_chunks(self, chunk_rows=65536, include_rows=False):
        """`export`'s records, at most ``chunk_rows`` keys at a time: an
        iterator of dicts of the same names, whose union is `export()`. The
        table's keys come first, then those of the layer's row store, read
        chunk by chunk, so a store beyond memory streams out. Do not train
        while it runs (the store raises if it changes meanwhile)."""
        if (
            isinstance(chunk_rows, bool)
            or not isinstance(chunk_rows, (int, np.integer))
            or chunk_rows < 1
        ):
            raise ValueError(
                f"Layer '{self.name}': `chunk_rows` must be an integer >= 1. "
                f"Received: chunk_rows={chunk_rows!r}."
            )
        if not self.built:
            self.build()
        return self._export_chunks(int(chunk_rows), include_rows)

    def _export_chunks(self, chunk_rows, include_rows):
        trained = self._trained_table()
        entries = self.table.export() if trained is None else trained[:3]
        keys, rows, scores = (_to_numpy(x) for x in entries)
        state = self._host_state()
        empty = True
        for start in range(0, len(keys), chunk_rows):
            part = slice(start, start + chunk_rows)
            out = {"keys": keys[part]}
            for name, value in state.items():
                out["values" if name == "table" else name] = value[rows[part]]
            out["scores"] = scores[part]
            if include_rows:
                out["rows"] = rows[part]
            empty = False
            yield out
        tier = getattr(self, "row_tier", None)
        if tier is None:
            if empty:  # one empty chunk: the names and dtypes
                yield self._records_out(include_rows, silent(), trained)
            return
        like = {"keys": keys}
        for name, value in state.items():
            like["values" if name == "table" else name] = value[:0]
        like["scores"] = scores
        if include_rows:
            like["rows"] = rows
        for chunk in stored_chunks(tier, like, chunk_rows):
            yield chunk

    def _records_out(self, include_rows, progress, trained=None, with_store=True):
        """`export`'s records, its stages reported to ``progress``; of the
        table as of its last trained step when ``trained`` (a `TableState`)
        is given; without the store's keys unless ``with_store``."""
        progress.stage("table")
        entries = self.table.export() if trained is None else trained[:3]
        keys, rows, scores = (_to_numpy(x) for x in entries)
        progress.stage("variables")
        state = self._host_state(progress)
        progress.stage("gather")
        out = {"keys": keys}
        for name in progress.each(state):
            out["values" if name == "table" else name] = _gathered(
                state[name], rows, progress
            )
        out["scores"] = scores
        if include_rows:
            out["rows"] = rows
        tier = getattr(self, "row_tier", None)
        if tier is not None and with_store:  # the keys the store holds (row -1)
            out = stored_records(tier, out, include_rows)
        return out

    def import_(self, keys, values, slots=None, scores=None, rows=None):
        """Inserts ``keys`` (admission bypassed) with their vectors.

        ``slots`` maps slot names to ``[num_keys, ...]`` arrays; slots left
        out start at their initial values (a warm start). ``scores`` (LRU
        step or LFU count per key) default to those of a fresh key. With
        ``rows`` (see ``export(include_rows=True)``) every key goes to exactly
        its row, which must lie in one of its two candidate buckets (a table
        of the same capacity and seed). Without, keys are placed hottest
        first (by ``scores``) and may evict colder keys already stored; keys
        that find no row are dropped, with a warning saying how many and why.

        Every argument is checked before anything changes: on an error
        (ValueError, TypeError, or `TableFullError` when ``eviction=None``
        leaves no free row) the table and the variables are as before.
        Returns the number of keys stored.
        """
        if not self.built:
            self.build()
        n = _key_count(keys)
        title = f"Layer '{self.name}': importing {n:,} keys"
        with tracker(n, title, _IMPORT_STAGES) as progress:
            progress.stage("check")
            records = self._checked_records(keys, values, slots, scores, rows)
            records = self._held_here(records)
            stored = self._store_records(records, progress)
        dropped = len(records.keys) - stored
        if dropped:
            warnings.warn(
                f"Layer '{self.name}': import_ stored {stored} of "
                f"{len(records.keys)} keys. "
                f"{import_drop_reason(self, len(records.keys), stored)}",
                stacklevel=2,
            )
        return stored

    def _held_here(self, records):
        """The records whose keys this process's table shards own (all of
        them unless the layer is key-sharded over several processes)."""
        local = getattr(self.table, "local", None)
        if local is None or len(local) == self.table.num_shards:
            return records
        from keras_sparse.table.sharded_table import owner_of

        mine = np.isin(owner_of(records.keys, self.table.num_shards), local)
        return subset(records, mine)

    def _checked_records(self, keys, values, slots, scores, rows, saved=False):
        """Validated `Records`; raises naming the layer and the argument.

        ``saved``: the arrays come from a checkpoint, so errors name its
        entries and non-finite numbers are restored as they were saved.
        """

        def label(name):
            return f"record_{name}" if saved else name

        keys = checked_keys(self.name, label("keys"), keys)
        n = len(keys)
        values = checked_numbers(
            self.name,
            label("values"),
            values,
            (n, self.output_dim),
            "(num_keys, output_dim)",
            finite=not saved,
        )
        slots = self._checked_slots(slots, n, saved)
        if scores is not None:
            # See keras_sparse.table.scores: room for the steps to come.
            scores = checked_ints(self.name, label("scores"), scores, n, 0, SCORE_LIMIT)
        if rows is not None:
            capacity = self.table.capacity
            # -1: a key held by the layer's row store, not by the table.
            low = -1 if saved else 0
            rows = checked_ints(self.name, label("rows"), rows, n, low, capacity)
            check_distinct(self.name, label("rows"), rows[rows >= 0])
        return Records(keys, values, slots, scores, rows)

    def _checked_slots(self, slots, n, saved):
        """``{slot name: array}`` validated against the layer's optimizer."""
        if slots is None:
            return {}
        if not hasattr(slots, "items"):
            raise TypeError(
                f"Layer '{self.name}': `slots` must be a dict {{slot name: "
                f"array}}; received {type(slots).__name__}."
            )
        specs = {spec.name: spec for spec in self.sparse_optimizer.slot_specs()}
        unknown = sorted(set(slots) - set(specs))
        if unknown:
            raise ValueError(
                f"Layer '{self.name}': unknown `slots` {unknown}; the layer's "
                f"optimizer ({type(self.sparse_optimizer).__name__}) keeps "
                f"{sorted(specs) or 'no slots'}."
            )
        checked = {}
        for name, value in slots.items():
            checked[name] = checked_numbers(
                self.name,
                f"record_{name}" if saved else f"slots['{name}']",
                value,
                specs[name].shape(n, self.output_dim),
                "(num_keys, width)",
                finite=not saved,
            )
        return checked

    def _store_records(self, records, progress):
        """Writes validated records into the table and the variables;
        returns how many keys were stored."""
        progress.stage("place")
        evicted = None
        if records.rows is not None:
            # Rows given: a row taken by another key is refused, none evicted.
            self._table_import(records.keys, records.rows, records.scores)
            target, source = records.rows, np.arange(len(records.keys))
        else:
            target, source, evicted = self._place_records(records.keys, records.scores)
        progress.stage("variables")
        state = self._host_state(progress)
        if evicted is not None:
            # Before their rows are overwritten: the keys the import evicted
            # go down to the store, over their older stored copies.
            write_back(self.row_tier, *evicted, state)
        progress.stage("write")
        given = {"table": records.values, **records.slots}
        initial = {s.name: s.initial_value for s in self.sparse_optimizer.slot_specs()}
        for name in progress.each(["table", *initial]):
            # Chunks: target rows are distinct, so the order of writes is moot.
            for part in progress.chunks(len(target)):
                state[name][target[part]] = (
                    initial[name] if name not in given else given[name][source[part]]
                )
        progress.stage("assign")
        variables = self._state_variables()
        assign = getattr(self.placement, "assign_host_value", None)
        for name in progress.each(variables):
            if assign is not None:  # this process's rows of the whole state
                assign(variables[name], state[name])
            elif self.placement is not None:  # each replica takes its part
                placement.provider().assign_value(self, variables[name], state[name])
            else:
                variables[name].assign(state[name])
        return len(target)

    def _place_records(self, keys, scores):
        """Inserts keys hottest first through the table's own placement;
        ``(rows, indices into keys, evicted)`` of the keys that got a row,
        ``evicted`` the ``(keys, rows, scores)`` the import pushed out of a
        layer with a row store (else None)."""
        # At most `capacity` keys: the table refuses larger batches.
        order = hottest_first(scores, len(keys))[: self.table.capacity]
        tier = getattr(self, "row_tier", None)
        # The evicted keys' scores are overwritten by the import: keep them.
        before = None if tier is None else self.table.export()
        res = self._table_import(
            keys[order], None, None if scores is None else scores[order]
        )
        rows = _to_numpy(res.rows)
        ok = rows >= 0
        evicted = None
        if tier is not None:
            evicted = evictions(before, res)
        return rows[ok], order[ok], evicted

    def _table_import(self, keys, rows, scores):
        """`HashTable.import_`, its errors naming the layer (the table is
        unchanged when it raises)."""
        try:
            return self.table.import_(keys, rows=rows, scores=scores)
        except TableFullError as e:
            raise TableFullError(
                f"Layer '{self.name}': the hash table has no free row for "
                f"some of the {len(keys)} keys to import (capacity="
                f"{self.table.capacity}, size={self.table.size}) and "
                "eviction=None; nothing was changed. Use eviction='lru'/'lfu' "
                f"or a larger capacity. ({e})"
            ) from None
        except ValueError as e:
            raise ValueError(
                f"Layer '{self.name}': `rows` do not fit this table (capacity="
                f"{self.table.capacity}, seed={self.table.seed}); nothing was "
                f"changed. ({e})"
            ) from None

    # ----------------------------------------------------------- checkpoints
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
        with tracker(n, title, _SAVE_STAGES) as progress:
            records = self._records_out(True, progress, trained, not in_assets)
            table_keys = records["keys"]
            clock = self._table_clock() if trained is None else trained.clock
            admission = self._pending_state(trained)
            if gather:
                records, admission, clock = gather(records, admission, clock)
            progress.stage("store")
            for name in progress.each(records):
                store[f"record_{name}"] = records[name]
        for name, value in zip(_GEOMETRY_ENTRIES, self._geometry()):
            store[name] = np.int64(value)
        store["table_clock"] = np.int64(clock)
        ttl_state.save(self, store, records["keys"], trained)
        deltas.save(self, store, records["keys"])
        store["sparse_iterations"] = ops.convert_to_numpy(self.sparse_iterations)
        store["seed_state"] = ops.convert_to_numpy(self.seed_generator.state)
        if admission is not None:
            store["admission_keys"], store["admission_sightings"] = admission
        if in_assets:
            store[_IN_ASSETS] = np.int64(tier.stored_size(table_keys))

    def _partial(self):
        """Whether this process holds only some of the table's shards (its
        checkpoints gather the other processes' records)."""
        local = getattr(self.table, "local", None)
        return local is not None and len(local) < self.table.num_shards

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

    def _pending_state(self, trained):
        """``(keys, counts)`` of the keys awaiting admission, or None."""
        pending = self._admission_counts()
        if pending is None:
            return None
        if trained is not None:
            return trained.admission
        with self.table._lock:
            return pending.state()

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
        if _IN_ASSETS in set(store.keys()):
            in_assets = checked_int(
                self.name, _IN_ASSETS, store[_IN_ASSETS][...], 0, 2**62, "(keys)"
            )
            if not store_assets.expected():
                raise store_assets.missing_assets_error(self.name, in_assets)
        n = _saved_count(store)
        title = f"Layer '{self.name}': loading {n:,} keys"
        with tracker(n, title, _LOAD_STAGES) as progress:
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
        if all(name in names for name in _GEOMETRY_ENTRIES):
            geometry = tuple(
                checked_int(self.name, name, store[name][...], low, high, meaning)
                for name, (low, high, meaning) in _GEOMETRY_ENTRIES.items()
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

    def _admission_counts(self):
        """The table's pending admission counts, or None (``admit_after=1``)."""
        return getattr(self.table._impl, "admission", None)


#: Weights entry of a model save whose store rows are in its asset files.
_IN_ASSETS = "store_rows_in_assets"


def _dtype(variable):
    return np.dtype(str(variable.dtype).split(".")[-1]).name


def _writable(array):
    array = np.asarray(array)
    return array if array.flags.writeable else array.copy()


def _host_value(variable):
    value = variable.value
    if getattr(value, "is_fully_addressable", True):
        return ops.convert_to_numpy(value)
    out = np.zeros(value.shape, value.dtype)
    for shard in value.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def _gathered(value, rows, progress):
    """``value[rows]``, gathered in chunks (progress)."""
    out = np.empty((len(rows),) + value.shape[1:], value.dtype)
    for part in progress.chunks(len(rows)):
        # Live rows are in range: "clip" skips the bounds checks, and the
        # copy through a buffer that "raise" makes for ``out``.
        np.take(value, rows[part], axis=0, out=out[part], mode="clip")
    return out


def _key_count(keys):
    """How many keys ``keys`` holds, for the bar; 0 when unclear (the
    checks then say what is wrong)."""
    try:
        return int(np.prod(np.shape(keys)))
    except (TypeError, ValueError):
        return 0


def _saved_count(store):
    """The number of saved keys, read from the entry's shape (0 if none)."""
    if "record_keys" not in set(store.keys()):
        return 0
    return int(np.shape(store["record_keys"])[0])


# Saved geometry: (low, high, meaning) of each entry; a valid geometry other
# than the layer's only means keys are re-placed.
_GEOMETRY_ENTRIES = {
    "table_capacity": (1, 2**62, "(the saving table's capacity)"),
    "table_bucket_size": (1, 2**62, "(the saving table's bucket size)"),
    "table_seed": (-(2**63), 2**63, "(the saving table's seed)"),
}


class _Checkpoint(NamedTuple):
    """A layer's saved state, checked before the layer changes."""

    records: Records
    geometry: object  # (capacity, bucket_size, seed) of the saving table, or None
    clock: int
    iterations: np.ndarray
    seed_state: np.ndarray
    admission: object  # (keys, counts), or None (none saved)
