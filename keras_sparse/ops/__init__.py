"""Per-backend lookup primitives with the sparse update in their backward.

``keras_sparse.ops.jax``, ``.tensorflow`` and ``.torch`` hold one package per
backend with the same module names; `backend_module` is the one place that
picks the active backend's ``lookup`` module, whose ``lookup(state, batch)``
has the same signature on every backend (`keras_sparse.ops.lookup_batch`).
"""

import importlib

import keras

_MODULES = {
    "jax": "keras_sparse.ops.jax.lookup",
    "tensorflow": "keras_sparse.ops.tensorflow.lookup",
    "torch": "keras_sparse.ops.torch.lookup",
}


def backend_module():
    """The ``lookup`` module of the active Keras backend's package."""
    name = keras.backend.backend()
    if name not in _MODULES:
        raise NotImplementedError(
            f"keras_sparse supports the jax, tensorflow and torch backends; the "
            f"active Keras backend is {name!r}."
        )
    return importlib.import_module(_MODULES[name])


def check_replicated_training(layer_name, maps_keys=False):
    """Raises, before a training call changes any state, where the backend's
    replicas (tf.distribute, torch DDP) could not train the layer exactly.

    ``maps_keys``: the layer maps keys to rows on the host (a hash layer),
    which replicas would each do on their own.
    """
    check = getattr(backend_module(), "check_replicated_training", None)
    if check is not None:
        check(layer_name, maps_keys)


def hash_layer_refusal(name, where, advice):
    """The error for a hash layer on replicas that each map their own keys
    (tf.distribute, torch DDP): the replicas' tables would differ."""
    return NotImplementedError(
        f"Layer '{name}': DistributedHashEmbedding cannot train under {where}: "
        "each replica maps its own keys to rows in its own host table, so "
        f"the replicas' tables would differ. Train it {advice}, or on the JAX "
        "backend with keras_sparse.distribution."
    )


def variable_layer_name(variable):
    """The owning layer's name, from the variable's path ("layer/embeddings")."""
    path = getattr(variable, "path", None) or getattr(variable, "name", "?")
    return path.rsplit("/", 1)[0]


def lookup(state, batch):
    """Gathers rows; the backward pass applies the sparse optimizer in place.

    ``state``: a `keras_sparse.ops.lookup_batch.TableState`, ``batch`` a
    `keras_sparse.ops.lookup_batch.LookupBatch`; see the per-backend
    ``lookup`` modules for how each framework is wired.
    """
    return backend_module().lookup(state, batch)


def take_rows(table, ids):
    """``table[ids]`` along axis 0 for ids known to be in range.

    On JAX this is a bare XLA gather (``mode="clip"``); ``keras.ops.take``
    adds a bounds test and a select over the result there.
    """
    if keras.backend.backend() == "jax":
        import jax.numpy as jnp

        return jnp.take(table, ids, axis=0, mode="clip")
    return keras.ops.take(table, ids, axis=0)
