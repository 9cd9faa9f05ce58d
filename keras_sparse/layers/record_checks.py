"""Validation of hash-layer records (keys, vectors, slots, scores, rows)
before `import_` or a checkpoint load changes anything: each error names the
layer and the argument."""

from typing import NamedTuple

import numpy as np

from keras_sparse.layers.host_keys import host_array
from keras_sparse.layers.host_keys import host_keys


class Records(NamedTuple):
    """Validated host arrays of `import_` or a checkpoint, one entry per key."""

    keys: np.ndarray  # int64 [n]
    values: np.ndarray  # [n, output_dim]
    slots: dict  # slot name -> [n, width]; slots left out start fresh
    scores: object  # int64 [n], or None (a fresh key's score)
    rows: object  # int64 [n], or None (placed by the table)


def subset(records, mask):
    """``records`` restricted to the keys where ``mask`` is True."""

    def pick(a):
        return None if a is None else a[mask]

    return Records(
        records.keys[mask],
        records.values[mask],
        {name: value[mask] for name, value in records.slots.items()},
        pick(records.scores),
        pick(records.rows),
    )


def checked_keys(layer, arg, keys):
    """Flat int64 keys, distinct; TypeError/ValueError naming the layer."""
    try:
        keys = host_keys(keys)
    except TypeError as e:
        raise TypeError(f"Layer '{layer}': `{arg}`: {e}.") from None
    check_distinct(layer, arg, keys)
    return keys


def check_distinct(layer, arg, values):
    unique, counts = np.unique(values, return_counts=True)
    if len(unique) != len(values):
        repeated = unique[counts > 1]
        raise ValueError(
            f"Layer '{layer}': `{arg}` must be distinct; {len(repeated)} "
            f"values occur more than once (e.g. {repeated[:3].tolist()})."
        )


def checked_numbers(layer, arg, value, shape, meaning, finite):
    """``value`` as a real NumPy array of exactly ``shape``; with ``finite``
    NaN and inf are refused (they would poison the rows they reach)."""
    a = host_array(value)
    if a.dtype.kind not in "fiu" or a.shape != tuple(shape):
        raise ValueError(
            f"Layer '{layer}': `{arg}` must be a real array of shape "
            f"{tuple(shape)} {meaning}; received dtype {a.dtype}, shape "
            f"{a.shape}."
        )
    if finite and a.dtype.kind == "f" and not np.isfinite(a).all():
        raise ValueError(
            f"Layer '{layer}': `{arg}` has {int((~np.isfinite(a)).sum())} "
            "non-finite entries (NaN or inf); import_ stores finite numbers "
            "only."
        )
    return a


def checked_ints(layer, arg, value, n, low, high=None):
    """``value`` as int64 ``[n]`` within ``[low, high)``."""
    a = host_array(value)
    if a.dtype.kind not in "iu" or a.shape != (n,):
        raise ValueError(
            f"Layer '{layer}': `{arg}` must be an integer array of shape "
            f"({n},), one per key; received dtype {a.dtype}, shape {a.shape}."
        )
    a = a.astype(np.int64)
    if n and (a.min() < low or (high is not None and a.max() >= high)):
        valid = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(
            f"Layer '{layer}': `{arg}` must be {valid}; received values from "
            f"{a.min()} to {a.max()}."
        )
    return a
