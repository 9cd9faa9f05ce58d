"""The runnable examples in public docstrings actually run."""

import doctest
import importlib

import pytest

MODULES = [
    "keras_sparse.gpu_memory",
    "keras_sparse.layers.dense_embedding",
    "keras_sparse.layers.embedding_collection",
    "keras_sparse.layers.hash.embedding",
    "keras_sparse.layers.inputs",
    "keras_sparse.layers.table_config",
    "keras_sparse.layers.hash.serving_map",
    "keras_sparse.layers.hash.tf_string_hash",
    "keras_sparse.data.remote_cache",
    "keras_sparse.optimizers.adam",
    "keras_sparse.progress",
    "keras_sparse.sharding.exchange_buckets",
    "keras_sparse.sharding.plan_cost",
    "keras_sparse.table.hash_table",
    "keras_sparse.table.sharded_table",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


@pytest.mark.backend_independent
def test_package_docstring_lists_every_public_name():
    """``help(keras_sparse)`` shows each name of ``__all__`` as an entry of
    its "Public API" list (an entry: ``    name, other: what it is``)."""
    import re

    import keras_sparse

    listed = set()
    for head in re.findall(r"^    (\S[^:\n]*):", keras_sparse.__doc__, re.MULTILINE):
        listed.update(re.split(r"[ ,/]+", head))
    missing = sorted(set(keras_sparse.__all__) - listed)
    assert not missing, f"not in keras_sparse.__doc__'s API list: {missing}"
    assert len(keras_sparse.__all__) == len(set(keras_sparse.__all__))
