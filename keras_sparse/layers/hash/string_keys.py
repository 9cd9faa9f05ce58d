"""String keys for hash layers in JAX's ``fit`` / ``evaluate`` / ``predict``:
refused up front, naming the layer and what to do instead.

Keras cannot put strings into a JAX step: a ``keras.Input(dtype="string")``
or a NumPy string array fails deep inside Keras's data handling ("Invalid
dtype: str32"), naming neither the layer nor `keras_sparse.hash_strings`.
Hashing on the host first keeps every key's row: the layer hashes strings
with the same function.
"""

import weakref

import numpy as np

from keras_sparse.layers.model_feeds import array_at
from keras_sparse.layers.model_feeds import model_inputs

_HASH_KINDS = ("hash", "hash_collection")
_cache = weakref.WeakKeyDictionary()


def _hash_inputs(model):
    """``[(layer, field, KerasTensor, ModelInput)]``: the model inputs that
    hash layers (or fields of a hash collection) read directly."""
    cached = _cache.get(model)
    if cached is not None:
        return cached
    inputs = model_inputs(model)
    found = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if getattr(layer, "keras_sparse_kind", None) not in _HASH_KINDS:
            continue
        for node in getattr(layer, "_inbound_nodes", []):
            if not node.arguments.args:
                continue
            keys = node.arguments.args[0]
            named = keys.items() if isinstance(keys, dict) else [(None, keys)]
            for field, tensor in named:
                if id(tensor) in inputs:
                    found.append((layer, field, tensor, inputs[id(tensor)]))
    _cache[model] = found
    return found


def _is_string_array(a):
    if not isinstance(a, np.ndarray):
        return False
    if a.dtype.kind in "US":
        return True
    return a.dtype.kind == "O" and a.size > 0 and isinstance(a.flat[0], (str, bytes))


def check(model, x):
    """Raises TypeError when a hash layer of ``model`` would read strings in
    a JAX step: its model input is declared ``dtype="string"``, or ``x``
    (in-memory data, or None) holds a NumPy string array for it."""
    try:
        hash_inputs = _hash_inputs(model)
    except (AttributeError, TypeError, ValueError):
        return  # not a functional model: nothing to walk
    for layer, field, tensor, where in hash_inputs:
        if "string" in str(getattr(tensor, "dtype", "")):
            what = 'declared as keras.Input(dtype="string")'
        else:
            try:
                data = array_at(x, where.find(x))
            except (ValueError, KeyError, IndexError, TypeError):
                continue
            if not _is_string_array(data):
                continue
            what = f"given as a NumPy array of dtype {data.dtype}"
        of = f" (field '{field}')" if field is not None else ""
        raise TypeError(
            f"Layer '{layer.name}'{of}: its keys, {where.describe()}, are "
            f"strings ({what}), which Keras cannot pass into a JAX step. Hash "
            "them on the host first with `keras_sparse.hash_strings(keys)` "
            "(int64 keys; a string and its hash share a row) and declare the "
            'input keras.Input(..., dtype="int64"); or declare it int64 and '
            "feed the raw strings through `keras_sparse.data.prefetch(data, "
            "model)`, which hashes them in its workers."
        )
