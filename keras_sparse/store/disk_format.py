"""The on-disk form of `DiskStore` and `DenseDiskStore`: one folder with

- ``<field>.rows`` per field: its rows, row-major, no header, memory-mapped;
- ``index-<token>.npz`` (keyed stores): the key index (hash table, key of
  each slot, which slots hold a key, the free slots), written by `flush`;
- ``manifest.json``: format, version, kind, fields, rows per file, keys
  held and the name of the index file; written last by `flush`.

Why this format, not LMDB, RocksDB or TensorStore: it needs no new
dependency; a batch of rows is one vectorized NumPy gather or scatter on a
map, by slot (a key-value store pays a call and a copy per key); the OS
page cache keeps the hot pages and writes dirty ones back, with no cache
of our own to size; and the keys stay in memory, as GPU hash tables keep
keys in fast memory and spill values: 16-33 bytes per key (`key_index`),
so a billion rows of 64 floats are 256 GB on disk and 16-33 GB of RAM.

Crash safety: `flush` syncs the row files, then writes the index and then
the manifest each under a temporary name, ``fsync``-ed and renamed over
the old one (`keras_sparse.atomic_files`); the old index file goes last.
A crash at any point leaves the manifest of the last finished flush and
the index it names. Each flush writes the whole index (about 17 bytes per
key: 1.7 GB at 1e8 keys), so flush at checkpoints, not every step.

What a crash between flushes loses: keys written since are not in the
reopened store, keys erased since are back, and the rows of keys held at
the flush may be newer than at the flush (rows are written in place). A
slot freed since the last flush is not reused until the next one, so a
row never holds another key's values. The layers treat a store as a
working set and restore tables from their checkpoints.

A missing manifest raises FileNotFoundError; a manifest or index that
does not match the files raises `StoreFormatError`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets

import numpy as np

from keras_sparse.atomic_files import atomic_path
from keras_sparse.atomic_files import atomic_write

from .fields import FieldSpec
from .mapped_rows import row_file

MANIFEST = "manifest.json"
FORMAT = "keras_sparse.row_store"
VERSION = 1
_INDEX_GLOB = "index-*.npz"


class StoreFormatError(ValueError):
    """A disk store's manifest or index does not match its files."""


def prepare_folder(folder: str, overwrite: bool, who: str):
    """A folder for a new store: made if missing; an existing store there
    is an error, or with ``overwrite`` its files are removed."""
    os.makedirs(folder, exist_ok=True)
    manifest = os.path.join(folder, MANIFEST)
    if not os.path.exists(manifest):
        return
    if not overwrite:
        raise FileExistsError(
            f"{who}: {folder} already holds a row store; reopen it with "
            f"{who}.open(path), or pass overwrite=True to replace it"
        )
    with contextlib.suppress(
        OSError, StoreFormatError, ValueError, KeyError, TypeError
    ):
        for f in read_json(folder, who)["fields"]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(row_file(folder, FieldSpec(**f)))
    os.unlink(manifest)
    remove_indexes(folder, keep=None)


def write_manifest(folder: str, kind: str, fields, **entries):
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "fields": [
            {"name": f.name, "width": f.width, "dtype": f.dtype} for f in fields
        ],
        **entries,
    }
    with atomic_write(os.path.join(folder, MANIFEST), "w") as fh:
        json.dump(manifest, fh, indent=1)


def read_json(folder: str, who: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{who}: no row store at {folder}: its {MANIFEST} is missing "
            "(a store writes it when created and on each flush())"
        )
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreFormatError(f"{who}: {path} is not a readable manifest: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreFormatError(f"{who}: {path} is not a {FORMAT} manifest")
    return manifest


def read_manifest(folder: str, kind: str, who: str):
    """``(manifest, fields, capacity)`` of the store in ``folder``;
    capacity: rows every field's file holds."""
    manifest = read_json(folder, who)
    path = os.path.join(folder, MANIFEST)
    if manifest.get("version") != VERSION:
        raise StoreFormatError(
            f"{who}: {path} has format version {manifest.get('version')!r}; "
            f"this keras_sparse reads version {VERSION}"
        )
    if manifest.get("kind") != kind:
        raise StoreFormatError(
            f"{who}: {folder} holds a {manifest.get('kind')!r} store, not a "
            f"{kind!r} one"
        )
    try:
        fields = tuple(FieldSpec(**f) for f in manifest["fields"])
        rows = int(manifest["rows"])
    except (KeyError, TypeError, ValueError) as e:
        raise StoreFormatError(f"{who}: {path} has bad fields or rows: {e}") from e
    if not fields:
        raise StoreFormatError(f"{who}: {path} lists no fields")
    capacity = None
    for f in fields:
        file = row_file(folder, f)
        if not os.path.exists(file):
            raise StoreFormatError(
                f"{who}: the row file {file} of field {f.name!r} is missing"
            )
        held = os.path.getsize(file) // f.row_bytes
        if held < rows:
            raise StoreFormatError(
                f"{who}: the row file {file} holds {held} rows; the manifest "
                f"says {rows}"
            )
        capacity = held if capacity is None else min(capacity, held)
    return manifest, fields, max(capacity, 1)


def write_index(folder: str, arrays: dict) -> str:
    """Writes the index arrays to a new file; returns its name."""
    name = f"index-{secrets.token_hex(8)}.npz"
    with atomic_path(os.path.join(folder, name), suffix=".npz") as temp:
        np.savez(temp, **arrays)
    return name


def read_index(folder: str, manifest: dict, who: str) -> dict:
    """The saved index named by the manifest, checked against it."""
    name = manifest.get("index")
    path = os.path.join(folder, str(name))
    if not isinstance(name, str) or not os.path.exists(path):
        raise StoreFormatError(
            f"{who}: the index file {name!r} the manifest names is missing"
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("table", "keys", "live", "free")}
    except (OSError, ValueError, KeyError) as e:
        raise StoreFormatError(f"{who}: {path} is not a readable index: {e}") from e
    table, keys, live, free = (arrays[k] for k in ("table", "keys", "live", "free"))
    try:
        ok = _consistent(table, keys, live, free, manifest)
    except (TypeError, ValueError, IndexError):
        ok = False
    if not ok:
        raise StoreFormatError(
            f"{who}: the index {path} does not match the manifest "
            f"({manifest.get('slots')} slots, {manifest.get('size')} keys)"
        )
    return arrays


def _consistent(table, keys, live, free, manifest) -> bool:
    slots, size = int(manifest["slots"]), int(manifest["size"])
    used = table[table >= 0]
    ok = (
        table.ndim == 1
        and table.size >= 16
        and not table.size & (table.size - 1)
        and keys.dtype == np.int64
        and live.dtype == np.bool_
        and free.dtype == np.int64
        and keys.size == live.size == slots
        and int(live.sum()) == size == used.size
        and int(manifest["rows"]) >= slots
        and (used.size == 0 or used.max() < slots)
        and (free.size == 0 or (free.min() >= 0 and free.max() < slots))
    )
    if not ok:
        return False
    marked = np.zeros(keys.size, bool)
    marked[used] = True  # every slot in the table holds a key, and only those
    return (
        bool(np.array_equal(marked, live))
        and not live[free].any()
        and (free.size + size == slots)
    )


def remove_indexes(folder: str, keep):
    for path in glob.glob(os.path.join(glob.escape(folder), _INDEX_GLOB)):
        if os.path.basename(path) != keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
