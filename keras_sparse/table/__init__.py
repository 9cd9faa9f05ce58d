"""Device-resident key -> row hash tables for sparse embeddings."""

from .hash_table import HashTable
from .hash_table import InsertResult
from .hash_table import TableFullError
from .keys import hash_strings

__all__ = ["HashTable", "InsertResult", "TableFullError", "hash_strings"]
