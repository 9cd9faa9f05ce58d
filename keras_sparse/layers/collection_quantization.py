"""int8/int4 tables of an `EmbeddingCollection` (`quantize`, its lookups,
saves).

Each stack's float variable becomes the variables Keras's quantized
`Embedding` holds (`keras_sparse.layers.quantized_rows`), rows quantized one
by one, so every table's rows equal those of a quantized
`keras.layers.Embedding` holding that table. Slots and the step counter go.
The saved state stays per table: ``"{table}:embeddings"``,
``"{table}:embeddings_scale"`` (and for grouped int4
``"{table}:embeddings_zero"``, ``"{table}:g_idx"``), in Keras's layouts.
"""

from keras import ops

from keras_sparse.layers import placement
from keras_sparse.layers import quantized_rows

#: Entries with a value per row (``g_idx`` is per column: saved whole).
_PER_ROW = ("embeddings", "embeddings_scale", "embeddings_zero")


def quantize(layer, mode, config):
    quantized_rows.check_mode(layer.name, mode)
    hooks = placement.provider()
    if layer.table_caches or any(hooks.route_stack(s) for s in layer.stacks):
        # NotImplementedError: Model.quantize skips such layers.
        raise NotImplementedError(
            f"Layer '{layer.name}': `quantize` needs every table held whole "
            "in the collection's variables; tables with `cache_rows` "
            f"({list(layer.table_caches)}) or sharded under a distribution "
            "are not quantized. Quantize a collection built without them "
            "(`set_table` moves each table)."
        )
    size = quantized_rows.block_size(layer, config)
    arrays = {
        stack.name: quantized_rows.quantize_values(
            layer._whole(stack, layer._stack_tables[stack.name]), mode, config, size
        )
        for stack in layer.stacks
    }
    old = []
    for stack in layer.stacks:
        old += layer.stack_variables(stack.name)
    quantized_rows.untrack(layer, old)
    for name in ("sparse_iterations", "sparse_anchor"):
        if hasattr(layer, name):
            delattr(layer, name)  # untracks a variable
    layer.sparse_anchor = None
    layer._stack_tables, layer._stack_slots = {}, {}
    _add_variables(layer, mode, size)
    for stack in layer.stacks:
        quantized_rows.assign(layer._stack_quantized[stack.name], arrays[stack.name])
    layer.quantization_config = config
    layer._is_quantized = True  # before the policy (whose setter quantizes)
    layer.dtype_policy = quantized_rows.policy_name(mode, size, layer.dtype_policy.name)


def build(layer):
    """Variables of a collection built quantized (loading a quantized save)."""
    _add_variables(
        layer, layer.quantization_mode, quantized_rows.block_size(layer, None)
    )
    layer._is_quantized = True


def _add_variables(layer, mode, size):
    layer._stack_quantized = {
        stack.name: quantized_rows.add_variables(
            layer, stack.rows, stack.dim, mode, size, prefix=f"{stack.name}_"
        )
        for stack in layer.stacks
    }


def gather(layer, stack, flat_ids, flat_valid):
    """Dequantized rows of ``stack`` at ``flat_ids`` (invalid ones zeros)."""
    safe = ops.where(flat_valid, flat_ids, ops.zeros_like(flat_ids))
    rows = quantized_rows.gather(
        layer._stack_quantized[stack.name],
        safe,
        layer.quantization_mode,
        stack.dim,
        layer.compute_dtype,
    )
    return ops.where(ops.expand_dims(flat_valid, -1), rows, ops.zeros_like(rows))


def table_values(layer, name):
    """Table ``name``'s dequantized rows (NumPy)."""
    stack = layer._stack_of(name)
    start = stack.offsets[name]
    ids = ops.arange(start, start + layer.tables[name].input_dim, dtype="int32")
    return ops.convert_to_numpy(
        quantized_rows.gather(
            layer._stack_quantized[stack.name],
            ids,
            layer.quantization_mode,
            stack.dim,
            "float32",
        )
    )


def save(layer, store):
    for stack in layer.stacks:
        for entry, variable in layer._stack_quantized[stack.name].items():
            value = ops.convert_to_numpy(variable)
            for name in stack.tables:
                if entry in _PER_ROW:
                    start = stack.offsets[name]
                    rows = value[start : start + layer.tables[name].input_dim]
                else:
                    rows = value
                store[f"{name}:{entry}"] = rows


def load(layer, store):
    """Every entry checked before any variable changes."""
    updates = []
    for stack in layer.stacks:
        for entry, variable in layer._stack_quantized[stack.name].items():
            full = ops.convert_to_numpy(variable).copy()
            for name in stack.tables:
                key = f"{name}:{entry}"
                if key not in store:
                    raise ValueError(
                        f"Layer '{layer.name}': the saved state has no '{key}' "
                        f"(a {layer.quantization_mode} table); nothing was "
                        "loaded. Load a float save into the float collection, "
                        "then quantize."
                    )
                value = store[key][...]
                start = stack.offsets[name]
                rows = layer.tables[name].input_dim
                part = full[start : start + rows] if entry in _PER_ROW else full
                if tuple(value.shape) != part.shape:
                    raise ValueError(
                        f"Layer '{layer.name}', table '{name}': saved "
                        f"'{entry}' has shape {tuple(value.shape)}, the "
                        f"table's {part.shape}; nothing was loaded."
                    )
                part[...] = value
            updates.append((variable, full))
    for variable, full in updates:
        variable.assign(full)
