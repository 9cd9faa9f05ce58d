"""Checks a batch against the tables with ``cache_rows`` it feeds, before
a compiled JAX step under a Keras distribution.

Under a distribution the step's host mapping runs once, on one device,
while the others wait for it at their first collective: an error raised
there (an id outside ``[0, input_dim)``, more distinct ids than
``cache_rows``) would leave them waiting until XLA aborts the process. So
`keras_sparse.layers.jax_full_keys` checks each batch first, with these
functions, and the step is not run. On one device the step itself raises.
Across JAX processes each process checks the whole global batch (the
processes' batches gathered, `cache_jax_processes.gather_batch`), so all
raise alike or none does: a process left alone in the step would wait.
"""

import keras
import numpy as np

from keras_sparse.layers.row_storage import cache_jax_processes
from keras_sparse.layers.row_storage import cache_processes


def feeds(model):
    """``[(cache, ModelInput)]``: the tables with ``cache_rows`` that read a
    model input directly (an `AllToAllDenseEmbedding`'s ids, a key of an
    `EmbeddingCollection`'s dict), called without weights (weight 0 leaves
    an id out, which a check of the ids alone cannot see)."""
    from keras_sparse.layers.model_feeds import model_inputs

    found = []
    inputs = None
    for layer in model._flatten_layers(include_self=False, recursive=True):
        caches = getattr(layer, "table_caches", None) or {}
        row_cache = getattr(layer, "row_cache", None)
        if not caches and row_cache is None:
            continue
        inputs = model_inputs(model) if inputs is None else inputs
        for node in getattr(layer, "_inbound_nodes", []):
            args = node.arguments.args
            if not args or len(args) > 1 or node.arguments.kwargs.get("weights"):
                continue
            if row_cache is not None:
                pairs = [(row_cache, args[0])]
            elif isinstance(args[0], dict):
                pairs = [(caches[n], t) for n, t in args[0].items() if n in caches]
            else:
                pairs = []
            found += [(c, inputs[id(t)]) for c, t in pairs if id(t) in inputs]
    return found


def needed():
    """True when a step's host error would stall the other devices."""
    if keras.backend.backend() != "jax":
        return False
    devices = getattr(
        getattr(keras.distribution.distribution(), "device_mesh", None),
        "devices",
        None,
    )
    return devices is not None and np.size(devices) > 1


def check(cache, ids, training=True):
    """Raises ValueError naming the table when ``ids`` (one call's) hold an
    id outside ``[0, input_dim)`` or, in ``training``, more distinct ids
    than ``cache_rows`` (inference reads ids the cache does not hold from
    the store); the cache and its store are not changed."""
    ids = np.asarray(ids)
    if not ids.size or not np.issubdtype(ids.dtype, np.integer):
        return
    cache.slot_map.check_range(ids.reshape(-1))
    if not training:
        return
    distinct = np.unique(ids).size
    if distinct > cache.capacity:
        raise ValueError(
            f"Layer '{cache.owner_name}': a batch holds {distinct} distinct "
            f"ids, more than cache_rows={cache.capacity}; the step is not "
            "run. Use a larger `cache_rows` (1 <= cache_rows <= input_dim="
            f"{cache.input_dim}) or a smaller batch."
        )


def check_batch(x, cached, training):
    """`check` of each table of ``cached`` (see `feeds`) on its ids in the
    batch ``x``; ``training``: a training batch (else the range only)."""
    from keras_sparse.layers.model_feeds import array_at

    several = cache_jax_processes.active()
    for cache, model_input in cached:
        try:
            ids = array_at(x, model_input.find(x))
        except (ValueError, KeyError, IndexError, TypeError):
            continue  # not in this batch: Keras reports that itself
        if several:  # every process checks the same global batch
            ids = cache_jax_processes.gather_batch(ids)
        check(cache, ids, training)


def check_copies(cached):
    """`cache_processes.check_copies` of the tables of ``cached`` (see
    `feeds`) across JAX processes, before a step takes the model's state
    (the step's trace cannot read the variables)."""
    if not cache_jax_processes.active():
        return
    for cache in dict.fromkeys(cache for cache, _ in cached):
        cache_processes.check_copies(cache)
