"""Plain stochastic gradient descent on touched rows."""

import keras

from keras_sparse.optimizers.base import SparseOptimizer


@keras.saving.register_keras_serializable(package="keras_sparse")
class SGD(SparseOptimizer):
    """``row -= learning_rate * grad`` on the rows a batch touched.

    Example:

    >>> import keras_sparse as ks
    >>> layer = ks.AllToAllDenseEmbedding(100, 8, optimizer=ks.optimizers.SGD(0.1))
    """

    identifier = "sgd"

    def __init__(self, learning_rate=0.01):
        super().__init__(learning_rate)

    def update_rows(self, rows, slots, grads, lr, iterations):
        return rows - lr * grads, {}
