"""`DenseDiskStore`: ids ``[0, num_rows)`` -> rows in memory-mapped files
(no index: an id is its row). Format and crash safety: `disk_format`."""

from __future__ import annotations

import os

from . import disk_format
from .dense_store import DenseStore
from .dense_store import check_num_rows
from .dense_store import fill_initial
from .fields import check_fields
from .mapped_rows import MappedRows


class DenseDiskStore(DenseStore):
    """Ids ``[0, num_rows)`` -> one row per field in ``<path>/<field>.rows``.

    Creates the store in the folder ``path`` (an existing store there
    raises FileExistsError unless ``overwrite``); ``initializer(first,
    end)`` fills it chunk by chunk (unwritten rows are zeros and take no
    disk space). `DenseDiskStore.open` reopens it in place.
    """

    def __init__(
        self, path, fields, num_rows: int, initializer=None, overwrite: bool = False
    ):
        fields = check_fields(fields, "DenseDiskStore")
        num_rows = check_num_rows(num_rows, "DenseDiskStore")
        folder = os.fspath(path)
        disk_format.prepare_folder(folder, overwrite, "DenseDiskStore")
        self._folder = folder
        rows = MappedRows(folder, fields, num_rows, create=True)
        self._setup(fields, rows, num_rows)
        if initializer is not None:
            fill_initial(rows, fields, num_rows, initializer, "DenseDiskStore")
        self.flush()

    @classmethod
    def open(cls, path):
        """The store in ``path``, its files mapped in place."""
        folder = os.fspath(path)
        who = "DenseDiskStore.open"
        manifest, fields, _ = disk_format.read_manifest(folder, "dense", who)
        num_rows = manifest["rows"]
        self = cls.__new__(cls)
        self._folder = folder
        self._setup(
            fields, MappedRows(folder, fields, num_rows, create=False), num_rows
        )
        return self

    @property
    def path(self) -> str:
        return self._folder

    def flush(self):
        self._check_open()
        self._rows.flush()
        disk_format.write_manifest(
            self._folder, "dense", self._fields, rows=self.num_rows
        )

    def clear(self):
        super().clear()
        self.flush()

    def close(self):
        if not self._closed:
            self.flush()
            self._rows.close()
            self._closed = True

    def stats(self) -> dict:
        out = super().stats()
        out["file_bytes"] = self._rows.file_bytes() + os.path.getsize(
            os.path.join(self._folder, disk_format.MANIFEST)
        )
        return out
