"""`StoreBase`: what every row store shares (fields, counters, the closed
flag, context manager, `chunks`' argument); subclasses hold the rows
(``_rows``) and say which ids are present."""

from __future__ import annotations

COUNTERS = ("reads", "writes", "hits", "misses", "erases")


class StoreBase:
    """Base of `KeyedStore` and `DenseStore`: ``size``, ``nbytes`` and
    ``_chunks(step, version)`` are theirs."""

    def _setup_common(self, fields, rows):
        self._fields = fields
        self._rows = rows
        self._closed = False
        self._version = 0  # bumped by every change: stale `chunks` raise
        self._counts = dict.fromkeys(COUNTERS, 0)

    @property
    def fields(self):
        return self._fields

    def stats(self) -> dict:
        return {"size": self.size, "nbytes": self.nbytes, **self._counts}

    def __len__(self):
        return self.size

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._closed:
            raise ValueError(f"{type(self).__name__} is closed")

    def chunks(self, rows_per_chunk: int = 65536):
        self._check_open()
        if int(rows_per_chunk) < 1:
            raise ValueError(
                f"{type(self).__name__}.chunks: rows_per_chunk must be >= 1, "
                f"got {rows_per_chunk}"
            )
        return self._chunks(int(rows_per_chunk), self._version)

    def _check_unchanged(self, version):
        """Between two chunks: the store was neither changed nor closed."""
        if self._version != version or self._closed:
            raise RuntimeError(
                f"{type(self).__name__} changed while its chunks were read"
            )

    def flush(self):
        self._check_open()

    def close(self):
        if not self._closed:
            self._rows.close()
            self._closed = True
