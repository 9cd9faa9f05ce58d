"""A store's rows as a folder of chunk files: how a model save carries them.

``<folder>/<i>.keys.npy`` and ``<folder>/<i>.<field>.npy`` per chunk ``i``
(plain ``.npy``: one chunk is written, or read, at a time, so memory stays
bounded by a chunk whatever the store's size), and ``rows.json`` (format,
fields, rows, chunks), written last: a folder without it is incomplete.
Reading maps each chunk's files (``mmap_mode="r"``).
"""

from __future__ import annotations

import json
import os

import numpy as np

from .disk_format import StoreFormatError
from .fields import FieldSpec

MANIFEST = "rows.json"
FORMAT = "keras_sparse.store_rows"
VERSION = 1


def _file(folder, index, name):
    return os.path.join(folder, f"{index:06d}.{name}.npy")


def write_chunks(folder, fields, chunks, on_rows=None) -> int:
    """Writes ``chunks`` (``(keys, {field: rows})`` pairs) under ``folder``
    (made if missing), one chunk at a time; ``on_rows(rows written so far)``
    after each. Returns the rows written."""
    os.makedirs(folder, exist_ok=True)
    total = count = 0
    for keys, rows in chunks:
        np.save(_file(folder, count, "keys"), np.asarray(keys, np.int64))
        for f in fields:
            np.save(_file(folder, count, f.name), np.asarray(rows[f.name], f.dtype))
        total += len(keys)
        count += 1
        if on_rows is not None:
            on_rows(total)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "fields": [
            {"name": f.name, "width": f.width, "dtype": f.dtype} for f in fields
        ],
        "rows": total,
        "chunks": count,
    }
    with open(os.path.join(folder, MANIFEST), "w") as fh:
        json.dump(manifest, fh, indent=1)
    return total


def read_manifest(folder, who: str) -> dict:
    """The folder's manifest, its fields as `FieldSpec`; raises
    `StoreFormatError` naming ``who`` for a missing or foreign one."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as fh:
            manifest = json.load(fh)
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} version {VERSION} manifest")
        manifest["fields"] = tuple(FieldSpec(**f) for f in manifest["fields"])
        manifest["rows"], manifest["chunks"] = (
            int(manifest["rows"]),
            int(manifest["chunks"]),
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise StoreFormatError(
            f"{who}: {path} is not a readable manifest of saved store rows ({e})"
        ) from e
    return manifest


def read_chunks(folder, fields, who: str):
    """Yields ``(keys, {field: rows})`` of the folder's chunks, each mapped
    from its files; ``fields`` (the reader's) must match the saved ones by
    name and width (dtypes are cast when written to a store)."""
    manifest = read_manifest(folder, who)
    saved = {f.name: f.width for f in manifest["fields"]}
    want = {f.name: f.width for f in fields}
    if saved != want:
        raise StoreFormatError(
            f"{who}: the saved store rows have fields {saved} (name: width); "
            f"this layer's store has {want}"
        )
    for i in range(manifest["chunks"]):
        try:
            keys = np.load(_file(folder, i, "keys"), mmap_mode="r")
            rows = {
                f.name: np.load(_file(folder, i, f.name), mmap_mode="r") for f in fields
            }
        except (OSError, ValueError) as e:
            raise StoreFormatError(
                f"{who}: chunk {i} of the saved store rows in {folder} is "
                f"missing or unreadable ({e})"
            ) from e
        if any(r.shape != (keys.shape[0], want[n]) for n, r in rows.items()):
            raise StoreFormatError(
                f"{who}: chunk {i} of the saved store rows in {folder} has rows "
                "that do not match its keys"
            )
        yield keys, rows
