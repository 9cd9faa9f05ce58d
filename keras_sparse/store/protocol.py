"""The interface every row store offers (host memory, memory-mapped disk,
keyed or dense)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol
from typing import runtime_checkable

import numpy as np

from .fields import FieldSpec


@runtime_checkable
class RowStore(Protocol):
    """int64 key -> one row per field (`FieldSpec`).

    Keys are 1-D integer arrays (uint64 keys keep their bits as int64).
    Every operation works on whole arrays of keys at once. A store is not
    thread-safe: one caller at a time (the layer's cache owns it).
    """

    @property
    def fields(self) -> tuple[FieldSpec, ...]: ...

    @property
    def size(self) -> int:
        """Keys held."""

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held, plus the key index."""

    def read(self, keys) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """``(found bool[n], {field: [n, width] rows})``, zeros where not
        found; a key repeated in ``keys`` reads the same row each time."""

    def write(self, keys, rows: dict) -> None:
        """Insert or overwrite the rows of ``keys`` (unique; every field
        given). A ValueError or TypeError leaves the store unchanged."""

    def erase(self, keys) -> int:
        """Remove ``keys``; returns how many of them were held."""

    def contains(self, keys) -> np.ndarray:
        """bool[n]: whether each key is held."""

    def chunks(self, rows_per_chunk: int = 65536) -> Iterator[tuple[np.ndarray, dict]]:
        """``(keys, rows)`` of every key held, at most ``rows_per_chunk`` at
        a time, in ascending storage slot. The store must not change
        while the iterator runs."""

    def clear(self) -> None:
        """Remove every key (dense stores: every row back to zeros)."""

    def flush(self) -> None:
        """Make the store durable on disk (no-op in memory)."""

    def close(self) -> None:
        """Flush and release memory and files; later calls raise."""

    def stats(self) -> dict:
        """size, nbytes; keys read, written, hit, missed and erased since the
        store was made or opened; disk stores: file_bytes."""
