"""Row stores: the full table one level below a device cache of hot rows.

A store holds, per int64 key, one row per field (`FieldSpec`: the values,
optimizer slots, a score). Every store offers `RowStore`; every operation
works on whole arrays of keys with vectorized NumPy, never a loop per key.

- `HostStore`: any int64 key, rows in host memory.
- `DenseHostStore`: ids ``[0, num_rows)`` (a fixed vocabulary), host memory.
- `DiskStore` / `DenseDiskStore`: the same with rows in memory-mapped files
  on local disk (larger than RAM); `flush` makes them durable and ``open``
  reopens them in place (format and crash safety: `disk_format`); a
  folder holds one open store at a time, across processes (`FolderInUse`).
- `Host()` / `Disk(path)`: what a layer's ``store`` argument takes; `get`
  resolves None, ``"host"``, a spec or its config dict.

Layering: at the level of ``keras_sparse.table`` (NumPy only, no Keras).
"""

from .dense_disk_store import DenseDiskStore
from .dense_store import DenseHostStore
from .disk_format import StoreFormatError
from .disk_store import DiskStore
from .fields import FieldSpec
from .host_store import HostStore
from .on_disk import FolderInUse
from .protocol import RowStore
from .specs import Disk
from .specs import Host
from .specs import get
from .specs import serialize

__all__ = [
    "DenseDiskStore",
    "DenseHostStore",
    "Disk",
    "DiskStore",
    "FieldSpec",
    "FolderInUse",
    "Host",
    "HostStore",
    "RowStore",
    "StoreFormatError",
    "get",
    "serialize",
]
