"""Export of a `DistributedHashEmbedding`'s records: the host copies of
its variables, the table as of the last trained step, and the live records
as NumPy (whole, or streamed in chunks with the row store's keys)."""

import numpy as np
from keras import ops

from keras_sparse.layers import placement
from keras_sparse.layers.hash import deltas
from keras_sparse.layers.hash.host_keys import to_numpy as _to_numpy
from keras_sparse.layers.hash.record_progress import EXPORT_STAGES
from keras_sparse.layers.stored_rows import stored_chunks
from keras_sparse.layers.stored_rows import stored_records
from keras_sparse.progress import silent
from keras_sparse.progress import tracker


class RecordExport:
    """Mixin of `DistributedHashEmbedding`: its records out."""

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
        with tracker(n, title, EXPORT_STAGES) as progress:
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
