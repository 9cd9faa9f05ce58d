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
