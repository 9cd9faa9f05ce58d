"""What a row store holds per key: one row per field, and the checks of
the keys and rows handed to it."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import numpy as np

from keras_sparse.table.keys import to_numpy_keys

# Field names become file names of a disk store: plain characters only.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One row of ``width`` values of ``dtype`` per key, named ``name``.

    >>> FieldSpec("values", 16, "float32")
    FieldSpec(name='values', width=16, dtype='float32')
    """

    name: str
    width: int
    dtype: str

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(
                f"FieldSpec: name must be 1-100 characters of letters, digits, "
                f"'_', '.' or '-' (not starting with '.' or '-'), got {self.name!r}"
            )
        if isinstance(self.width, bool) or not isinstance(
            self.width, (int, np.integer)
        ):
            raise TypeError(
                f"FieldSpec {self.name!r}: width must be an int, got {self.width!r}"
            )
        if self.width < 1:
            raise ValueError(
                f"FieldSpec {self.name!r}: width must be >= 1, got {self.width}"
            )
        try:
            dtype = np.dtype(self.dtype)
        except TypeError as e:
            raise TypeError(
                f"FieldSpec {self.name!r}: dtype {self.dtype!r} is not a NumPy dtype"
            ) from e
        if dtype.kind not in "biuf":
            raise TypeError(
                f"FieldSpec {self.name!r}: dtype must be a bool, integer or float "
                f"dtype, got {dtype}"
            )
        object.__setattr__(self, "width", int(self.width))
        object.__setattr__(self, "dtype", dtype.name)

    @property
    def row_bytes(self) -> int:
        return self.width * np.dtype(self.dtype).itemsize


def check_fields(fields, who: str) -> tuple[FieldSpec, ...]:
    """``fields`` as a tuple of FieldSpec (also from (name, width, dtype)
    triples); at least one, names distinct."""
    out = tuple(f if isinstance(f, FieldSpec) else FieldSpec(*f) for f in fields)
    if not out:
        raise ValueError(f"{who}: fields must hold at least one FieldSpec")
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{who}: field names must be distinct, got {names}")
    return out


def check_keys(keys, who: str, unique: bool = False) -> np.ndarray:
    """A 1-D int64 array of ``keys`` (uint64 keys keep their bits)."""
    flat, shape = to_numpy_keys(keys, "keys")
    if len(shape) != 1:
        raise ValueError(f"{who}: keys must be 1-D, got shape {shape}")
    if unique and flat.size > 1:
        s = np.sort(flat)
        dup = s[1:][s[1:] == s[:-1]]
        if dup.size:
            raise ValueError(
                f"{who}: keys must be unique in one write; key {int(dup[0])} "
                "appears more than once"
            )
    return flat


def distinct(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values (a sort: np.unique's hashing is slower on
    1e6 random 64-bit keys)."""
    s = np.sort(values)
    return s[np.r_[True, s[1:] != s[:-1]]] if s.size else s


def check_rows(fields, rows, n: int, who: str) -> dict[str, np.ndarray]:
    """Every field's rows as an ``[n, width]`` array of its dtype.

    Raises (before anything is written) when a field is missing or unknown,
    a shape is not ``[n, width]`` (``[n]`` is taken for width 1), or a dtype
    cannot be cast to the field's without changing kind (float -> int).
    """
    if not isinstance(rows, Mapping):
        raise TypeError(
            f"{who}: rows must be a dict of field name -> array, "
            f"got {type(rows).__name__}"
        )
    names = [f.name for f in fields]
    missing = [m for m in names if m not in rows]
    unknown = [u for u in rows if u not in names]
    if missing or unknown:
        raise ValueError(
            f"{who}: rows must hold exactly the fields {names}; "
            f"missing {missing}, unknown {unknown}"
        )
    out = {}
    for f in fields:
        arr = np.asarray(rows[f.name])
        if f.width == 1 and arr.shape == (n,):
            arr = arr.reshape(n, 1)
        if arr.shape != (n, f.width):
            raise ValueError(
                f"{who}: rows[{f.name!r}] must have shape ({n}, {f.width}) "
                f"(one row per key), got {arr.shape}"
            )
        if not np.can_cast(arr.dtype, f.dtype, "same_kind"):
            raise TypeError(
                f"{who}: rows[{f.name!r}] has dtype {arr.dtype}, which does not "
                f"cast safely to the field's {f.dtype}"
            )
        out[f.name] = arr
    return out


def zero_rows(fields, n: int) -> dict[str, np.ndarray]:
    return {f.name: np.zeros((n, f.width), f.dtype) for f in fields}
