"""What a hash table call returns or raises, shared by every table twin."""

from typing import NamedTuple


def score_of(new_score, idx):
    """Scores for keys ``idx``: one shared 0-d value or a per-key array."""
    return new_score if new_score.ndim == 0 else new_score[idx]


class InsertResult(NamedTuple):
    """Result of ``lookup_or_insert``.

    rows: row per input key (input's shape), -1 for keys not admitted/placed.
    new_rows: unique rows assigned in this call (re-initialize these embeddings).
    evicted_keys, evicted_rows: keys pushed out in this call and their old rows.
    """

    rows: object
    new_rows: object
    evicted_keys: object
    evicted_rows: object


class TableFullError(RuntimeError):
    """Raised with ``eviction=None`` when a key's candidate buckets are full."""


class BatchTooLargeError(ValueError):
    """A call with more distinct keys to place than the table has rows."""
