"""Per-backend lookup primitives with the sparse update in their backward."""

import importlib

import keras

_MODULES = {
    "jax": "keras_sparse.ops.jax_lookup",
    "tensorflow": "keras_sparse.ops.tensorflow_lookup",
    "torch": "keras_sparse.ops.torch_lookup",
}


def backend_module():
    """The lookup module of the active Keras backend."""
    name = keras.backend.backend()
    if name not in _MODULES:
        raise NotImplementedError(
            f"keras_sparse supports the jax, tensorflow and torch backends; the "
            f"active Keras backend is {name!r}."
        )
    return importlib.import_module(_MODULES[name])


def lookup_with_sparse_update(*args, **kwargs):
    """Gathers rows; the backward pass applies the sparse optimizer in place.

    See the per-backend modules for how each framework is wired.
    """
    return backend_module().lookup_with_sparse_update(*args, **kwargs)


def take_rows(table, ids):
    """``table[ids]`` along axis 0 for ids known to be in range.

    On JAX this is a bare XLA gather (``mode="clip"``); ``keras.ops.take``
    adds a bounds test and a select over the result there.
    """
    if keras.backend.backend() == "jax":
        import jax.numpy as jnp

        return jnp.take(table, ids, axis=0, mode="clip")
    return keras.ops.take(table, ids, axis=0)
