"""Host-side key helpers shared by the hash layer and its records."""

import numpy as np

from keras_sparse.table import hash_strings
from keras_sparse.table.keys import object_keys
from keras_sparse.table.keys import to_host


def string_kind(x):
    """True for NumPy/list string data and TF string tensors."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if "string" in str(dtype):
        return True
    try:
        return np.dtype(dtype).kind in "USO"
    except TypeError:
        return False


def host_array(x):
    """A NumPy view or copy of host data of any framework."""
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    if hasattr(x, "numpy") and callable(x.numpy):  # tf eager
        return np.asarray(x.numpy())
    return np.asarray(x)


def host_keys(keys):
    """Flat int64 NumPy keys from host data of any framework (strings hashed).

    The one conversion of the hash layer, its `import_` and checkpoint
    records: object arrays are read element by element (`object_keys`), so
    integers stay the integers they are and only strings are hashed.
    """
    keys = host_array(keys)
    if keys.dtype.kind == "O":
        keys = object_keys(keys, "keys", strings=True)
    if keys.dtype.kind in "US":
        return hash_strings(keys).reshape(-1)
    if keys.dtype.kind not in "iu":
        raise TypeError(
            f"keys must be integers or strings; received dtype {keys.dtype}"
        )
    if keys.dtype == np.uint64:
        return keys.reshape(-1).view(np.int64)
    return keys.astype(np.int64).reshape(-1)


def to_numpy(x):
    """NumPy of a table's result (GPU tables return CuPy arrays)."""
    return to_host(x)
