"""The check that the copies of a table with ``cache_rows`` held by
several processes are alike (torch.distributed and JAX processes,
`cache_processes`; TensorFlow workers, `cache_workers`).

Each process holds its own id map, store and cache variables and maps
the whole gathered batch with them: the copies stay equal only if they
start equal. Each process fingerprints its copy (`identity`), the
processes exchange the fingerprints, and `refuse_differing` raises the
same error in every one of them when they differ, or when two of them
would write one disk store's folder.
"""

import hashlib
import os
import socket

import numpy as np


def identity(cache, variables):
    """``(folder, digest)`` of this process's copy of ``cache``: its disk
    store's folder (the host's name and the real path, `folder`; None for
    a store in memory) and a digest of its rows (`_digest`);
    ``variables``: the values of the cache variables, NumPy arrays."""
    path = folder(cache)
    key = None if path is None else (socket.gethostname(), path)
    return key, _digest(cache, variables)


def refuse_differing(found, own, where, own_folder, rebuild):
    """Raises ValueError when the processes' ``found`` identities (one
    `identity` each, their folders as any key that tells folders apart)
    share a folder or differ. ``own``: this process's ``(folder key,
    path)``; ``where``: how the error names the setting; ``own_folder``:
    how a process names a folder of its own (``store``); ``rebuild``: how
    to build the copies alike."""
    folders = [key for key, _ in found if key is not None]
    shared = {key for key in folders if folders.count(key) > 1}
    if shared:
        named = f" {own[1]}" if own[0] in shared else ""
        raise ValueError(
            f"{where}: the processes share the disk store's folder{named}; "
            f"each process needs a folder of its own (`store`: e.g. "
            f"{own_folder})."
        )
    if len({digest for _, digest in found}) > 1:
        raise ValueError(
            f"{where} needs the same table in every process, but the "
            "processes' copies differ (the store's rows, the cached ids or "
            f"the cache's rows). {rebuild}, give `embeddings_initializer` a "
            "seed, or load the same weights in every process."
        )


def folder(cache):
    """The real path of the folder ``cache``'s disk store was asked for
    (a store whose folder another process held went to another one,
    `keras_sparse.store.Disk`), or None."""
    store = cache.row_tier.store
    path = getattr(store, "asked_path", getattr(store, "path", None))
    return None if path is None else os.path.realpath(os.fspath(path))


def _digest(cache, variables, samples=64):
    """A hash of the stored rows of ``samples`` ids spread over the table,
    the cached ids and the cache variables."""
    sha = hashlib.sha1()
    ids = np.unique(np.linspace(0, cache.input_dim - 1, samples).astype(np.int64))
    with cache.row_tier.lock:
        arrays = cache.row_tier.store.row_arrays()
        if arrays is not None:
            for name in sorted(arrays):
                sha.update(np.ascontiguousarray(arrays[name][ids]).tobytes())
        sha.update(cache.slot_map.id_of_slot.tobytes())
    for value in variables:
        sha.update(np.ascontiguousarray(value).tobytes())
    return sha.hexdigest()
