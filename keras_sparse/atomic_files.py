"""Files written whole or not at all: a crash mid-write leaves the old file.

Every file keras_sparse writes (model saves through
`keras_sparse.layers.atomic_save`, the compiled helpers' cache) goes
through here: it is written under a temporary name in the target's own
folder (so on the same filesystem), flushed to disk (``fsync``), given the
old file's permissions and renamed over the target (``os.replace``, atomic),
then the folder entry is synced. An error removes the temporary file and
leaves the target as it was; a process killed mid-write leaves the target
whole, and at most a hidden ``.<name>.<random>.tmp*`` file beside it.

A symbolic link is written through (the file it names is replaced). Being a
new file, the target loses any hard links and gets the writer as owner.
"""

import contextlib
import os
import secrets
import stat


def temporary_name(target, suffix=""):
    """A new empty file beside ``target`` (created with the mode a plain
    ``open(target, "w")`` would give); returns its path."""
    folder, name = os.path.split(target)
    while True:
        temp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp{suffix}")
        try:
            # 0o666 less the umask, as for any new file; O_EXCL: never
            # another writer's temporary file.
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return temp


def publish(temp, target):
    """Syncs ``temp`` to disk, gives it ``target``'s permissions (when the
    target exists) and renames it over ``target``."""
    fd = os.open(temp, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.chmod(temp, stat.S_IMODE(os.stat(target).st_mode))
    os.replace(temp, target)
    _sync_folder(os.path.dirname(target))


def _sync_folder(folder):
    # The rename is durable once the folder entry is on disk; some
    # platforms (Windows) cannot open a folder, where this is skipped.
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(target, suffix=""):
    """Yields a temporary path to write in place of ``target``; published
    over it when the block ends, removed if the block raises. ``suffix``
    ends the temporary name (writers that check the extension)."""
    target = os.path.realpath(os.fspath(target))
    temp = temporary_name(target, suffix)
    try:
        yield temp
        publish(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def atomic_write(target, mode="wb"):
    """``open(target, mode)`` whose content replaces ``target`` only when
    the block ends without an error (see the module docstring)."""
    with atomic_path(target) as temp:
        with open(temp, mode) as f:
            yield f
