"""The runnable examples in public docstrings actually run."""

import doctest
import importlib

import pytest

MODULES = [
    "keras_sparse.gpu_memory",
    "keras_sparse.layers.dense_embedding",
    "keras_sparse.layers.embedding_collection",
    "keras_sparse.layers.hash_embedding",
    "keras_sparse.layers.inputs",
    "keras_sparse.layers.serving_map",
    "keras_sparse.layers.tf_string_hash",
    "keras_sparse.optimizers.adam",
    "keras_sparse.progress",
    "keras_sparse.sharding.exchange_buckets",
    "keras_sparse.table.hash_table",
    "keras_sparse.table.sharded_table",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
