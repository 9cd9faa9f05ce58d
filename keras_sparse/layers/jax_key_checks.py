"""Refusals of keys and ids that a JAX step without x64 would see wrapped
to 32 bits (`keras_sparse.layers.jax_full_keys` queues the full keys
where it can, and refuses the rest here).

Int64 keys beyond int32 are refused when the inputs feeding the hash layers
cannot be found (subclassed models, a layer fed by another layer), when a
layer declares ``key_dtype='int32'``, and as ids of fixed-vocabulary layers
(which read the device's ids directly). In-memory data is checked before
Keras takes the model's state (`precheck`); other sources batch by batch.
"""

import numpy as np

from keras_sparse.layers.row_storage import cache_batches
from keras_sparse.layers.row_storage import cache_jax_processes

_INT32 = np.iinfo(np.int32)


def check_ids_fit(model, x, fixed_layers):
    """Refuses int64 ids beyond int32 that fixed-vocabulary layers read: the
    step would see them wrapped to 32 bits (``2**32 + 5`` as 5) and train
    that row."""
    from keras_sparse.layers.model_feeds import array_at

    for name, model_input in fixed_layers:
        try:
            a = array_at(x, model_input.find(x))
        except (ValueError, KeyError, IndexError, TypeError):
            continue  # not in this batch: Keras reports that itself
        first = first_beyond_int32(a)
        if first is not None:
            wrapped = (first + 2**31) % 2**32 - 2**31
            raise ValueError(
                f"Model '{model.name}': id {first} ({a.dtype}) for layer "
                f"'{name}' is beyond the int32 range. JAX without "
                f"`jax_enable_x64` would wrap it to {wrapped} in the compiled "
                "step and train that row, so the step is not run. Ids of "
                "AllToAllDenseEmbedding / EmbeddingCollection must lie in "
                "[0, input_dim)."
            )


def is_wide(a):
    """Whether ``a`` is a NumPy int64/uint64 array (JAX would narrow it)."""
    return isinstance(a, np.ndarray) and a.dtype in (np.int64, np.uint64)


def check_fits_int32(model, x, problem):
    """Refuses int64 keys beyond int32 anywhere in ``x`` when the inputs
    feeding the hash layers are unknown (``problem`` says why): their full
    keys cannot be queued, and the step would map truncated ones."""
    from keras import tree

    for a in tree.flatten(x):
        if is_wide(a) and a.size:
            if a.dtype == np.uint64 or a.min() < _INT32.min or a.max() > _INT32.max:
                raise ValueError(
                    f"Model '{model.name}': int64 keys beyond the int32 range "
                    "reach a DistributedHashEmbedding, but JAX (without "
                    "`jax_enable_x64`) would truncate them to 32 bits and "
                    "keras_sparse cannot tell which input feeds the layer "
                    f"({problem}). Use `keras_sparse.data.prefetch(data, "
                    "model, feature_map=...)`, or enable x64 with "
                    "`jax.config.update('jax_enable_x64', True)` before "
                    "building the model."
                )


def first_beyond_int32(a):
    """The first value of a wide NumPy array outside int32, or None."""
    if not is_wide(a) or not a.size:
        return None
    bad = a > _INT32.max
    if a.dtype != np.uint64:
        bad |= a < _INT32.min
    return int(a[bad].reshape(-1)[0]) if bad.any() else None


def check_declared_int32(layer, keys):
    """Refuses keys beyond int32 for a layer declaring ``key_dtype='int32'``
    (its keys are not queued: the step's must be exact)."""
    first = first_beyond_int32(keys)
    if first is not None:
        raise ValueError(
            f"Layer '{layer.name}': key {first} is beyond the int32 range, but "
            "the layer declares key_dtype='int32' (keys in [-2**31, 2**31)). "
            "JAX without `jax_enable_x64` would wrap it to 32 bits in the "
            "compiled step, so the step is not run. Use key_dtype='int64' "
            "(the default) for wider keys."
        )


def precheck(model, model_feeds, args, kwargs):
    """Fails before Keras takes the model's state when in-memory data is bad.

    An exception raised from inside a JAX step (where batches are pulled)
    would leave the model's variables detached; arrays given directly can be
    checked up front. Other sources are checked batch by batch.
    ``model_feeds``: the model's feeds (`jax_full_keys`' `_ModelFeeds`).
    """
    if model_feeds.cached:  # across JAX processes: their copies are equal
        cache_batches.check_copies(model_feeds.cached)
    x = args[0] if args else kwargs.get("x")
    validation = kwargs.get("validation_data")
    for data in (x, validation[0] if isinstance(validation, tuple) else None):
        if not isinstance(data, (np.ndarray, dict, list, tuple)):
            continue
        if model_feeds.problem is not None:
            check_fits_int32(model, data, model_feeds.problem)
            continue
        # Up front: a batch refused inside Keras's JAX loop would leave the
        # model's variables detached.
        if model_feeds.fixed_layers:
            check_ids_fit(model, data, model_feeds.fixed_layers)
        if model_feeds.cached and cache_batches.needed():
            # The range (across processes each batch's, all checking alike).
            if not cache_jax_processes.active():
                cache_batches.check_batch(data, model_feeds.cached, False)
        for feed in model_feeds.hash_feeds:
            if feed.layer.key_dtype != "int32":
                continue
            from keras_sparse.layers.model_feeds import array_at

            try:
                keys = array_at(data, feed.keys.find(data))
            except (ValueError, KeyError, IndexError, TypeError):
                continue
            if is_wide(keys):
                check_declared_int32(feed.layer, keys)
