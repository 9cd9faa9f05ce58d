"""Small backend probes shared by the layers."""

import keras


def is_symbolic(x):
    """True when ``x`` is traced (jit, tf.function, torch.compile), not eager."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return isinstance(x, jax.core.Tracer)
    if backend == "tensorflow":
        import tensorflow as tf

        return not tf.executing_eagerly()
    if backend == "torch":
        import torch

        return torch.compiler.is_compiling() or getattr(x, "is_meta", False)
    return True


def is_tf_ragged_or_sparse(x):
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return isinstance(x, (tf.RaggedTensor, tf.SparseTensor))


def is_tf_ragged(x):
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return isinstance(x, tf.RaggedTensor)


def is_jax_sparse(x):
    """True for a `jax.experimental.sparse.BCOO` (Keras's JAX sparse form)."""
    if keras.backend.backend() != "jax":
        return False
    from jax.experimental import sparse as jax_sparse

    return isinstance(x, jax_sparse.BCOO)
