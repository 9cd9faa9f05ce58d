"""Keras layers of keras_sparse."""

from keras_sparse.layers.dense_embedding import AllToAllDenseEmbedding
from keras_sparse.layers.inputs import ragged_to_padded

__all__ = ["AllToAllDenseEmbedding", "ragged_to_padded"]
