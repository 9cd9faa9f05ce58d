"""Import of records into a `DistributedHashEmbedding`: every argument
checked first, then the keys placed (at given rows, or hottest first) and
their vectors and optimizer slots written into the variables."""

import warnings

import numpy as np

from keras_sparse.layers import placement
from keras_sparse.layers.hash.host_keys import to_numpy as _to_numpy
from keras_sparse.layers.hash.record_placement import hottest_first
from keras_sparse.layers.hash.record_placement import import_drop_reason
from keras_sparse.layers.hash.record_progress import IMPORT_STAGES
from keras_sparse.layers.record_checks import Records
from keras_sparse.layers.record_checks import check_distinct
from keras_sparse.layers.record_checks import checked_ints
from keras_sparse.layers.record_checks import checked_keys
from keras_sparse.layers.record_checks import checked_numbers
from keras_sparse.layers.record_checks import subset
from keras_sparse.layers.stored_rows import evictions
from keras_sparse.layers.stored_rows import write_back
from keras_sparse.progress import tracker
from keras_sparse.table import TableFullError
from keras_sparse.table.scores import SCORE_LIMIT


class RecordImport:
    """Mixin of `DistributedHashEmbedding`: records in (`import_`)."""

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
        with tracker(n, title, IMPORT_STAGES) as progress:
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


def _key_count(keys):
    """How many keys ``keys`` holds, for the bar; 0 when unclear (the
    checks then say what is wrong)."""
    try:
        return int(np.prod(np.shape(keys)))
    except (TypeError, ValueError):
        return 0
