"""The argument checks of a table with ``cache_rows`` (a fixed vocabulary
cached on the device over a row store, `keras_sparse.layers.dense_cache`):
what `AllToAllDenseEmbedding` and `EmbeddingCollection` refuse, each error
naming the table and the argument."""

import keras
import numpy as np

from keras_sparse.layers.hash.keyed_fresh_rows import has_seed
from keras_sparse.layers.hash.keyed_fresh_rows import per_key

_CONSTANT_INITS = (
    keras.initializers.Zeros,
    keras.initializers.Ones,
    keras.initializers.Constant,
)


def check_arguments(
    where, input_dim, cache_rows, store, optimizer, sharding, **refused
):
    """The store spec of a table given ``cache_rows``; raises ValueError
    naming the argument when the cache cannot keep the table exact.
    ``where``: how errors name the table ("Layer 'ids'")."""
    check_cache_rows(where, input_dim, cache_rows, store)
    check_optimizer(where, optimizer)
    check_sharding(where, sharding)
    for arg, value in refused.items():
        if value:
            raise ValueError(
                f"{where}: `{arg}`={value!r} is not available with "
                f"`cache_rows` (a table cached on the device trains with the "
                f"layer's sparse optimizer only). Drop `{arg}` or `cache_rows`."
            )
    return store_spec(where, store)


def check_optimizer(where, optimizer):
    """Refuses ``optimizer=None`` (dense gradients) with ``cache_rows``."""
    if optimizer is None:
        raise ValueError(
            f"{where}: `cache_rows` needs a sparse `optimizer` (e.g. "
            "'adagrad'): the cached rows change ids as they are evicted, so "
            "the layer updates them itself, not the model's optimizer. "
            "Received: optimizer=None."
        )


def check_sharding(where, sharding):
    """Refuses the strategies a cached table does not support yet."""
    if sharding not in ("auto", "data"):
        raise ValueError(
            f"{where}: `sharding`={sharding!r} is not available with "
            "`cache_rows` yet: use 'data' or 'auto' (one device)."
        )


def store_spec(where, store):
    """The `keras_sparse.store` spec ``store`` names ("host" when None)."""
    from keras_sparse import store as row_stores

    try:
        return row_stores.get("host" if store is None else store)
    except ValueError as e:
        raise ValueError(f"{where}: `store`: {e}") from None


def check_cache_rows(where, input_dim, cache_rows, store):
    """Raises ValueError unless ``cache_rows`` is an int in [1, input_dim]
    (a ``store`` needs one)."""
    if cache_rows is None:
        raise ValueError(
            f"{where}: `store`={store!r} needs `cache_rows` (the rows the "
            "device holds, 1 <= cache_rows <= input_dim)."
        )
    if (
        not isinstance(cache_rows, (int, np.integer))
        or isinstance(cache_rows, bool)
        or not 1 <= cache_rows <= input_dim
    ):
        raise ValueError(
            f"{where}: `cache_rows` must be an integer in [1, input_dim="
            f"{input_dim}]. Received: cache_rows={cache_rows!r}."
        )


def check_initializer(where, initializer):
    """Refuses initializers with no per-id form (their values for one chunk
    would depend on the chunk)."""
    if per_key(initializer) or (
        isinstance(initializer, _CONSTANT_INITS) and not has_seed(initializer)
    ):
        return
    raise ValueError(
        f"{where}: with `cache_rows` the table is initialized chunk by "
        "chunk, each id's row a function of (seed, id): "
        "`embeddings_initializer` must be RandomUniform, RandomNormal, "
        "TruncatedNormal, a VarianceScaling initializer (Glorot, He, Lecun) "
        f"or a constant; received {type(initializer).__name__}."
    )


#: What a table with ``cache_rows`` supports under distributions (errors
#: say it; `keras_sparse.layers.row_storage.hash_store` lists the hash
#: layers' combinations).
ONE_DEVICE_ONLY = (
    "A table with `cache_rows` trains on one device, under a Keras "
    "distribution (JAX, one process or several: a copy in each process) or "
    "a TensorFlow MirroredStrategy of one process (its cache replicated), or "
    "in the workers of a TensorFlow MultiWorkerMirroredStrategy or "
    "torch.distributed processes under DistributedDataParallel (a copy in "
    "each process); under other sharding, use a DistributedHashEmbedding "
    "with `store=` (sharding='key' on every backend, also sharding='data' on "
    "JAX) or drop `cache_rows`."
)


def check_one_device(name):
    """Refuses the several devices a cache cannot follow: a tf.distribute
    strategy other than a (MultiWorker)MirroredStrategy (each host would map
    its own part of the batch into its own rows). In one process one id map
    and one store serve the cache, replicated on every device: a Keras
    distribution (the step's host callback sees the whole batch,
    `dense_cache`), a MirroredStrategy (the replicas gather the batch,
    `cache_replicas`). torch.distributed processes under DDP, the JAX
    processes of a Keras distribution and the workers of a
    MultiWorkerMirroredStrategy each hold a copy of the map, store and
    cache, all mapping the whole batch (`cache_processes`,
    `cache_jax_processes`, `cache_workers`)."""
    where = _several_devices()
    if where is not None:
        raise ValueError(
            f"Layer '{name}': `cache_rows` is not available under {where} yet "
            f"(`sharding`): build and train the layer on one device. "
            f"{ONE_DEVICE_ONLY}"
        )


def _several_devices():
    """Where the layer would run on several devices (words for errors), or
    None on one."""
    backend = keras.backend.backend()
    dist = keras.distribution.distribution()
    devices = getattr(getattr(dist, "device_mesh", None), "devices", None)
    if devices is not None and np.size(devices) > 1:
        if backend == "jax":  # one process or several (a copy in each)
            return None
        return f"a distribution over {np.size(devices)} devices"
    if backend == "tensorflow":
        import tensorflow as tf

        if tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
            # A MirroredStrategy: one host map serves every replica's copy
            # (`cache_replicas`); a MultiWorkerMirroredStrategy: one per
            # worker, each mapping the whole batch (`cache_workers`).
            mirrored = (
                tf.distribute.MirroredStrategy,
                tf.distribute.MultiWorkerMirroredStrategy,
            )
            if strategy.num_replicas_in_sync > 1 and not isinstance(strategy, mirrored):
                return (
                    f"{type(strategy).__name__} over "
                    f"{strategy.num_replicas_in_sync} replicas"
                )
    return None
