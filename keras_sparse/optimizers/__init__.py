"""Sparse optimizers: they update only the embedding rows a batch touched."""

from keras_sparse.optimizers.adagrad import Adagrad
from keras_sparse.optimizers.adam import Adam
from keras_sparse.optimizers.base import SlotSpec
from keras_sparse.optimizers.base import SparseOptimizer
from keras_sparse.optimizers.ftrl import Ftrl
from keras_sparse.optimizers.resolve import choices
from keras_sparse.optimizers.resolve import deserialize
from keras_sparse.optimizers.resolve import get
from keras_sparse.optimizers.resolve import serialize
from keras_sparse.optimizers.rowwise_adagrad import RowWiseAdagrad
from keras_sparse.optimizers.sgd import SGD

__all__ = [
    "Adagrad",
    "Adam",
    "Ftrl",
    "RowWiseAdagrad",
    "SGD",
    "SlotSpec",
    "SparseOptimizer",
    "choices",
    "deserialize",
    "get",
    "serialize",
]
