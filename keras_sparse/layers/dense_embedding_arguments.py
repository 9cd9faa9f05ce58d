"""Constructor argument checks of an `AllToAllDenseEmbedding`: names,
sizes, change tracking, ``cache_rows``/``store``, and the Keras features
(LoRA, quantization) a sparse optimizer excludes."""

from keras_sparse.layers import row_changes
from keras_sparse.layers.arguments import check_known
from keras_sparse.layers.arguments import check_positive_int
from keras_sparse.layers.dense_embedding_quantization import quantized_policy
from keras_sparse.layers.dense_embedding_quantization import (
    refuse_with_sparse_optimizer,
)
from keras_sparse.layers.row_storage import cache_checks
from keras_sparse.layers.table_storage import ARGUMENTS as STORAGE_ARGUMENTS

_OWN_ARGUMENTS = (
    "input_dim",
    "output_dim",
    "embeddings_initializer",
    "embeddings_regularizer",
    "embeddings_constraint",
    "mask_zero",
    "weights",
    "lora_rank",
    "lora_alpha",
    "quantization_config",
    "combiner",
    "optimizer",
    "sharding",
    "cache_rows",
    "store",
    "track_changes",
    *STORAGE_ARGUMENTS,
    "input_length",  # deprecated by Keras, which warns and drops it
)


def checked(
    name,
    kwargs,
    input_dim,
    output_dim,
    *,
    mask_zero,
    lora_rank,
    quantization_config,
    optimizer,
    sharding,
    cache_rows,
    store,
    track_changes,
):
    """Raises for a wrong argument; returns ``(track_changes, store)``
    checked (``store``: the store's spec, None without ``cache_rows``)."""
    check_known(name, "AllToAllDenseEmbedding", kwargs, _OWN_ARGUMENTS)
    check_positive_int(f"Layer '{name}'", "input_dim", input_dim)
    check_positive_int(f"Layer '{name}'", "output_dim", output_dim)
    track_changes = row_changes.check_flag(name, track_changes)
    row_changes.check_sparse(name, track_changes, optimizer)
    store_spec = None
    if cache_rows is not None or store is not None:
        store_spec = cache_checks.check_arguments(
            f"Layer '{name}'", input_dim, cache_rows, store, optimizer, sharding,
            mask_zero=mask_zero, lora_rank=lora_rank,
            quantization_config=quantization_config,
        )  # fmt: skip
    if optimizer is not None:
        # A quantized layer's config (a save of `quantize()`'s result)
        # holds the config it was quantized with.
        quantized = quantized_policy(kwargs.get("dtype"))
        for arg, value in (
            ("lora_rank", lora_rank),
            ("quantization_config", None if quantized else quantization_config),
        ):
            if value is not None:
                refuse_with_sparse_optimizer(name, arg, value)
    return track_changes, store_spec
