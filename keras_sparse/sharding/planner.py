"""Sharding planner: picks a placement per embedding table from a cost model.

Pure Python (no backend calls). For every table it estimates, per strategy:

* bytes held per device, table plus sparse-optimizer slots (from the layer's
  ``sparse_optimizer.slot_specs()``);
* bytes each device sends per training step (ids out, vectors back, row
  gradients back to the owners);
* lookup load: table-wise placement puts all of a table's lookups on one
  device, so whole tables are bin-packed (greedy, largest first) onto the
  devices by memory and lookups.

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

Table-wise memory: the tables placed table-wise are stacked, as the runtime
does (`keras_sparse.sharding.stacks.collection_stacks`), one stack
per ``(collection, dim)``: a ``[devices * B, dim]`` variable (and one per
optimizer slot) row-sharded over the devices, ``B`` the rows of its busiest
device (the sum of the rows of the stack's tables placed there). EVERY device
holds ``B`` rows of the stack, table plus slots: ``B * bytes_per_row``. The
per-device totals (`Plan.device_bytes`, the printed "max bytes/device") and
the memory-fit decision count that padded stack: placing a table on device
``k`` costs every device ``(max(B, rows_on_k + rows) - B) * bytes_per_row``.
The table's device is the one with the fewest rows of its stack (the
smallest growth of ``B``), then the fewest lookups. In the printed table a
table-wise table's "bytes/device" is its own bytes (held by its owner); a
line per stack below it gives ``B`` and the stack's bytes on every device.
`TableSpec`s without a layer are stacked like the tables of one collection
(one stack per ``dim`` and row size).

Choice: the cheapest strategy that fits in ``memory_per_device``; pinned
strategies are honoured as given. Cost (an alpha-beta model, in bytes):
``comm_bytes * imbalance + rounds * collective_latency_bytes`` where
``rounds`` is the number of collective exchanges per step (data: 1, the
gradient combine, which XLA can fuse with the dense all-reduce; row, table,
column: 3) and ``imbalance`` (table-wise only) is the busiest device's lookups
over the fair share after placing the table.
"""

import copy
import math

from keras_sparse.layers.hash import serving_map
from keras_sparse.sharding import plan_store

STRATEGIES = ("data", "table", "row", "column", "key")
_TIE_ORDER = {s: i for i, s in enumerate(STRATEGIES)}
_ID_BYTES = 4
#: Collective exchanges per training step (forward + backward).
ROUNDS = {"data": 1, "table": 3, "row": 3, "column": 3, "key": 6}
_KEY_BYTES = 8
#: Key exchange of key sharding: two words and a count out, a row back.
_ROUTED_KEY_BYTES = 16


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
        # A cache that runs on one device only (`AllToAllDenseEmbedding`
        # with ``cache_rows``).
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
        """A copy whose device holds a cache of ``cache_rows`` rows (rounded
        up to whole buckets, as the layer's hash table does)."""
        out = copy.copy(self)
        out.device_rows = plan_store.cache_capacity(cache_rows)
        return out

    @property
    def serving_map_bytes(self):
        """A hash layer's (or a cache's) serving map (key words, rows and
        bucket directory, int32), replicated on every device whatever the
        strategy."""
        if not (self.hash_keys or self.store):
            return 0
        directory = 2 ** serving_map.directory_bits(self.device_rows) + 1
        return (self.device_rows * _SERVING_MAP_ROW_INTS + directory) * 4

    @classmethod
    def from_layer(cls, layer, num_keys=None):
        """The spec of a one-table layer. With a store: ``device_rows`` is
        the cache's (a hash layer's ``capacity``, an `AllToAllDenseEmbedding`'s
        ``cache_rows`` rounded to whole buckets) and ``rows`` all rows: a
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
            shardable=_is_shardable_layer(layer),
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


class TablePlan:
    """One table's placement. ``bytes_per_device``: what each of its
    ``devices`` holds (with a row store: the cache); ``host_bytes`` /
    ``disk_bytes``: its store on each process's host (set by `Plan`);
    ``cache_rows``: the cache the plan sized for it (None: the layer's own;
    see `plan`'s ``propose_cache``)."""

    def __init__(
        self,
        spec,
        strategy,
        devices,
        bytes_per_device,
        comm_bytes,
        reason,
        cache_rows=None,
    ):
        self.spec = spec
        self.strategy = strategy
        self.devices = tuple(devices)
        self.bytes_per_device = int(bytes_per_device)
        self.comm_bytes = int(comm_bytes)
        self.reason = reason
        self.cache_rows = None if cache_rows is None else int(cache_rows)
        self.host_bytes = self.disk_bytes = 0

    @property
    def name(self):
        return self.spec.name


class TableStack:
    """The stacked variable of a group of table-wise tables.

    ``[num_devices * block_rows, dim]`` rows (plus one variable per optimizer
    slot), row-sharded: every device holds ``block_rows`` rows, the rows of
    the busiest device, so ``bytes_per_device`` on each of them.
    """

    def __init__(self, name, dim, bytes_per_row, num_devices):
        self.name = name
        self.dim = int(dim)
        self.bytes_per_row = int(bytes_per_row)
        self.device_rows = [0] * int(num_devices)
        self.tables = []

    @property
    def block_rows(self):
        return max(self.device_rows, default=0)

    @property
    def bytes_per_device(self):
        return self.block_rows * self.bytes_per_row

    def growth(self, device, rows):
        """Bytes every device gains when ``rows`` rows go to ``device``."""
        block = self.block_rows
        return (max(block, self.device_rows[device] + rows) - block) * (
            self.bytes_per_row
        )

    def add(self, name, device, rows):
        self.device_rows[device] += int(rows)
        self.tables.append(name)


def _stack_key(spec):
    # As `collection_stacks`: one stack per collection and dim (the row size
    # adds nothing there; it keeps apart layer-less specs that differ).
    owner = None if spec.layer is None else id(spec.layer)
    return owner, spec.dim, spec.bytes_per_row


def _stack_name(spec):
    name = f"stack_{spec.dim}_table"
    return name if spec.layer is None else f"{spec.layer.name}/{name}"


class Plan:
    """Result of `plan`: a `TablePlan` per table plus per-device totals.

    ``device_bytes[k]``: bytes device ``k`` holds (tables and slots; a
    table with a row store: its cache), the table-wise stacks padded as the
    runtime allocates them; ``stacks``: the `TableStack` of each group of
    table-wise tables; ``host_bytes`` / ``disk_bytes``: the row stores'
    bytes on each process's host (`plan_store.store_bytes_per_process`).
    """

    def __init__(
        self,
        tables,
        num_devices,
        memory_per_device,
        device_bytes,
        stacks=(),
        processes=1,
        host_memory=None,
    ):
        self.tables = {t.name: t for t in tables}
        self.num_devices = num_devices
        self.memory_per_device = memory_per_device
        self.device_bytes = list(device_bytes)
        self.stacks = list(stacks)
        self.processes = processes
        self.host_memory = host_memory
        for t in tables:
            t.host_bytes, t.disk_bytes = plan_store.store_bytes_per_process(
                t.spec, t.strategy, processes
            )

    @property
    def host_bytes(self):
        """Bytes of the row stores in each process's host memory."""
        return sum(t.host_bytes for t in self)

    @property
    def disk_bytes(self):
        """Bytes of the row stores on each process's local disk."""
        return sum(t.disk_bytes for t in self)

    def strategy(self, name):
        return self.tables[name].strategy

    def __getitem__(self, name):
        return self.tables[name]

    def __iter__(self):
        return iter(self.tables.values())

    def __len__(self):
        return len(self.tables)

    @property
    def total_comm_bytes(self):
        return sum(t.comm_bytes for t in self)

    def __str__(self):
        head = (
            "table",
            "rows",
            "dim",
            "strategy",
            "devices",
            "bytes/device",
            "comm bytes/step",
        )
        # Row stores add their columns: the rows the device holds (a
        # cache's) and the store's bytes on the host and on disk.
        stored = any(t.spec.store is not None for t in self)
        if stored:
            head = head[:2] + ("device rows",) + head[2:6]
            head += ("host bytes", "disk bytes", "comm bytes/step")
        body = []
        for t in self:
            devs = t.devices
            if len(devs) == self.num_devices:
                dev_txt = f"all {len(devs)}"
            else:
                dev_txt = ",".join(str(d) for d in devs)
            row = [
                t.name,
                str(t.spec.rows),
                str(t.spec.dim),
                t.strategy,
                dev_txt,
                _fmt_bytes(t.bytes_per_device),
            ]
            if stored:
                row.insert(2, str(t.spec.device_rows))
                row += [_fmt_bytes(t.host_bytes), _fmt_bytes(t.disk_bytes)]
            body.append(tuple(row + [_fmt_bytes(t.comm_bytes)]))
        widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]

        def line(row):
            return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

        out = [line(head), line(tuple("-" * w for w in widths))]
        out += [line(r) for r in body]
        out.append("")
        out += [f"{t.name}: {t.reason}" for t in self]
        for st in self.stacks:
            rows = ",".join(str(r) for r in st.device_rows)
            out.append(
                f"{st.name} (table-wise stack of {len(st.tables)} tables): "
                f"{self.num_devices} x {st.block_rows} rows, every device holds "
                f"the busiest device's {st.block_rows} rows with slots = "
                f"{_fmt_bytes(st.bytes_per_device)} (table rows per device: "
                f"{rows})"
            )
        cap = self.memory_per_device
        host = ""
        if stored:
            room = self.host_memory
            host = (
                f"; host bytes/process {_fmt_bytes(self.host_bytes)}"
                + ("" if room is None else f" of {_fmt_bytes(room)}")
                + f"; disk bytes/process {_fmt_bytes(self.disk_bytes)}"
            )
        out.append(
            f"max bytes/device {_fmt_bytes(max(self.device_bytes, default=0))}"
            + ("" if cap is None else f" of {_fmt_bytes(cap)}")
            + host
            + f"; est. comm bytes/step/device {_fmt_bytes(self.total_comm_bytes)}"
        )
        return "\n".join(out)

    __repr__ = __str__


_fmt_bytes = plan_store.fmt_bytes


# ----------------------------------------------------------------- cost model
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


#: Two int32 key words and an int32 row (`keras_sparse.layers.hash.serving_map`).
_SERVING_MAP_ROW_INTS = 3


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

    The bytes counted are `plan`'s: the cache's rows, rounded up to whole
    buckets as its hash table does (`plan_store.cache_capacity`), of values
    and optimizer slots (split over ``devices`` for ``strategy="row"``),
    plus its serving map (on every device). At most the table's rows (a
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


def _cache_bytes(devices):
    return lambda spec, rows, strategy: cache_device_bytes(
        spec, rows, strategy, devices
    )


def _table_bytes_per_device(spec, strategy, num_devices):
    if strategy in ("data", "table"):
        return spec.total_bytes
    if strategy in ("row", "key"):  # padded to an equal block per device
        return math.ceil(spec.device_rows / num_devices) * spec.bytes_per_row
    return math.ceil(spec.total_bytes / num_devices)


def _is_shardable_layer(layer):
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


def _structural_problem(spec, strategy, d, processes=1):
    if strategy == "key" and not spec.hash_keys:
        return "key sharding is for DistributedHashEmbedding tables"
    if spec.hash_keys and strategy != "key" and processes > 1:
        return (
            f"one host key map per process cannot serve {processes} processes "
            "(key sharding gives each device its own)"
        )
    if strategy != "data" and not spec.shardable:
        return f"{type(spec.layer).__name__} tables can only be replicated"
    if spec.one_device and d > 1:
        return "a cache (`cache_rows`) runs on one device only"
    if spec.store is not None and strategy not in ("data", "row"):
        return "a table with a row store runs replicated or row-sharded only"
    in_collection = spec.collection_table is not None
    if strategy == "table" and spec.layer is not None and not in_collection:
        return "a whole table per device needs the table in an EmbeddingCollection"
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


# --------------------------------------------------------------------- plan
def _collect_layers(model_or_layers, num_keys=None):
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


def plan(
    model_or_layers,
    devices=8,
    memory_per_device=None,
    pinned=None,
    batch_size=1024,
    ids_per_sample=1,
    strategies=STRATEGIES,
    collective_latency_bytes=64 * 1024,
    processes=1,
    host_memory=None,
    num_keys=None,
    propose_cache=False,
    ids_sample=None,
):
    """Chooses a strategy per table.

    A table with a row store (``store=``) holds only its cache on the
    device: its device bytes are the cache's, its store's bytes count on
    the host (host memory, or disk and the keys' index in host memory; see
    `keras_sparse.sharding.plan_store`). When its cache does not fit the
    memory the other tables leave, or when ``propose_cache`` asks, the plan
    sizes the cache: the largest that fits (`propose_cache_rows`), given as
    the table's ``cache_rows`` with a reason line; several such tables
    share the memory left in proportion to their whole tables.

    Args:
        model_or_layers: a Keras model, a list of keras_sparse embedding
            layers, or a list of `TableSpec`.
        devices: number of devices or a list of devices.
        memory_per_device: bytes available per device for tables and slots
            (None: unlimited).
        pinned: ``{table_name: strategy}`` fixed by the user (a layer's own
            ``sharding`` other than "auto" counts as pinned too).
        batch_size: global batch size.
        ids_per_sample: ids per sample per table: an int, or a dict by table
            name (missing names default to 1).
        strategies: strategies the planner may choose for unpinned tables.
        collective_latency_bytes: fixed cost of one collective exchange,
            expressed in bytes (latency x bandwidth).
        processes: processes of the run (`jax.process_count`); with more
            than one, hash layers can only be key-sharded.
        host_memory: bytes of host memory per process for row stores (None:
            unlimited). Host stores above it get a reason line suggesting
            ``ks.store.Disk``.
        num_keys: ``{table_name: distinct keys}`` a hash layer's store
            holds (default: its capacity); sizes its store.
        propose_cache: True (every table with a store) or table names: size
            those caches to the largest that fits, even where the layer's
            own fits.
        ids_sample: ``{table_name: ids}``, a sample of a table's lookups: a
            sized cache's reason line gives the sample's hit rate on its
            most frequent ids (`keras_sparse.sharding.plan_store.hit_rate`).

    Returns:
        A `Plan`.

    Raises:
        ValueError: a table fits under no allowed strategy (a table without
            a store: the message gives the cache that would fit over one),
            or not even the smallest cache of a table with a store fits.
    """
    d = devices if isinstance(devices, int) else len(list(devices))
    if d < 1:
        raise ValueError(f"`devices` must be >= 1; received {devices!r}")
    specs = _collect_layers(model_or_layers, num_keys)
    asked = plan_store.asked_tables(specs, propose_cache)
    pinned = dict(pinned or {})
    for s in specs:
        own = s.own_sharding
        if s.name not in pinned and own != "auto" and s.shardable:
            pinned[s.name] = own
    unknown = set(pinned) - {s.name for s in specs}
    if unknown:
        raise ValueError(f"`pinned` names unknown tables: {sorted(unknown)}")
    for name, strat in pinned.items():
        if strat not in STRATEGIES:
            raise ValueError(
                f"Table '{name}': pinned strategy {strat!r} is not one of {STRATEGIES}."
            )
    cap = math.inf if memory_per_device is None else memory_per_device

    def _allowed(spec):
        # Key sharding only exists for hash layers, a row store's cache runs
        # replicated or row-sharded: not worth a reason line each.
        if spec.store is not None:
            return [s for s in strategies if s in ("data", "row")]
        return [s for s in strategies if s != "key" or spec.hash_keys]

    def lookups_of(spec):
        if isinstance(ids_per_sample, dict):
            return batch_size * ids_per_sample.get(spec.name, 1)
        return batch_size * ids_per_sample

    used = [0] * d
    load = [0.0] * d
    stacks = {}  # _stack_key -> TableStack, in creation order
    fair_load = sum(lookups_of(s) for s in specs) / d
    results = {}
    # Pinned first, largest first (greedy bin packing of pinned table-wise
    # tables); then the smallest tables first: replicating a small table
    # saves the most communication per byte of memory. While placing a table,
    # memory for the smallest footprint of every table still to place is held
    # back, so an early table cannot take memory a later one needs.
    # Tables with a row store last: the plan may size their caches from the
    # memory the others leave.
    order = sorted(
        specs,
        key=lambda s: (
            s.store is not None,
            (0, -s.total_bytes) if s.name in pinned else (1, s.total_bytes),
        ),
    )

    def usable(spec):
        opts = [pinned[spec.name]] if spec.name in pinned else _allowed(spec)
        return [o for o in opts if not _structural_problem(spec, o, d, processes)]

    def min_footprint(spec):
        if spec.store is not None:  # the smallest cache
            spec = spec.with_cache(1)
        if any(o != "data" for o in usable(spec)):
            return spec.total_bytes / d  # sharded, or packed whole somewhere
        return spec.total_bytes

    pending = sum(min_footprint(s) for s in order)

    def choose(spec, reserves):
        """``(best, best_stack, tried)``: the cheapest strategy that fits
        with ``reserve`` bytes held back, for the first reserve that fits."""
        lk = lookups_of(spec)
        options = [pinned[spec.name]] if spec.name in pinned else _allowed(spec)
        for reserve in reserves:
            tried = []
            best = best_stack = None
            for strat in options:
                problem = _structural_problem(spec, strat, d, processes)
                per_dev = bytes_per_device(spec, strat, d)
                comm = comm_bytes(spec, strat, d, lk)
                if problem:
                    tried.append(f"{strat}: {problem}")
                    continue
                if strat == "table":
                    # Every device holds the stack's busiest block: the device
                    # with the fewest rows of the stack (the smallest growth
                    # of that block), then the fewest lookups.
                    stack = stacks.get(_stack_key(spec)) or TableStack(
                        _stack_name(spec), spec.dim, spec.bytes_per_row, d
                    )
                    dev = min(range(d), key=lambda i: (stack.device_rows[i], load[i]))
                    grow = stack.growth(dev, spec.device_rows)
                    free = cap - max(used) - reserve
                    if grow > free:
                        tried.append(
                            f"table: stack {stack.name} grows by "
                            f"{_fmt_bytes(grow)}/device (to "
                            f"{stack.device_rows[dev] + spec.device_rows} rows) > "
                            f"{_fmt_bytes(free)} free"
                        )
                        continue
                    imbalance = max(1.0, (load[dev] + lk) / max(fair_load, 1e-9))
                    cost = comm * imbalance
                    devs = (dev,)
                else:
                    free = cap - max(used) - reserve
                    if per_dev > free:
                        tried.append(
                            f"{strat}: {_fmt_bytes(per_dev)}/device > "
                            f"{_fmt_bytes(free)} free"
                        )
                        continue
                    cost = comm
                    devs = tuple(range(d))
                rounds = ROUNDS[strat]
                if spec.hash_keys and strat != "key":
                    rounds += 2  # keys gathered to the host table, rows back
                cost += rounds * collective_latency_bytes
                key = (cost, _TIE_ORDER[strat])
                if best is None or key < best[0]:
                    best = (key, strat, devs, per_dev, comm)
                    if strat == "table":
                        best_stack = (stack, grow)
                tried.append(f"{strat}: cost {_fmt_bytes(cost)}")
            if best is not None:
                break
        return best, best_stack, tried

    def commit(spec, best, best_stack, tried, note=None, cache_rows=None):
        (cost, _), strat, devs, per_dev, comm = best
        lk = lookups_of(spec)
        if strat == "table":
            stack, grow = best_stack
            stacks.setdefault(_stack_key(spec), stack)
            stack.add(spec.name, devs[0], spec.device_rows)
            load[devs[0]] += lk
            for i in range(d):
                used[i] += grow
        else:
            for i in devs:
                used[i] += per_dev
                load[i] += lk / d
        if spec.name in pinned:
            reason = f"pinned to {strat}"
        else:
            others = [t for t in tried if not t.startswith(strat + ":")]
            reason = f"lowest cost that fits ({_fmt_bytes(cost)})"
            if others:
                reason += "; " + "; ".join(others)
        if note:
            reason = f"{note}; {reason}"
        results[spec.name] = TablePlan(
            spec, strat, devs, per_dev, comm, reason, cache_rows=cache_rows
        )

    def free_now():
        return cap - max(used)

    deferred = []  # store tables whose cache the plan proposes
    for spec in order:
        pending -= min_footprint(spec)
        if spec.store is not None and spec.name in asked:
            deferred.append(spec)
            continue
        best, best_stack, tried = choose(spec, (pending, 0))
        if best is None and spec.store is not None:
            deferred.append(spec)
            continue
        if best is None:
            raise ValueError(
                f"Table '{spec.name}' ({spec.rows} rows x {spec.dim} dim, "
                f"{_fmt_bytes(spec.total_bytes)} with optimizer slots) fits no "
                f"strategy on {d} devices with "
                f"{_fmt_bytes(cap) if cap != math.inf else 'unlimited'} per device "
                f"({_fmt_bytes(max(used))} already used): "
                + "; ".join(tried)
                + plan_store.store_suggestion(spec, free_now(), d, _cache_bytes(d))
            )
        commit(spec, best, best_stack, tried)
    for i, spec in enumerate(deferred):
        # The memory left is shared by the tables still to size, in
        # proportion to their whole tables.
        share = free_now() * spec.table_bytes / sum(s.table_bytes for s in deferred[i:])
        rows, note = plan_store.propose(
            spec, share, free_now(), usable(spec), _cache_bytes(d)
        )
        sample = (ids_sample or {}).get(spec.name)
        if sample is not None and rows:
            rate = plan_store.hit_rate(sample, rows)
            note += f"; expected hit rate {rate:.1%} on the ids sample"
        best = None
        if rows:
            sized = spec.with_cache(rows)
            best, best_stack, tried = choose(sized, (free_now() - share,))
        if best is None:
            raise ValueError(
                f"Table '{spec.name}' (row store {spec.store!r}): no cache fits "
                f"on {d} devices: {note}."
            )
        commit(sized, best, best_stack, tried, note=note, cache_rows=rows)
    ordered = [results[s.name] for s in specs]
    out = Plan(
        ordered, d, memory_per_device, used, stacks.values(), processes, host_memory
    )
    for name, note in plan_store.host_notes(out).items():
        out[name].reason += "; " + note
    return out
