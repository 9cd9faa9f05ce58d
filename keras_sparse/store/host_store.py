"""`HostStore`: rows keyed by any int64, in host memory."""

from __future__ import annotations

import numpy as np

from .fields import FieldSpec  # noqa: F401  (the docstring example)
from .fields import check_fields
from .host_rows import HostRows
from .key_index import KeyIndex
from .keyed_store import KeyedStore


def check_capacity(value, who: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{who}: initial_capacity must be an int >= 1, got {value!r}")
    return int(value)


class HostStore(KeyedStore):
    """int64 key -> one row per field, in host memory (see `RowStore`).

    Keys are any int64 (negative ones and 2**63-1 included). Rows live in
    blocks of 64 MiB per field (`host_rows`), found through a vectorized
    hash index of 16-33 bytes per key (`key_index`); freed slots are
    reused. ``initial_capacity``: keys held before the first growth.

    >>> store = HostStore([FieldSpec("values", 2, "float32")])
    >>> store.write([7, -1], {"values": [[1, 2], [3, 4]]})
    >>> found, rows = store.read([-1, 5])
    >>> found.tolist(), rows["values"].tolist()
    ([True, False], [[3.0, 4.0], [0.0, 0.0]])
    """

    def __init__(self, fields, initial_capacity: int = 1024):
        fields = check_fields(fields, "HostStore")
        capacity = check_capacity(initial_capacity, "HostStore")
        self._initial_capacity = capacity
        self._setup(
            fields,
            HostRows(fields, capacity),
            KeyIndex(capacity),
            np.zeros(capacity, bool),
            np.zeros(0, np.int64),
            0,
        )
