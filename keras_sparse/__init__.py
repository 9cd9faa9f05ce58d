"""keras-sparse: embedding machinery for large recommender models on Keras 3.

Public API:
    AllToAllDenseEmbedding: drop-in for keras.layers.Embedding with combiners
        and sparse optimizers.
    optimizers: SGD, Adagrad, RowWiseAdagrad, Adam (lazy), Ftrl.
    ragged_to_padded: the padded (ids, weights) form of a ragged batch.
    refresh_serving_maps: bring hash layers' serving maps (what compiled
        inference and ``model.export`` read) up to date by hand.
    EmbeddingCollection, TableConfig: several tables in one layer (stacked
        per width; what makes table-wise sharding possible).
    DistributedHashEmbedding: dynamic-vocabulary embedding keyed by any int64
        (or string).
    HashEmbeddingCollection: several DistributedHashEmbedding fields whose
        tables are called together (one table call per training step).
    apply_delta: apply delta exports (``export(since_step=s)`` of a hash
        layer, an AllToAllDenseEmbedding or an EmbeddingCollection with
        ``track_changes=True``) in order to older records.
    callbacks: ``callbacks.DeltaExport``, delta checkpoints written during
        ``fit``.
    HashTable: int64 key -> row map with eviction and admission (GPU or CPU);
        table.ShardedHashTable / table.owner_of: one shard per device.
    InsertResult: what ``HashTable.lookup_or_insert`` returns (rows, new
        rows, evicted keys).
    TableFullError: raised by a full table with ``eviction=None``.
    hash_strings: the stable 64-bit hash (FNV-1a) that turns string keys
        into int64 keys, as the hash layers do.
    plan, distribution, sharding: model parallelism (JAX): a planner that picks
        table/row/column/replicated placement per table (and key-owned
        shards for hash layers), and the Keras distribution that lays the
        tables out.
    propose_cache_rows: the largest device cache (``cache_rows``, a hash
        layer's ``capacity``) of a table with a row store that fits a
        memory budget, as `plan` counts it.
    share_gpu_memory: split each GPU between the backend and CuPy hash tables.
    data: the async prefetching input stage (`data.prefetch`) and synthetic
        Criteo-like data for examples and benchmarks.
    tune_cpu_allocator: keep freed memory for reuse (glibc), so JAX steps
        on a CPU stop page-faulting their temporary buffer in; and put the
        tables built afterwards on 2 MiB pages (every backend).
    compiled_cpu_helpers: whether the CPU update of the current backend runs
        its compiled code (built on first use) or the backend's own
        operations, and why.
    store: row stores, the full table below a device cache of hot rows
        (`store.HostStore`, `store.DiskStore`: memory-mapped files on
        local disk; `store.Host()` / `store.Disk(path)` name one).
    set_progress: whether long exports, imports, saves and loads of big hash
        tables show a progress bar (by default: in interactive sessions).

Layering: ``table <- ops <- layers <- sharding <- data``; a module never
imports one of a higher layer, and no two modules import each other
(tests/test_layering.py: the import-linter contract in pyproject.toml and a
cycle check on grimp's import graph). The layers reach the sharding hooks
through ``layers.placement``, which ``sharding`` fills in when imported.
"""

# First: a Keras backend whose framework is missing fails here in one line.
from keras_sparse import _keras_import  # noqa: F401
from keras_sparse import callbacks
from keras_sparse import data
from keras_sparse import optimizers
from keras_sparse import sharding
from keras_sparse import store
from keras_sparse.cpu_allocator import tune_cpu_allocator
from keras_sparse.gpu_memory import share_gpu_memory
from keras_sparse.layers import AllToAllDenseEmbedding
from keras_sparse.layers import DistributedHashEmbedding
from keras_sparse.layers import EmbeddingCollection
from keras_sparse.layers import HashEmbeddingCollection
from keras_sparse.layers import TableConfig
from keras_sparse.layers import apply_delta
from keras_sparse.layers import ragged_to_padded
from keras_sparse.layers import refresh_serving_maps
from keras_sparse.ops.native_rows import compiled_cpu_helpers
from keras_sparse.progress import set_progress
from keras_sparse.sharding import distribution
from keras_sparse.sharding import plan
from keras_sparse.sharding import propose_cache_rows
from keras_sparse.table import HashTable
from keras_sparse.table import InsertResult
from keras_sparse.table import TableFullError
from keras_sparse.table import hash_strings

__version__ = "0.1.0"

__all__ = [
    "AllToAllDenseEmbedding",
    "DistributedHashEmbedding",
    "EmbeddingCollection",
    "HashEmbeddingCollection",
    "HashTable",
    "InsertResult",
    "TableFullError",
    "apply_delta",
    "callbacks",
    "compiled_cpu_helpers",
    "data",
    "distribution",
    "hash_strings",
    "optimizers",
    "plan",
    "propose_cache_rows",
    "ragged_to_padded",
    "refresh_serving_maps",
    "set_progress",
    "share_gpu_memory",
    "sharding",
    "store",
    "TableConfig",
    "tune_cpu_allocator",
]
