"""keras-sparse: embedding machinery for large recommender models on Keras 3.

Public API:
    AllToAllDenseEmbedding: drop-in for keras.layers.Embedding with combiners
        and sparse optimizers.
    optimizers: SGD, Adagrad, RowWiseAdagrad, Adam (lazy), Ftrl.
    ragged_to_padded: the padded (ids, weights) form of a ragged batch.
"""

from keras_sparse import optimizers
from keras_sparse.layers import AllToAllDenseEmbedding
from keras_sparse.layers import ragged_to_padded

__version__ = "0.1.0"

__all__ = [
    "AllToAllDenseEmbedding",
    "optimizers",
    "ragged_to_padded",
]
