"""Where a layer keeps the full table below its device cache: the spec
objects layers take (``store=ks.store.Host()`` or ``ks.store.Disk(path)``)
and `get`, which resolves the forms a layer's argument may take."""

from __future__ import annotations

import dataclasses
import os

from .dense_disk_store import DenseDiskStore
from .dense_store import DenseHostStore
from .disk_store import DiskStore
from .host_store import HostStore
from .host_store import check_capacity


@dataclasses.dataclass(frozen=True)
class Host:
    """Rows in host memory (`HostStore`, `DenseHostStore`)."""

    initial_capacity: int = 1024

    def __post_init__(self):
        check_capacity(self.initial_capacity, "Host")

    def open_keyed(self, fields, name=None):
        """A new empty `HostStore` (``name`` is unused: every store is its own)."""
        return HostStore(fields, self.initial_capacity)

    def open_dense(self, fields, num_rows, initializer=None, name=None):
        return DenseHostStore(fields, num_rows, initializer)

    def get_config(self) -> dict:
        return {"initial_capacity": self.initial_capacity}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@dataclasses.dataclass(frozen=True)
class Disk:
    """Rows in memory-mapped files under the folder ``path`` on local disk
    (`DiskStore`, `DenseDiskStore`).

    Each store opened gets a new store in ``path`` (or in ``path/name``
    when a layer keeps several), replacing a store left there: a layer
    keeps its tables in its checkpoints, the store is its working set.
    """

    path: str
    initial_capacity: int = 1024

    def __post_init__(self):
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError(f"Disk: path must be a folder path, got {self.path!r}")
        object.__setattr__(self, "path", os.fspath(self.path))
        check_capacity(self.initial_capacity, "Disk")

    def _folder(self, name):
        return self.path if name is None else os.path.join(self.path, name)

    def open_keyed(self, fields, name=None):
        return DiskStore(
            self._folder(name), fields, self.initial_capacity, overwrite=True
        )

    def open_dense(self, fields, num_rows, initializer=None, name=None):
        return DenseDiskStore(
            self._folder(name), fields, num_rows, initializer, overwrite=True
        )

    def get_config(self) -> dict:
        return {"path": self.path, "initial_capacity": self.initial_capacity}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


_SPECS = {"Host": Host, "Disk": Disk}
_VALID = (
    'None, "host", ks.store.Host(...), ks.store.Disk(path), or a config dict '
    '{"class_name": "Host" or "Disk", "config": {...}}'
)


def get(spec):
    """The store spec ``spec`` names: None (no store: None), ``"host"``, a
    `Host` or `Disk`, or ``{"class_name": ..., "config": ...}`` (what
    `serialize` gives).

    >>> get("host")
    Host(initial_capacity=1024)
    """
    if spec is None or isinstance(spec, (Host, Disk)):
        return spec
    if isinstance(spec, str):
        if spec.lower() == "host":
            return Host()
        raise ValueError(
            f"store: {spec!r} is not a store; valid: {_VALID} "
            "(a disk store needs its folder: ks.store.Disk(path))"
        )
    if isinstance(spec, dict) and spec.get("class_name") in _SPECS:
        return _SPECS[spec["class_name"]].from_config(dict(spec.get("config") or {}))
    raise ValueError(f"store: {spec!r} is not a store; valid: {_VALID}")


def serialize(spec):
    """The config dict `get` reads back (None for None)."""
    spec = get(spec)
    if spec is None:
        return None
    return {"class_name": type(spec).__name__, "config": spec.get_config()}
