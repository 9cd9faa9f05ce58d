"""The planner's cost model: per table and strategy, the bytes each device
holds, the bytes it sends per training step, and what rules a strategy out.

Pure Python (no backend calls). For every table it estimates, per strategy:

* bytes held per device, table plus sparse-optimizer slots (from the layer's
  ``sparse_optimizer.slot_specs()``);
* bytes each device sends per training step (ids out, vectors back, row
  gradients back to the owners);
* lookup load: table-wise placement puts all of a table's lookups on one
  device, so whole tables are bin-packed (greedy, largest first) onto the
  devices by memory and lookups (`keras_sparse.sharding.planner.plan`).

Strategies:

``data``   replicated table; backward combines row gradients across replicas
           (the cheaper of an all-gather of (ids, grads) and an all-reduce of
           the dense table gradient).
``table``  whole table on one device; lookups routed there. Runnable for
           the tables of an `EmbeddingCollection` (stacked per device, see
           ``stacks``); a standalone layer is never planned
           table-wise (its reason line says so).
``row``    rows split evenly over the devices; with ``rows % devices != 0``
           the variables are padded to the next multiple (sparse-optimizer
           tables only: a dense-gradient table's Keras optimizer state would
           be padded too and its checkpoints would not reshard).
``column`` columns split evenly (needs ``dim % devices == 0`` and an
           element-wise optimizer: row-wise slots need whole rows).
``key``    `DistributedHashEmbedding` only: every device owns the keys that
           hash to it, with its own hash table shard and its block of rows
           (`keras_sparse.sharding.jax_key_mapping`); the batch's distinct
           keys travel to their owners (two int32 words and a count each)
           and rows come back, then the lookup runs as row sharding. The
           other strategies map a hash layer's keys in one host table per
           process, which first gathers the global batch's keys (8 bytes
           each) to one device, and cannot serve several processes.
"""

import math

from keras_sparse.sharding import plan_store
from keras_sparse.sharding.plan_spec import TableSpec

STRATEGIES = ("data", "table", "row", "column", "key")
TIE_ORDER = {s: i for i, s in enumerate(STRATEGIES)}
_ID_BYTES = 4
#: Collective exchanges per training step (forward + backward).
ROUNDS = {"data": 1, "table": 3, "row": 3, "column": 3, "key": 6}
_KEY_BYTES = 8
#: Key exchange of key sharding: two words and a count out, a row back.
_ROUTED_KEY_BYTES = 16


def comm_bytes(spec, strategy, num_devices, lookups):
    """Estimated bytes one device sends per training step (fwd + bwd).

    ``lookups`` is the number of ids of this table in the global batch.
    """
    d, b, dim = num_devices, spec.dtype_bytes, spec.dim
    if d == 1:
        return 0
    n = lookups / d  # ids per device
    remote = (d - 1) / d
    if strategy == "data":
        gather = (d - 1) * n * (_ID_BYTES + dim * b)  # all-gather (ids, grads)
        reduce = 2 * remote * spec.device_rows * dim * b  # ring all-reduce dense grad
        return math.ceil(min(gather, reduce) + _gathered_keys(spec, d, n))
    if strategy in ("row", "key"):
        # ids out, vectors back, grads back (remote fraction of each).
        rows = remote * n * (_ID_BYTES + 2 * dim * b)
        if strategy == "key":  # keys to their owners, rows back
            return math.ceil(rows + remote * n * _ROUTED_KEY_BYTES)
        return math.ceil(rows + _gathered_keys(spec, d, n))
    if strategy == "table":
        # Averaged over devices; the owner does the vector traffic.
        return math.ceil(remote * n * (_ID_BYTES + 2 * dim * b))
    if strategy == "column":
        # all-gather of ids, then column slices back and grads out.
        cols = (d - 1) * n * _ID_BYTES + remote * n * 2 * dim * b
        return math.ceil(cols + _gathered_keys(spec, d, n))
    raise ValueError(f"unknown strategy {strategy!r}")


def _gathered_keys(spec, d, n):
    """A hash layer mapped in one host table: the batch's keys gathered to
    one device and its rows sent back (averaged over the devices)."""
    if not spec.hash_keys:
        return 0
    return (d - 1) * n * (_KEY_BYTES + _ID_BYTES)


def bytes_per_device(spec, strategy, num_devices):
    return _table_bytes_per_device(spec, strategy, num_devices) + (
        spec.serving_map_bytes
    )


def cache_device_bytes(spec, cache_rows, strategy="data", num_devices=1):
    """Bytes per device of ``spec`` with a cache of ``cache_rows`` rows."""
    return bytes_per_device(spec.with_cache(cache_rows), strategy, num_devices)


def propose_cache_rows(layer_or_spec, device_bytes_budget, devices=1, strategy="data"):
    """The largest cache (``cache_rows`` of an `AllToAllDenseEmbedding`,
    ``capacity`` of a `DistributedHashEmbedding`) of a table with a row
    store whose bytes per device fit ``device_bytes_budget``.

    The bytes counted are `plan`'s: the cache's rows (a hash layer's
    rounded up to whole buckets as its hash table does,
    `plan_store.cache_capacity`), of values and optimizer slots (split over
    ``devices`` for ``strategy="row"``), plus a hash layer's serving map
    (on every device). At most the table's rows (a
    hash layer: the keys of a `TableSpec`, else its capacity); 0 when not
    even the smallest cache fits.

    >>> spec = TableSpec("t", 10**8, 64, store="host", device_rows=1024)
    >>> rows = propose_cache_rows(spec, 2**30)
    >>> cache_device_bytes(spec, rows) <= 2**30 < cache_device_bytes(spec, rows + 1)
    True
    """
    spec = layer_or_spec
    if not isinstance(spec, TableSpec):
        spec = TableSpec.from_layer(layer_or_spec)
    return plan_store.largest_cache(
        spec,
        device_bytes_budget,
        lambda rows: cache_device_bytes(spec, rows, strategy, devices),
    )


def cache_bytes_for(devices):
    return lambda spec, rows, strategy: cache_device_bytes(
        spec, rows, strategy, devices
    )


def _table_bytes_per_device(spec, strategy, num_devices):
    if strategy in ("data", "table"):
        return spec.total_bytes
    if strategy in ("row", "key"):  # padded to an equal block per device
        return math.ceil(spec.device_rows / num_devices) * spec.bytes_per_row
    return math.ceil(spec.total_bytes / num_devices)


def _sixteen_bit(spec):
    """Whether a collection's table ``spec`` stores 16-bit values or slots."""
    config = getattr(spec.layer, "tables", {}).get(spec.collection_table)
    storage = getattr(config or spec.layer, "storage", None) or getattr(
        spec.layer, "table_storage", None
    )
    return storage is not None and storage.is_sixteen_bit()


def structural_problem(spec, strategy, d, processes=1):
    if strategy == "key" and not spec.hash_keys:
        return "key sharding is for DistributedHashEmbedding tables"
    if spec.hash_keys and strategy != "key" and processes > 1:
        return (
            f"one host key map per process cannot serve {processes} processes "
            "(key sharding gives each device its own)"
        )
    if strategy != "data" and not spec.shardable:
        return f"{type(spec.layer).__name__} tables can only be replicated"
    if spec.one_device and d > 1 and strategy != "data":
        return (
            "a cache (`cache_rows`) runs on several devices replicated only: "
            "a Keras distribution (JAX; a copy per process across processes), "
            "a MirroredStrategy of one process, or a copy per process under "
            "a MultiWorkerMirroredStrategy or torch DDP"
        )
    # Key sharding keeps a store per table shard (JAX: see row_tier_shards).
    if spec.store is not None and strategy not in ("data", "row", "key"):
        return "a table with a row store runs replicated, row- or key-sharded only"
    in_collection = spec.collection_table is not None
    if strategy == "table" and spec.layer is not None and not in_collection:
        return "a whole table per device needs the table in an EmbeddingCollection"
    if strategy in ("table", "column") and _sixteen_bit(spec):
        return (
            f"a 16-bit table (`table_dtype`/`slot_dtype`) is not sharded "
            f"{strategy}-wise: its values round by their row and column "
            'numbers in the table ("data" and "row" keep them)'
        )
    if in_collection and strategy != "data" and not spec.sparse_update:
        # Sharded stacks are padded and re-stacked on load; a Keras
        # optimizer's state of the stacked shape would not follow.
        return "sharded EmbeddingCollection tables need a sparse optimizer"
    if strategy == "row" and spec.device_rows % d and not spec.sparse_update:
        return (
            f"rows {spec.device_rows} not divisible by {d} devices (padding needs "
            "a sparse optimizer)"
        )
    if strategy == "column":
        if spec.dim % d:
            return f"dim {spec.dim} not divisible by {d} devices"
        if spec.row_wise_slots:
            return "row-wise optimizer slots need whole rows"
        if spec.has_constraint:
            return "a constraint needs whole rows"
    return None
