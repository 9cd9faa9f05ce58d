"""int8/int4 serving tables in the form Keras's quantized `Embedding` keeps.

`quantize_values` turns a float ``[rows, dim]`` table into the arrays
``keras.layers.Embedding.quantize`` makes for the same mode and config, by
the same Keras quantizers: ``embeddings`` (int8; int4 packed two per byte)
and ``embeddings_scale`` (per row), plus for grouped int4 (Keras's default
``Int4QuantizationConfig(block_size=128)``) ``embeddings_zero`` and
``g_idx``. Each row is quantized on its own, so a stack of tables or a hash
table's rows quantize as the tables would one by one. `gather` looks rows
up and dequantizes them as Keras's ``_int8_call`` / ``_int4_call`` do.
The tables are frozen: `training_error` is what a training call raises.
"""

import math

import keras
import numpy as np
from keras import ops

MODES = ("int8", "int4")
#: Variable names in Keras's saved order (`Embedding.variable_serialization_spec`).
NAMES = ("embeddings", "embeddings_scale", "embeddings_zero", "g_idx")


def check_mode(layer_name, mode):
    if mode not in MODES:
        raise NotImplementedError(
            f"Layer '{layer_name}': quantization mode {mode!r} is not "
            f"available for keras_sparse tables; valid modes are {MODES}."
        )


def block_size(layer, config=None):
    """int4's group size (None: one scale per row), from ``config`` when
    quantizing, else from the layer's dtype policy (a loaded layer)."""
    if isinstance(config, keras.quantizers.Int4QuantizationConfig):
        size = config.block_size
    else:
        size = getattr(layer.dtype_policy, "block_size", None)
    return None if size is None or size == -1 else int(size)


def policy_name(mode, size, base):
    """Keras's quantized dtype policy name, e.g. ``int8_from_float32``."""
    if mode == "int4":
        mode = f"int4/{-1 if size is None else size}"
    return f"{mode}_from_{base}"


def shapes(rows, dim, mode, size):
    """``{name: (shape, dtype)}`` of a quantized ``[rows, dim]`` table."""
    if mode == "int8":
        return {
            "embeddings": ((rows, dim), "int8"),
            "embeddings_scale": ((rows,), "float32"),
        }
    packed = ((rows, (dim + 1) // 2), "int8")
    if size is None:
        return {"embeddings": packed, "embeddings_scale": ((rows,), "float32")}
    groups = math.ceil(dim / size)
    return {
        "embeddings": packed,
        "embeddings_scale": ((rows, groups), "float32"),
        "embeddings_zero": ((rows, groups), "int8"),
        "g_idx": ((dim,), "float32"),
    }


def quantize_values(values, mode, config=None, size=None):
    """``{name: NumPy array}`` of float ``values`` (``[rows, dim]``), as
    ``keras.layers.Embedding.quantize(mode, config=config)`` stores them."""
    values = np.asarray(ops.convert_to_numpy(values), dtype="float32")
    default = keras.quantizers.QuantizationConfig.weight_quantizer_or_default
    if mode == "int8":
        quantizer = default(config, keras.quantizers.AbsMaxQuantizer(axis=-1))
        q, scale = quantizer(values, to_numpy=True)
        return {
            "embeddings": ops.convert_to_numpy(q).astype("int8"),
            "embeddings_scale": ops.convert_to_numpy(scale).reshape(-1),
        }
    if size is None:
        quantizer = default(
            config,
            keras.quantizers.AbsMaxQuantizer(
                axis=-1, value_range=(-8, 7), output_dtype="int8"
            ),
        )
        q, scale = quantizer(values, to_numpy=True)
        out = {"embeddings_scale": ops.convert_to_numpy(scale).reshape(-1)}
    else:
        q, scale, zero = keras.quantizers.abs_max_quantize_grouped_with_zero_point(
            values.T, block_size=size, value_range=(-8, 7), dtype="int8", to_numpy=True
        )
        q = ops.convert_to_numpy(q).T
        out = {
            "embeddings_scale": ops.convert_to_numpy(scale).T,
            "embeddings_zero": ops.convert_to_numpy(zero).T.astype("int8"),
            "g_idx": np.floor_divide(np.arange(values.shape[1]), size).astype(
                "float32"
            ),
        }
    packed, _, _ = keras.quantizers.pack_int4(ops.convert_to_numpy(q), axis=-1)
    out["embeddings"] = ops.convert_to_numpy(packed).astype("int8")
    return {name: out[name] for name in NAMES if name in out}


def add_variables(layer, rows, dim, mode, size, prefix=""):
    """``{name: variable}``: non-trainable variables of a quantized table."""
    made = {}
    for name, (shape, dtype) in shapes(rows, dim, mode, size).items():
        made[name] = layer.add_weight(
            name=prefix + name,
            shape=shape,
            initializer="ones" if name == "embeddings_scale" else "zeros",
            dtype=dtype,
            trainable=False,
            autocast=False,
        )
    return made


def assign(variables, arrays):
    for name, variable in variables.items():
        variable.assign(arrays[name])


def gather(variables, ids, mode, dim, compute_dtype):
    """Dequantized rows ``[*ids.shape, dim]`` at in-range ``ids``."""
    ids = ops.cast(ids, "int32")
    q = ops.take(variables["embeddings"], ids, axis=0)
    if mode == "int4":
        q = keras.quantizers.unpack_int4(q, dim, axis=-1)
    rows = ops.cast(q, compute_dtype)
    scale = ops.take(variables["embeddings_scale"], ids, axis=0)
    if "embeddings_zero" not in variables:
        return ops.divide(rows, ops.expand_dims(ops.cast(scale, compute_dtype), -1))
    # Grouped int4, as keras.quantizers' dequantize_with_sz_map.
    groups = ops.cast(variables["g_idx"], "int32")
    zero = ops.take(variables["embeddings_zero"], ids, axis=0)
    scale = ops.cast(ops.take(scale, groups, axis=-1), compute_dtype)
    zero = ops.cast(ops.take(zero, groups, axis=-1), compute_dtype)
    return ops.multiply(ops.subtract(rows, zero), scale)


def training_error(layer_name, what="training"):
    return ValueError(
        f"Layer '{layer_name}': the table is quantized (int8/int4 serving "
        f"rows) and cannot be trained; {what} needs the float layer. "
        "Train before `quantize()`, or call the layer with training=False "
        "(or set `layer.trainable = False`)."
    )


def untrack(layer, variables):
    """Drops variables a quantized layer no longer has (table, slots) and
    the tables' dedup scratches, as Keras's quantize drops the float
    table."""
    scratches = getattr(layer, "_dedup_scratch_by_table", {})
    for variable in variables:
        name = scratches.pop(variable.path, None)
        if name is not None:
            layer._tracker.untrack(getattr(layer, f"_dedup_scratch_{name}"))
        layer._untrack_variable(variable)
