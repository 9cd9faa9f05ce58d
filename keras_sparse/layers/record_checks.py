"""Validation of hash-layer records (keys, vectors, slots, scores, rows)
and of the counters a checkpoint restores, before `import_` or a load
changes anything: each error names the layer, the argument and its valid
range."""

from typing import NamedTuple

import numpy as np

from keras_sparse.layers.hash.host_keys import host_array
from keras_sparse.layers.hash.host_keys import host_keys


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
    if a.dtype.name == "bfloat16":  # NumPy's kind "V": widened exactly
        a = a.astype(np.float32)
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
    check_range(layer, arg, a, low, high)
    return a.astype(np.int64)


def checked_int_array(layer, arg, value, shape, meaning, low, high):
    """``value``: an integer array of ``shape`` (None: any length on that
    axis) within ``[low, high)``; returned as it is."""
    a = host_array(value)
    fits = a.ndim == len(shape) and all(
        want is None or got == want for got, want in zip(a.shape, shape)
    )
    if a.dtype.kind not in "iu" or not fits:
        form = (
            f"a {len(shape)}-D integer array"
            if None in shape
            else f"an integer array of shape {tuple(shape)}"
        )
        raise ValueError(
            f"Layer '{layer}': `{arg}` must be {form} {meaning}; received "
            f"dtype {a.dtype}, shape {a.shape}."
        )
    check_range(layer, arg, a, low, high)
    return a


def checked_int(layer, arg, value, low, high, meaning):
    """``value`` (an integer scalar) as an int within ``[low, high)``."""
    return int(checked_int_array(layer, arg, value, (), meaning, low, high))


def checked_step_count(layer, value, variable):
    """A saved ``sparse_iterations`` for ``variable``: it feeds bias
    corrections (Adam), so never negative, and with room for the next
    step's +1 in the variable's dtype."""
    most = int(np.iinfo(np.dtype(variable.dtype)).max)
    return checked_int_array(
        layer, "sparse_iterations", value, tuple(variable.shape), "(a scalar)", 0, most
    )


def check_range(layer, arg, a, low, high=None):
    """ValueError naming ``[low, high)`` unless every value lies in it
    (compared as Python ints: no wrap-around of int64 or uint64)."""
    if not a.size:
        return
    least, most = int(a.min()), int(a.max())
    if least < low or (high is not None and most >= high):
        valid = f">= {low}" if high is None else f"in [{low}, {_number(high)})"
        raise ValueError(
            f"Layer '{layer}': `{arg}` must be {valid}; received values from "
            f"{least} to {most}."
        )


def _number(n):
    """Large powers of two as ``2**k`` (the ranges' bounds)."""
    if n > 2**20 and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    return str(n)
