"""`DiskStore`: rows keyed by any int64, in memory-mapped files on local
disk (larger than RAM), keys in memory. The format, why it was chosen and
what a crash between flushes loses: `disk_format`."""

from __future__ import annotations

import numpy as np

from . import disk_format
from .fields import FieldSpec  # noqa: F401  (the docstring example)
from .fields import check_fields
from .host_store import check_capacity
from .key_index import REMOVED
from .key_index import KeyIndex
from .keyed_store import KeyedStore
from .mapped_rows import MappedRows
from .on_disk import OnDisk
from .slot_stack import SlotStack


class DiskStore(OnDisk, KeyedStore):
    """int64 key -> one row per field, rows in ``<path>/<field>.rows``.

    Creates a new store in the folder ``path`` (made if missing; a store
    already there raises FileExistsError unless ``overwrite``). Reopen a
    flushed store in place with `DiskStore.open`. `flush` makes it
    durable; `close` flushes. Keys and the index stay in memory (16-33
    bytes per key); rows are read and written through the page cache.

    >>> import tempfile
    >>> folder = tempfile.TemporaryDirectory()
    >>> with DiskStore(folder.name, [FieldSpec("values", 2, "float32")]) as store:
    ...     store.write([7], {"values": [[1, 2]]})
    >>> with DiskStore.open(folder.name) as store:
    ...     store.read([7])[1]["values"].tolist()
    [[1.0, 2.0]]
    >>> folder.cleanup()
    """

    _hold_freed = True
    _kind = "keyed"

    def __init__(
        self, path, fields, initial_capacity: int = 1024, overwrite: bool = False
    ):
        fields = check_fields(fields, "DiskStore")
        capacity = check_capacity(initial_capacity, "DiskStore")
        folder = self._create_folder(path, overwrite)
        with self._opening():
            self._initial_capacity = capacity
            self._index_name = None
            self._setup(
                fields,
                MappedRows(folder, fields, capacity, create=True),
                KeyIndex(capacity),
                np.zeros(capacity, bool),
                np.zeros(0, np.int64),
                0,
            )
            self.flush()

    @classmethod
    def open(cls, path):
        """The store flushed last in ``path``, its files mapped in place."""
        self, manifest, fields, capacity = cls._open_folder(path)
        with self._opening():
            folder = self._folder
            arrays = disk_format.read_index(folder, manifest, f"{cls.__name__}.open")
            table = arrays["table"]
            index = KeyIndex.from_arrays(
                table,
                arrays["keys"],
                manifest["size"],
                np.count_nonzero(table == REMOVED),
            )
            self._initial_capacity = int(manifest.get("initial_capacity", 1024))
            self._index_name = manifest["index"]
            self._setup(
                fields,
                MappedRows(folder, fields, capacity, create=False),
                index,
                arrays["live"],
                arrays["free"],
                manifest["slots"],
            )
        return self

    def flush(self):
        """Rows, then the index, then the manifest, each durable on disk."""
        self._check_open()
        self._rows.flush()
        free = np.concatenate([self._free.values(), self._held.values()])
        n = self._slots
        name = disk_format.write_index(
            self._folder,
            {
                "table": self._index.table,
                "keys": self._index.keys[:n],
                "live": self._live[:n],
                "free": free,
            },
        )
        disk_format.write_manifest(
            self._folder,
            self._kind,
            self._fields,
            rows=self._rows.capacity,
            slots=n,
            size=self.size,
            index=name,
            initial_capacity=self._initial_capacity,
        )
        self._index_name = name
        disk_format.remove_indexes(self._folder, keep=name)
        # The index on disk no longer names these: they may take new keys.
        self._free.push(self._held.values())
        self._held = SlotStack()

    def _index_files(self) -> list:
        return [self._index_name] if self._index_name else []
