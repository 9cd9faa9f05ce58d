"""`DenseDiskStore`: ids ``[0, num_rows)`` -> rows in memory-mapped files
(no index: an id is its row). Format and crash safety: `disk_format`."""

from __future__ import annotations

from . import disk_format
from .dense_store import DenseStore
from .dense_store import check_num_rows
from .dense_store import fill_initial
from .fields import check_fields
from .mapped_rows import MappedRows
from .on_disk import OnDisk


class DenseDiskStore(OnDisk, DenseStore):
    """Ids ``[0, num_rows)`` -> one row per field in ``<path>/<field>.rows``.

    Creates the store in the folder ``path`` (an existing store there
    raises FileExistsError unless ``overwrite``); ``initializer(first,
    end)`` fills it chunk by chunk (unwritten rows are zeros and take no
    disk space). `DenseDiskStore.open` reopens it in place.
    """

    _kind = "dense"

    def __init__(
        self, path, fields, num_rows: int, initializer=None, overwrite: bool = False
    ):
        fields = check_fields(fields, "DenseDiskStore")
        num_rows = check_num_rows(num_rows, "DenseDiskStore")
        folder = self._create_folder(path, overwrite)
        with self._opening():
            rows = MappedRows(folder, fields, num_rows, create=True)
            self._setup(fields, rows, num_rows)
            if initializer is not None:
                fill_initial(rows, fields, num_rows, initializer, "DenseDiskStore")
            self.flush()

    @classmethod
    def open(cls, path):
        """The store in ``path``, its files mapped in place."""
        self, manifest, fields, _ = cls._open_folder(path)
        with self._opening():
            num_rows = manifest["rows"]
            rows = MappedRows(self._folder, fields, num_rows, create=False)
            self._setup(fields, rows, num_rows)
        return self

    def flush(self):
        self._check_open()
        self._rows.flush()
        disk_format.write_manifest(
            self._folder, self._kind, self._fields, rows=self.num_rows
        )
