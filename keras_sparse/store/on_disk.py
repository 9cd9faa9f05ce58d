"""`OnDisk`: what `DiskStore` and `DenseDiskStore` share: a folder of
memory-mapped row files and a manifest (`disk_format`), flushed by
`clear` and `close`.

An open store holds an exclusive lock on its folder (``.lock``, released
by `close`, or by the OS when the process ends): a second store on the
same files, in any process of the host, would cut or rewrite files the
first one has mapped (a process reading a mapped page past a file's new
end is killed by SIGBUS), so a store never opens a folder that another
one holds (`FolderInUse`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
import weakref

from . import disk_format

try:
    import fcntl
except ImportError:  # no advisory locks (Windows): this process's own check only
    fcntl = None

LOCK = ".lock"


class FolderInUse(ValueError):
    """The folder's store is open in another process (it holds the lock)."""


# Folders of the disk stores open in this process (closed or collected
# stores drop out): a new store never replaces one in use.
_OPEN = weakref.WeakValueDictionary()


def in_use(folder) -> bool:
    """Whether a store of this process has ``folder`` open."""
    key = os.path.realpath(os.fspath(folder))
    if key not in _OPEN:
        return False
    gc.collect()  # a layer dropped in a reference cycle frees its store
    store = _OPEN.get(key)
    return store is not None and not store._closed


def _claim(folder, who):
    """An open lock file holding ``folder``'s exclusive lock; raises
    `FolderInUse` when another store (of any process) holds it."""
    os.makedirs(folder, exist_ok=True)
    handle = open(os.path.join(folder, LOCK), "a+b")  # noqa: SIM115 (held open)
    if fcntl is None:
        return handle
    if not _locked(handle, folder, who):
        gc.collect()  # a store dropped in a reference cycle lets go
        if not _locked(handle, folder, who):
            handle.close()
            raise FolderInUse(
                f"{who}: the store in {folder} is open in another store or "
                "process (two stores on the same files would corrupt them); "
                "give each one a folder of its own"
            )
    return handle


def _locked(handle, folder, who):
    """Takes ``handle``'s exclusive lock: False when another holds it."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # EWOULDBLOCK
        return False
    except OSError as error:
        # A file system without advisory locks (ENOLCK, EOPNOTSUPP): this
        # process's own check (`in_use`) is all there is.
        warnings.warn(
            f"{who}: cannot lock {folder} ({error}); a store another "
            "process opens there too would corrupt this one",
            stacklevel=5,
        )
    return True


def _drop_locks_in_child():
    # A forked child shares its parent's locks (they belong to the open
    # file, which the fork copies): its copies must not keep a folder
    # locked after the parent closes its store.
    for store in list(_OPEN.values()):
        lock = store.__dict__.get("_lock")
        if lock is not None:
            lock.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_locks_in_child)


class OnDisk:
    """Mixin placed before the in-memory base (`KeyedStore`, `DenseStore`);
    ``_kind`` is the manifest's kind, ``_index_files`` what else the folder
    holds besides the manifest and the row files."""

    _kind = None

    def _create_folder(self, path, overwrite: bool) -> str:
        """Claims and prepares ``path`` for a new store; the constructor
        makes the rest under `_opening`."""
        folder = os.fspath(path)
        self._lock = _claim(folder, type(self).__name__)
        self._folder = folder
        try:
            disk_format.prepare_folder(folder, overwrite, type(self).__name__)
        except BaseException:
            self._lock.close()
            raise
        return folder

    @contextlib.contextmanager
    def _opening(self):
        """The rest of a store's opening: on failure its lock goes (a
        half-made store must not hold the folder while its traceback
        lives); on success the store is registered (`in_use`)."""
        try:
            yield
        except BaseException:
            self._lock.close()
            raise
        _OPEN[os.path.realpath(self._folder)] = self

    @classmethod
    def _open_folder(cls, path):
        """A bare store on ``path`` (``_setup`` not yet called), with the
        folder's manifest, fields and row capacity."""
        folder = os.fspath(path)
        who = f"{cls.__name__}.open"
        if not os.path.exists(os.path.join(folder, disk_format.MANIFEST)):
            disk_format.read_manifest(folder, cls._kind, who)  # raises
        # Locked before reading: a holder's last flush is then complete.
        lock = _claim(folder, who)
        try:
            manifest, fields, capacity = disk_format.read_manifest(
                folder, cls._kind, who
            )
        except BaseException:
            lock.close()
            raise
        self = cls.__new__(cls)
        self._lock = lock
        self._folder = folder
        return self, manifest, fields, capacity

    @property
    def path(self) -> str:
        return self._folder

    def _index_files(self) -> list:
        return []

    def clear(self):
        super().clear()
        self.flush()

    def close(self):
        if not self._closed:
            self.flush()
            super().close()
            self._lock.close()
            if _OPEN.get(os.path.realpath(self._folder)) is self:
                del _OPEN[os.path.realpath(self._folder)]

    def stats(self) -> dict:
        out = super().stats()
        names = [disk_format.MANIFEST, *self._index_files()]
        out["file_bytes"] = self._rows.file_bytes() + sum(
            os.path.getsize(os.path.join(self._folder, n)) for n in names
        )
        return out
