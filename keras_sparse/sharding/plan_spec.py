"""What the planner knows of one table: `TableSpec`, and the specs of a
model's layers (`collect_layers`).

Pure Python (no backend calls). A spec gives a table's rows and dim, its
sparse-optimizer slots (from the layer's ``sparse_optimizer.slot_specs()``)
and what limits its strategies: a hash layer's keys, a row store below a
device cache, an `EmbeddingCollection`'s table, a dense-gradient optimizer.
The strategies' costs are in `keras_sparse.sharding.plan_cost`.
"""

import copy

from keras_sparse.layers.hash import serving_map
from keras_sparse.sharding import plan_store

#: Two int32 key words and an int32 row (`keras_sparse.layers.hash.serving_map`).
_SERVING_MAP_ROW_INTS = 3


class TableSpec:
    """What the planner needs to know about one table."""

    def __init__(
        self,
        name,
        rows,
        dim,
        slot_widths=(),
        dtype_bytes=4,
        row_wise_slots=False,
        has_constraint=False,
        layer=None,
        shardable=True,
        sparse_update=True,
        collection_table=None,
        hash_keys=False,
        device_rows=None,
        store=None,
        one_device=False,
    ):
        # True for a DistributedHashEmbedding (rows chosen by a key map).
        self.hash_keys = bool(hash_keys)
        if store not in plan_store.STORE_KINDS:
            raise ValueError(
                f"TableSpec '{name}': `store` must be one of "
                f"{plan_store.STORE_KINDS}; received store={store!r}."
            )
        # Where the whole table lives below a device cache (None: no store,
        # the device holds every row).
        self.store = store
        # A cache that runs on one device, or replicated on several
        # (`AllToAllDenseEmbedding` with ``cache_rows``).
        self.one_device = bool(one_device)
        # The table's name inside its `EmbeddingCollection` (``layer``), or
        # None for a one-table layer; ``name`` is then "collection/table".
        self.collection_table = collection_table
        self.shardable = bool(shardable)
        self.sparse_update = bool(sparse_update)
        self.name = name
        self.rows = int(rows)
        self.dim = int(dim)
        self.slot_widths = tuple(int(w) for w in slot_widths)
        self.dtype_bytes = int(dtype_bytes)
        self.row_wise_slots = bool(row_wise_slots)
        self.has_constraint = bool(has_constraint)
        self.layer = layer
        if device_rows is None:
            device_rows = self.rows
        if store is None and device_rows != self.rows:
            raise ValueError(
                f"TableSpec '{name}': `device_rows`={device_rows} differs from "
                f"`rows`={self.rows} without a `store` (the device holds every "
                "row of a table without a store)."
            )
        # The rows the device holds: a cache's rows when there is a store.
        self.device_rows = int(device_rows)

    @property
    def bytes_per_row(self):
        return (self.dim + sum(self.slot_widths)) * self.dtype_bytes

    @property
    def total_bytes(self):
        """Bytes of the rows the device holds, with optimizer slots (with a
        store: the cache's; the whole table's is `table_bytes`)."""
        return self.device_rows * self.bytes_per_row

    @property
    def table_bytes(self):
        """Bytes of all rows, with optimizer slots."""
        return self.rows * self.bytes_per_row

    @property
    def store_bytes(self):
        """``(host bytes, disk bytes)`` of the whole store (0, 0 without
        one); estimate in `keras_sparse.sharding.plan_store`."""
        return plan_store.store_bytes(self)

    def with_cache(self, cache_rows):
        """A copy whose device holds a cache of ``cache_rows`` rows (a hash
        layer's rounded up to whole buckets, as its hash table does)."""
        out = copy.copy(self)
        out.device_rows = plan_store.cache_capacity(cache_rows, self.hash_keys)
        return out

    @property
    def serving_map_bytes(self):
        """A hash layer's serving map (key words, rows and bucket
        directory, int32), replicated on every device whatever the
        strategy. A fixed vocabulary's cache has none (its host maps ids)."""
        if not self.hash_keys:
            return 0
        directory = 2 ** serving_map.directory_bits(self.device_rows) + 1
        return (self.device_rows * _SERVING_MAP_ROW_INTS + directory) * 4

    @classmethod
    def from_layer(cls, layer, num_keys=None):
        """The spec of a one-table layer. With a store: ``device_rows`` is
        the cache's (a hash layer's ``capacity``, an `AllToAllDenseEmbedding`'s
        ``cache_rows``) and ``rows`` all rows: a
        dense layer's ``input_dim``, a hash layer's ``num_keys`` (the
        distinct keys expected; default: its capacity)."""
        opt = getattr(layer, "sparse_optimizer", None)
        specs = [] if opt is None else list(opt.slot_specs())
        rows = getattr(layer, "num_rows", None) or layer.input_dim
        dim = layer.output_dim
        store = plan_store.store_kind(getattr(layer, "store", None))
        device_rows = rows
        cache = getattr(layer, "row_cache", None)
        if cache is not None:  # a fixed vocabulary over a dense store
            device_rows = cache.capacity
        elif store is not None:  # a hash layer: its table is the cache
            rows = max(int(num_keys or rows), rows)
        return cls(
            layer.name,
            rows,
            dim,
            [s.shape(rows, dim)[1] for s in specs],
            row_wise_slots=any(s.row_wise for s in specs),
            has_constraint=getattr(layer, "embeddings_constraint", None) is not None,
            layer=layer,
            shardable=is_shardable_layer(layer),
            sparse_update=opt is not None,
            hash_keys=is_hash_layer(layer),
            device_rows=device_rows,
            store=store,
            one_device=cache is not None,
        )

    @classmethod
    def from_collection(cls, layer):
        """One spec per table of an `EmbeddingCollection`."""
        opt = layer.sparse_optimizer
        specs = [] if opt is None else list(opt.slot_specs())
        out = []
        for table, config in layer.tables.items():
            rows, dim = config.input_dim, config.output_dim
            out.append(
                cls(
                    f"{layer.name}/{table}",
                    rows,
                    dim,
                    [s.shape(rows, dim)[1] for s in specs],
                    row_wise_slots=any(s.row_wise for s in specs),
                    layer=layer,
                    sparse_update=opt is not None,
                    collection_table=table,
                )
            )
        return out

    @property
    def own_sharding(self):
        """The strategy the table's layer pins ("auto": none)."""
        if self.layer is None:
            return "auto"
        if self.collection_table is not None:
            return self.layer.table_sharding(self.collection_table)
        return getattr(self.layer, "sharding", "auto")


def is_shardable_layer(layer):
    # Both layers look their rows up through `lookup_rows`; the hash layer's
    # key->row map stays on the host (one per process) and only its
    # ``[capacity, dim]`` table and slots are split.
    from keras_sparse.layers.dense_embedding import AllToAllDenseEmbedding
    from keras_sparse.layers.hash.embedding import DistributedHashEmbedding

    return isinstance(layer, (AllToAllDenseEmbedding, DistributedHashEmbedding))


def is_collection(layer):
    """True for an `EmbeddingCollection` (one layer owning several tables)."""
    from keras_sparse.layers.embedding_collection import EmbeddingCollection

    return isinstance(layer, EmbeddingCollection)


def is_hash_layer(layer):
    """True for tables whose rows are assigned by a host-side key->row map."""
    from keras_sparse.layers.hash.embedding import DistributedHashEmbedding

    return isinstance(layer, DistributedHashEmbedding)


def collect_layers(model_or_layers, num_keys=None):
    from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase

    num_keys = dict(num_keys or {})

    if isinstance(model_or_layers, (list, tuple)):
        items = list(model_or_layers)
    elif isinstance(model_or_layers, SparseEmbeddingBase):
        items = [model_or_layers]
    else:
        items = list(model_or_layers._flatten_layers(include_self=False))
    out = []
    for item in items:
        if isinstance(item, TableSpec):
            out.append(item)
        elif getattr(item, "keras_sparse_kind", None) == "dense_cache":
            continue  # the cache of an `AllToAllDenseEmbedding`, planned there
        elif isinstance(item, SparseEmbeddingBase):
            out.append(TableSpec.from_layer(item, num_keys.get(item.name)))
        elif is_collection(item):
            out.extend(TableSpec.from_collection(item))
    names = [t.name for t in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"Duplicate table names: {sorted(dup)}")
    unknown = set(num_keys) - set(names)
    if unknown:
        raise ValueError(f"`num_keys` names unknown tables: {sorted(unknown)}")
    return out
