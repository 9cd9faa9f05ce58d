"""Where a layer keeps the full table below its device cache: the spec
objects layers take (``store=ks.store.Host()`` or ``ks.store.Disk(path)``)
and `get`, which resolves the forms a layer's argument may take."""

from __future__ import annotations

import dataclasses
import itertools
import os
import warnings

from . import disk_format
from .dense_disk_store import DenseDiskStore
from .dense_store import DenseHostStore
from .disk_store import DiskStore
from .host_store import HostStore
from .host_store import check_capacity
from .on_disk import FolderInUse
from .on_disk import in_use


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
    keeps its tables in its checkpoints, the store is its working set. A
    folder that a store of this process has open is never replaced (e.g.
    ``load_model`` of a file whose layer's store is still in use): the new
    store goes to the first free ``<folder>.1``, ``<folder>.2``, ...,
    with a warning; so does a folder whose store another process holds
    open (its lock, `on_disk`).

    ``reopen=True`` opens the store left in the folder in place instead,
    without copying its files (its fields, and rows for a fixed
    vocabulary, must be the layer's); a folder without a store gets a new
    one. Write a layer's cached rows down first (``layer.flush_store()``):
    a store keeps an older copy of each key the table holds, so without it
    the reopened store serves those keys' older rows.
    """

    path: str
    initial_capacity: int = 1024
    reopen: bool = False

    def __post_init__(self):
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError(f"Disk: path must be a folder path, got {self.path!r}")
        object.__setattr__(self, "path", os.fspath(self.path))
        check_capacity(self.initial_capacity, "Disk")
        if not isinstance(self.reopen, bool):
            raise ValueError(f"Disk: reopen must be True or False, got {self.reopen!r}")

    def _open(self, name, create, reopen):
        """The store ``create(folder)`` (or ``reopen(folder)`` with
        ``reopen=True`` where a store was left) makes in the first folder
        no store holds, in this process or another: ``path`` (or
        ``path/name``), else ``<folder>.1``, ``<folder>.2``, ... with a
        warning. Its ``asked_path`` is the folder asked for."""
        folder = self.path if name is None else os.path.join(self.path, name)
        for n in itertools.count():
            candidate = folder if n == 0 else f"{folder}.{n}"
            store = self._free(candidate, create, reopen)
            if store is not None:
                break
            if self.reopen:
                raise ValueError(
                    f"Disk(reopen=True): the store in {folder} is open "
                    "already, in this process or another (two stores on the "
                    "same files would corrupt them); close the other one "
                    "first (layers: drop them)"
                )
        if n:
            warnings.warn(
                f"Disk: the store in {folder} is open, in this process or "
                f"another; the new store goes to {candidate} instead (give "
                "each layer and process its own folder)",
                stacklevel=4,
            )
        store.asked_path = folder
        return store

    def _free(self, folder, create, reopen):
        """The store opened in ``folder``, or None where a store (of this
        process or another) holds it."""
        if in_use(folder):
            return None
        try:
            return (reopen if self._existing(folder) else create)(folder)
        except FolderInUse:
            return None

    def _existing(self, folder):
        return self.reopen and os.path.exists(
            os.path.join(folder, disk_format.MANIFEST)
        )

    def open_keyed(self, fields, name=None):
        return self._open(
            name,
            lambda f: DiskStore(f, fields, self.initial_capacity, overwrite=True),
            lambda f: _matching(DiskStore.open(f), fields, None),
        )

    def open_dense(self, fields, num_rows, initializer=None, name=None):
        return self._open(
            name,
            lambda f: DenseDiskStore(f, fields, num_rows, initializer, overwrite=True),
            lambda f: _matching(DenseDiskStore.open(f), fields, num_rows),
        )

    def get_config(self) -> dict:
        config = {"path": self.path, "initial_capacity": self.initial_capacity}
        if self.reopen:
            config["reopen"] = True
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def _matching(store, fields, num_rows):
    """``store`` (just reopened) when its fields and rows are those asked
    for; else closes it and raises `StoreFormatError`."""
    want = tuple(fields)
    rows = getattr(store, "num_rows", None)
    if tuple(store.fields) != want or (num_rows is not None and rows != num_rows):
        found = (store.fields, rows)
        store.close()
        raise disk_format.StoreFormatError(
            f"Disk(reopen=True): the store in {store.path} holds fields "
            f"{list(found[0])}"
            + (f" and {found[1]} rows" if num_rows else "")
            + f"; the layer needs {list(want)}"
            + (f" and {num_rows} rows" if num_rows else "")
            + " (reopen=False replaces it)"
        )
    return store


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
