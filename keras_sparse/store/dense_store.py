"""Dense stores: a fixed vocabulary of ids ``[0, num_rows)``, each id its
own slot (no index), every id always present."""

from __future__ import annotations

import numpy as np

from .fields import FieldSpec  # noqa: F401  (the docstring example)
from .fields import check_fields
from .fields import check_keys
from .fields import check_rows
from .fields import distinct
from .fields import zero_rows
from .host_rows import HostRows
from .store_base import StoreBase

#: Bytes of rows the initializer makes per call.
INIT_CHUNK_BYTES = 64 << 20


def check_num_rows(num_rows, who: str) -> int:
    if (
        isinstance(num_rows, bool)
        or not isinstance(num_rows, (int, np.integer))
        or num_rows < 1
    ):
        raise ValueError(f"{who}: num_rows must be an int >= 1, got {num_rows!r}")
    return int(num_rows)


def fill_initial(rows, fields, num_rows: int, initializer, who: str):
    """Rows from ``initializer(first, end) -> {field: [end - first, width]}``
    written chunk by chunk, so no full-size temporary ever exists."""
    step = max(1, INIT_CHUNK_BYTES // sum(f.row_bytes for f in fields))
    for first in range(0, num_rows, step):
        end = min(first + step, num_rows)
        values = check_rows(
            fields,
            initializer(first, end),
            end - first,
            f"{who} initializer({first}, {end})",
        )
        rows.fill(first, values)


class DenseStore(StoreBase):
    """Shared by `DenseHostStore` and `DenseDiskStore` (``_rows`` is theirs).

    `erase` sets rows to zeros and `clear` sets every row to zeros: ids
    stay present (`contains` is always True, `size` is ``num_rows``).
    """

    def _setup(self, fields, rows, num_rows: int):
        self._setup_common(fields, rows)
        self.num_rows = num_rows

    @property
    def size(self) -> int:
        return self.num_rows

    @property
    def nbytes(self) -> int:
        return self.num_rows * sum(f.row_bytes for f in self._fields)

    def _ids(self, keys, op: str, unique: bool = False):
        self._check_open()
        who = f"{type(self).__name__}.{op}"
        ids = check_keys(keys, who, unique=unique)
        bad = (ids < 0) | (ids >= self.num_rows)
        if bad.any():
            raise ValueError(
                f"{who}: ids must be in [0, {self.num_rows}) (num_rows), "
                f"got {int(ids[bad][0])}"
            )
        return ids, who

    def read(self, keys):
        return self.read_fields(keys)

    def read_fields(self, keys, names=None):
        """`read`, of the fields ``names`` only (default all)."""
        ids, _ = self._ids(keys, "read")
        self._counts["reads"] += ids.size
        self._counts["hits"] += ids.size
        return np.ones(ids.size, bool), self._rows.gather(ids, names)

    def row_arrays(self):
        """``{field: [>= num_rows, width] array}``, row ``i`` being id
        ``i``'s, in place (host memory or the file's map), for a caller
        that moves rows itself and reports them (`count_moves`); None
        where the rows are not one array per field."""
        self._check_open()
        return self._rows.row_arrays()

    def count_moves(self, reads: int, writes: int):
        """Counts ``reads`` and ``writes`` of rows made in `row_arrays`."""
        self._counts["reads"] += reads
        self._counts["hits"] += reads
        self._counts["writes"] += writes
        if writes:
            self._version += 1

    def contains(self, keys):
        ids, _ = self._ids(keys, "contains")
        return np.ones(ids.size, bool)

    def write(self, keys, rows):
        ids, who = self._ids(keys, "write", unique=True)
        rows = check_rows(self._fields, rows, ids.size, who)
        self._rows.scatter(ids, rows)
        self._counts["writes"] += ids.size
        self._version += 1

    def erase(self, keys) -> int:
        ids, _ = self._ids(keys, "erase")
        ids = distinct(ids)
        self._rows.scatter(ids, zero_rows(self._fields, ids.size))
        self._counts["erases"] += ids.size
        self._version += 1
        return int(ids.size)

    def _chunks(self, step, version):
        for start in range(0, self.num_rows, step):
            self._check_unchanged(version)
            end = min(start + step, self.num_rows)
            ids = np.arange(start, end, dtype=np.int64)
            self._rows.will_read(start, end)
            yield ids, self._rows.gather(ids)

    def clear(self):
        self._check_open()
        self._rows.zero_all()
        self._version += 1


class DenseHostStore(DenseStore):
    """Ids ``[0, num_rows)`` -> one row per field, in host memory.

    ``initializer(first, end)`` returns ``{field: rows of ids [first,
    end)}``; it is called chunk by chunk at creation (zeros without one).

    >>> store = DenseHostStore([FieldSpec("values", 1, "int64")], 4,
    ...                        lambda a, b: {"values": np.arange(a, b)[:, None]})
    >>> store.read([3, 1])[1]["values"].ravel().tolist()
    [3, 1]
    """

    def __init__(self, fields, num_rows: int, initializer=None):
        fields = check_fields(fields, "DenseHostStore")
        num_rows = check_num_rows(num_rows, "DenseHostStore")
        rows = HostRows(fields, num_rows, fixed=True)
        if initializer is not None:
            fill_initial(rows, fields, num_rows, initializer, "DenseHostStore")
        self._setup(fields, rows, num_rows)
