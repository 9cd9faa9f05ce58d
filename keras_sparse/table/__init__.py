"""Device-resident key -> row hash tables for sparse embeddings."""

from .hash_table import BatchTooLargeError
from .hash_table import HashTable
from .hash_table import InsertResult
from .hash_table import TableFullError
from .keys import hash_strings
from .sharded_table import ShardedHashTable
from .sharded_table import owner_of
from .step_calls import step_rows_together

__all__ = [
    "BatchTooLargeError",
    "HashTable",
    "InsertResult",
    "ShardedHashTable",
    "TableFullError",
    "hash_strings",
    "owner_of",
    "step_rows_together",
]
