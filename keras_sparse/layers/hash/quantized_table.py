"""int8/int4 serving rows of a `DistributedHashEmbedding`.

Mixin of the layer. ``quantize(mode)`` turns its ``[capacity, dim]`` table
into the variables Keras's quantized `Embedding` holds
(`keras_sparse.layers.quantized_rows`: one scale per row); the hash table,
its keys and rows, the serving map and ``stats()`` stay as they were, so a
key reads the dequantized vector of its row. Slots go; the layer is frozen:
a training call (which would insert keys and update rows) raises.

A quantized layer saves its keys as records (``record_keys``,
``record_rows``, ``record_scores``), the table's geometry, clock, step count
and seed, and the quantized table under Keras's names (``embeddings``,
``embeddings_scale``, ...). It loads into a layer of the same capacity and
seed (the saved config builds one), every key back on its row.
"""

import numpy as np
from keras import ops

from keras_sparse.layers import placement
from keras_sparse.layers import quantized_rows
from keras_sparse.layers.hash.host_keys import to_numpy
from keras_sparse.layers.record_checks import checked_int

_RECORDS = ("record_keys", "record_rows", "record_scores")
_GEOMETRY = ("table_capacity", "table_bucket_size", "table_seed")


class QuantizedTable:
    """Mixin of `DistributedHashEmbedding` (see the module docstring)."""

    def quantize(self, mode=None, type_check=True, config=None):
        """Makes the table int8 or int4 in Keras's per-row form; the keys,
        serving map and counters are kept, training is refused after."""
        quantized_rows.check_mode(self.name, mode)
        refused = {
            "`store`": self.row_tier is not None,
            "a sharding placement": self.placement is not None
            or placement.provider().route(self) is not None,
            "an input stage (keras_sparse.data.prefetch)": self.prepared_form
            is not None,
        }
        given = [what for what, on in refused.items() if on]
        if given:
            # NotImplementedError: Model.quantize skips such layers.
            raise NotImplementedError(
                f"Layer '{self.name}': `quantize` needs the table whole in "
                f"this process's variables; this layer has {given[0]}. "
                "Import its `export()` records into a layer without it, "
                "then quantize."
            )
        size = quantized_rows.block_size(self, config)
        arrays = quantized_rows.quantize_values(self.embeddings, mode, config, size)
        quantized_rows.untrack(self, [self.embeddings, *self.slots.values()])
        self.slots = {}
        del self.__dict__["embeddings"]  # already untracked
        if getattr(self, "sparse_anchor", None) is not None:
            delattr(self, "sparse_anchor")  # untracks the variable
            self.sparse_anchor = None
        self.quantized_rows = quantized_rows.add_variables(
            self, self.num_rows, self.output_dim, mode, size
        )
        quantized_rows.assign(self.quantized_rows, arrays)
        self.quantization_config = config
        self._is_quantized = True  # before the policy (whose setter quantizes)
        self.dtype_policy = quantized_rows.policy_name(
            mode, size, self.dtype_policy.name
        )

    def quantized_call(self, inputs, weights=None, training=None):
        if training and self.trainable:
            raise quantized_rows.training_error(
                self.name, "inserting keys and updating rows"
            )
        return self.call(inputs, weights, training)

    def export(self, include_rows=False, since_step=None):
        if getattr(self, "quantized_rows", None) is not None:
            raise ValueError(
                f"Layer '{self.name}': the table is quantized; its records are "
                "in its saves (`model.save`). Export float records before "
                "`quantize()`."
            )
        return super().export(include_rows, since_step=since_step)

    def save_own_variables(self, store):
        if getattr(self, "quantized_rows", None) is None:
            return super().save_own_variables(store)
        keys, rows, scores = (to_numpy(x) for x in self.table.export())
        for name, value in zip(_RECORDS, (keys, rows, scores)):
            store[name] = value
        for name, value in zip(_GEOMETRY, self._geometry()):
            store[name] = np.int64(value)
        store["table_clock"] = np.int64(self._table_clock())
        store["sparse_iterations"] = ops.convert_to_numpy(self.sparse_iterations)
        store["seed_state"] = ops.convert_to_numpy(self.seed_generator.state)
        for name, variable in self.quantized_rows.items():
            store[name] = ops.convert_to_numpy(variable)

    def load_own_variables(self, store):
        if getattr(self, "quantized_rows", None) is None:
            return super().load_own_variables(store)
        names = set(store.keys())
        needed = [*_RECORDS, *_GEOMETRY, "table_clock", *self.quantized_rows]
        missing = [n for n in needed if n not in names]
        if missing:
            raise ValueError(
                f"Layer '{self.name}': the saved state has no {missing} (a "
                f"{self.quantization_mode} hash table's); nothing was loaded. "
                "Load a float save into the float layer, then quantize."
            )
        geometry = tuple(int(np.asarray(store[n][...])) for n in _GEOMETRY)
        if geometry != self._geometry():
            raise ValueError(
                f"Layer '{self.name}': the quantized table was saved with "
                f"(capacity, bucket size, seed) {geometry}; this layer has "
                f"{self._geometry()}; nothing was loaded."
            )
        values = {}
        for name, variable in self.quantized_rows.items():
            values[name] = np.asarray(store[name][...])
            if values[name].shape != tuple(variable.shape):
                raise ValueError(
                    f"Layer '{self.name}': saved '{name}' has shape "
                    f"{values[name].shape}, the layer's {tuple(variable.shape)}"
                    "; nothing was loaded."
                )
        clock = checked_int(
            self.name, "table_clock", store["table_clock"][...], 0, 2**62, ""
        )
        self.table.clear()
        self._table_clock(clock)
        self._table_import(*(np.asarray(store[n][...]) for n in _RECORDS))
        quantized_rows.assign(self.quantized_rows, values)
        for name in ("sparse_iterations",):
            if name in names:
                getattr(self, name).assign(store[name][...])
        if "seed_state" in names:
            self.seed_generator.state.assign(store["seed_state"][...])
