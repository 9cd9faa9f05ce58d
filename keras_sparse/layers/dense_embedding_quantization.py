"""LoRA and int8/int4 tables of an `AllToAllDenseEmbedding`.

Both are Keras Embedding features whose variables the model's optimizer
trains (or nothing trains), so they need ``optimizer=None``; a quantized
layer looks ids up with Keras's own int8/int4 code, with combiners and
per-id weights added here. Saves of such a layer are Keras's own.
"""

import keras
from keras import ops

from keras_sparse.layers import inputs as input_forms
from keras_sparse.layers import placement
from keras_sparse.layers import quantized_rows


def refuse_with_sparse_optimizer(layer_name, argument, value, error=ValueError):
    raise error(
        f"Layer '{layer_name}': `{argument}`={value!r} needs optimizer=None. "
        "LoRA and quantized tables are Keras Embedding features whose "
        "variables the model's optimizer trains (or nothing trains); a "
        "sparse optimizer updates the table's rows itself. Pass "
        "optimizer=None, or drop the argument."
    )


def quantized_policy(dtype):
    """Whether ``dtype`` (a layer's ``dtype`` argument) is int8/int4."""
    if dtype is None:
        return False
    try:
        mode = keras.dtype_policies.get(dtype).quantization_mode
    except (ValueError, TypeError):
        return False
    return mode in quantized_rows.MODES


def keras_state(layer):
    """True where Keras's own save/load applies (quantized or LoRA)."""
    return bool(layer.quantization_mode) or layer.lora_enabled


def enable_lora(layer, rank, lora_alpha, a_initializer, b_initializer):
    if layer.uses_sparse_update:
        refuse_with_sparse_optimizer(layer.name, "lora_rank", rank)
    keras.layers.Embedding.enable_lora(
        layer, rank, lora_alpha, a_initializer, b_initializer
    )


def quantize(layer, mode, config):
    """`quantize` of a layer whose type the caller checked."""
    quantized_rows.check_mode(layer.name, mode)
    sharded = layer.placement is not None or placement.provider().route(layer)
    if layer.row_cache is not None or sharded:
        # NotImplementedError: Model.quantize skips such layers.
        raise NotImplementedError(
            f"Layer '{layer.name}': `quantize` needs a table held whole in "
            "the layer's variables; this one is cached over a store "
            "(`cache_rows`) or sharded. Quantize a copy built without "
            "them (set_weights moves the table)."
        )
    training_state = [layer._embeddings, *layer.slots.values()]
    keras.layers.Embedding.quantize(layer, mode, type_check=False, config=config)
    if layer.uses_sparse_update:
        # The frozen table needs no optimizer state (as Keras drops the
        # float table): slots, scratch, step counter and anchor go.
        quantized_rows.untrack(layer, training_state[1:])
        scratches = getattr(layer, "_dedup_scratch_by_table", {})
        name = scratches.pop(training_state[0].path, None)
        if name is not None:
            layer._tracker.untrack(getattr(layer, f"_dedup_scratch_{name}"))
        layer.slots = {}
        for name in ("sparse_iterations", "sparse_anchor"):
            if getattr(layer, name, None) is not None:
                delattr(layer, name)  # untracks the variable
        layer.sparse_anchor = None


def quantized_call(layer, inputs, weights=None, training=None):
    """Keras's int8/int4 lookups, with combiners and per-id weights."""
    if training and layer.trainable and layer.uses_sparse_update:
        raise quantized_rows.training_error(layer.name, "a sparse update")
    keras_call = keras.layers.Embedding.quantized_call
    if (
        layer.combiner is None
        and weights is None
        and not input_forms.is_ragged_or_sparse(inputs)
    ):
        return keras_call(layer, inputs, training=training)
    ids, weights, valid = layer._ids(inputs, weights)
    safe = ops.where(valid, ids, ops.zeros_like(ids))
    rows = keras_call(layer, safe, training=training)
    rows = ops.where(ops.expand_dims(valid, -1), rows, ops.zeros_like(rows))
    return ops.cast(layer.combine(rows, weights, valid), layer.compute_dtype)
