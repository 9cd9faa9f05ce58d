"""Keras layers of keras_sparse."""

from keras_sparse.layers.dense_embedding import AllToAllDenseEmbedding
from keras_sparse.layers.embedding_collection import EmbeddingCollection
from keras_sparse.layers.hash.collection import HashEmbeddingCollection
from keras_sparse.layers.hash.deltas import apply_delta
from keras_sparse.layers.hash.embedding import DistributedHashEmbedding
from keras_sparse.layers.hash.serving_map import refresh_all as refresh_serving_maps
from keras_sparse.layers.inputs import ragged_to_padded
from keras_sparse.layers.table_config import TableConfig

__all__ = [
    "AllToAllDenseEmbedding",
    "DistributedHashEmbedding",
    "EmbeddingCollection",
    "HashEmbeddingCollection",
    "TableConfig",
    "apply_delta",
    "ragged_to_padded",
    "refresh_serving_maps",
]
