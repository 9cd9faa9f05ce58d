"""The whole table of a table with ``cache_rows``: its store's rows with the
cached ones over them.

Mixin of `keras_sparse.layers.dense_cache.CacheRows`: what `get_weights`,
`set_weights`, ``model.save`` / ``load_model`` (the table streamed through
the file's asset files, `keras_sparse.layers.store_assets`), `export` and
`flush_store` see and set. Setting the table empties the cache: every id is
filled from the store when next trained.
"""

import numpy as np
from keras import ops

from keras_sparse.layers.record_checks import checked_step_count
from keras_sparse.layers.row_tier import VALUES

#: Bytes of rows written to the store per call when a whole table is set.
_WRITE_BYTES = 64 << 20


class CacheState:
    """Mixin of `CacheRows`: the full table in and out (see the module)."""

    def _host_state(self):
        """NumPy copies of the cache's variables ("table" / slot name)."""
        state = {"table": ops.convert_to_numpy(self.embeddings)}
        state.update({k: ops.convert_to_numpy(v) for k, v in self.slots.items()})
        return state

    def export(self):
        """The whole table as records: ``{"keys": every id, "values",
        <slot name>...}`` (`full_table`)."""
        table = self.full_table()
        out = {"keys": np.arange(self.input_dim, dtype=np.int64)}
        out["values"] = table.pop(VALUES)
        out.update(table)
        return out

    def flush_store(self):
        """Writes the cached rows down to the store, empties the cache and
        flushes the store (it then holds the whole trained table)."""
        tier = self.row_tier
        with tier.lock:
            if tier.pending():
                raise ValueError(
                    f"Layer '{self.owner_name}': flush_store(): "
                    f"{tier.pending()} batch(es) were mapped but not trained."
                )
            ids, slots = self.slot_map.cached()
            if ids.size:
                state = self._host_state()
                out = {VALUES: state["table"][slots]}
                out.update({name: state[name][slots] for name in self.slots})
                tier.store.write(ids, out)
            self.slot_map.clear()
            tier.store.flush()

    # The owner saves the full table; this layer's variables are its cache.
    def save_own_variables(self, store):
        pass

    def load_own_variables(self, store):
        pass

    # A model save: the full table into the asset files, chunk by chunk.
    def save_assets(self, dir_path):
        from keras_sparse.layers import store_assets

        tier = self.row_tier
        if tier is None or not store_assets.expected():
            return  # unbuilt: no store, nothing trained to save
        fields = tier.store.fields
        with tier.lock:
            ids, slots = self.slot_map.cached()
            state = self._host_state() if ids.size else {}
            chunks = _overridden(
                tier.store.chunks(store_assets.rows_per_chunk(fields)),
                ids,
                slots,
                {VALUES: "table", **{n: n for n in self.slots}},
                state,
            )
            store_assets.save(self.owner_name, fields, chunks, self.input_dim, dir_path)

    def load_assets(self, dir_path):
        from keras_sparse.layers import store_assets

        expected, self.table_in_assets = getattr(self, "table_in_assets", None), None
        if expected is None:
            return
        saved = store_assets.saved_rows(dir_path)
        if saved != self.input_dim:
            raise ValueError(
                f"Layer '{self.owner_name}': the file's asset files hold {saved} "
                f"rows of its table (None: none), not input_dim="
                f"{self.input_dim}; the file is incomplete."
            )
        tier = self.row_tier
        with tier.lock:
            tier.drop_plans()
            self.slot_map.clear()
            self._start_afresh()
            store_assets.load(
                self.owner_name, tier.store.fields, dir_path, tier.store.write
            )

    def _start_afresh(self):
        """Forgets the step state kept under strategies: the replicas'
        rounds (`cache_replicas`), the worker's fingerprint of its copy
        (`cache_workers`: taken again at the next step)."""
        for key in ("_replica_rounds", "_worker_words"):
            self.__dict__.pop(key, None)

    def full_table(self):
        """``{"values" | slot name: [input_dim, width]}``: the store's rows
        overridden by the cached ones (gathered in host memory)."""
        tier = self.row_tier
        with tier.lock:
            fields = tier.store.fields
            out = {f.name: np.empty((self.input_dim, f.width), f.dtype) for f in fields}
            for ids, rows in tier.store.chunks():
                for f in fields:
                    out[f.name][ids] = rows[f.name]
            ids, slots = self.slot_map.cached()
            if ids.size:
                state = self._host_state()
                out[VALUES][ids] = state["table"][slots]
                for name in self.slots:
                    out[name][ids] = state[name][slots]
        return out

    def write_table(self, arrays, iterations=None):
        """Sets the full table (``arrays`` as `full_table` gives, NumPy or
        anything sliceable): into the store chunk by chunk; the cache is
        emptied (every id is filled from the store when next trained)."""
        tier = self.row_tier
        fields = tier.store.fields
        step = max(1, _WRITE_BYTES // sum(f.row_bytes for f in fields))
        with tier.lock:
            tier.drop_plans()
            self.slot_map.clear()
            self._start_afresh()
            for first in range(0, self.input_dim, step):
                end = min(first + step, self.input_dim)
                rows = {f.name: np.asarray(arrays[f.name][first:end]) for f in fields}
                tier.store.write(np.arange(first, end, dtype=np.int64), rows)
        if iterations is not None:
            value = checked_step_count(
                self.owner_name, np.asarray(iterations), self.sparse_iterations
            )
            self.sparse_iterations.assign(value)


def _overridden(chunks, keys, rows, names, state):
    """``chunks`` of a dense store with the rows of the cached ids ``keys``
    (ascending; at cache ``rows``) taken from ``state`` ({``names``[field]:
    host array}): the full table, chunk by chunk."""
    for ids, got in chunks:
        if keys.size:
            at = np.minimum(np.searchsorted(keys, ids), keys.size - 1)
            hit = keys[at] == ids
            if hit.any():
                got = {name: np.array(value) for name, value in got.items()}
                for field, name in names.items():
                    got[field][hit] = state[name][rows[at[hit]]]
        yield ids, got
