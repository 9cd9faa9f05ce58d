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

import math

from keras_sparse.layers.hash import serving_map

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
    ):
        # True for a DistributedHashEmbedding (rows chosen by a key map).
        self.hash_keys = bool(hash_keys)
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

    @property
    def bytes_per_row(self):
        return (self.dim + sum(self.slot_widths)) * self.dtype_bytes

    @property
    def total_bytes(self):
        return self.rows * self.bytes_per_row

    @property
    def serving_map_bytes(self):
        """A hash layer's serving map (key words, rows and bucket directory,
        int32), replicated on every device whatever the strategy."""
        if not self.hash_keys:
            return 0
        directory = 2 ** serving_map.directory_bits(self.rows) + 1
        return (self.rows * _SERVING_MAP_ROW_INTS + directory) * 4

    @classmethod
    def from_layer(cls, layer):
        opt = getattr(layer, "sparse_optimizer", None)
        specs = [] if opt is None else list(opt.slot_specs())
        rows = getattr(layer, "num_rows", None) or layer.input_dim
        dim = layer.output_dim
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
    def __init__(self, spec, strategy, devices, bytes_per_device, comm_bytes, reason):
        self.spec = spec
        self.strategy = strategy
        self.devices = tuple(devices)
        self.bytes_per_device = int(bytes_per_device)
        self.comm_bytes = int(comm_bytes)
        self.reason = reason

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

    ``device_bytes[k]``: bytes device ``k`` holds (tables and slots), the
    table-wise stacks padded as the runtime allocates them; ``stacks``: the
    `TableStack` of each group of table-wise tables.
    """

    def __init__(self, tables, num_devices, memory_per_device, device_bytes, stacks=()):
        self.tables = {t.name: t for t in tables}
        self.num_devices = num_devices
        self.memory_per_device = memory_per_device
        self.device_bytes = list(device_bytes)
        self.stacks = list(stacks)

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
        body = []
        for t in self:
            devs = t.devices
            if len(devs) == self.num_devices:
                dev_txt = f"all {len(devs)}"
            else:
                dev_txt = ",".join(str(d) for d in devs)
            body.append(
                (
                    t.name,
                    str(t.spec.rows),
                    str(t.spec.dim),
                    t.strategy,
                    dev_txt,
                    _fmt_bytes(t.bytes_per_device),
                    _fmt_bytes(t.comm_bytes),
                )
            )
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
        out.append(
            f"max bytes/device {_fmt_bytes(max(self.device_bytes, default=0))}"
            + ("" if cap is None else f" of {_fmt_bytes(cap)}")
            + f"; est. comm bytes/step/device {_fmt_bytes(self.total_comm_bytes)}"
        )
        return "\n".join(out)

    __repr__ = __str__


def _fmt_bytes(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


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
        reduce = 2 * remote * spec.rows * dim * b  # ring all-reduce dense grad
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


def _table_bytes_per_device(spec, strategy, num_devices):
    if strategy in ("data", "table"):
        return spec.total_bytes
    if strategy in ("row", "key"):  # padded to an equal block per device
        return math.ceil(spec.rows / num_devices) * spec.bytes_per_row
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
    in_collection = spec.collection_table is not None
    if strategy == "table" and spec.layer is not None and not in_collection:
        return "a whole table per device needs the table in an EmbeddingCollection"
    if in_collection and strategy != "data" and not spec.sparse_update:
        # Sharded stacks are padded and re-stacked on load; a Keras
        # optimizer's state of the stacked shape would not follow.
        return "sharded EmbeddingCollection tables need a sparse optimizer"
    if strategy == "row" and spec.rows % d and not spec.sparse_update:
        return (
            f"rows {spec.rows} not divisible by {d} devices (padding needs "
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
def _collect_layers(model_or_layers):
    from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase

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
        elif isinstance(item, SparseEmbeddingBase):
            out.append(TableSpec.from_layer(item))
        elif is_collection(item):
            out.extend(TableSpec.from_collection(item))
    names = [t.name for t in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"Duplicate table names: {sorted(dup)}")
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
):
    """Chooses a strategy per table.

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

    Returns:
        A `Plan`.

    Raises:
        ValueError: a table fits under no allowed strategy.
    """
    d = devices if isinstance(devices, int) else len(list(devices))
    if d < 1:
        raise ValueError(f"`devices` must be >= 1; received {devices!r}")
    specs = _collect_layers(model_or_layers)
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
        # Key sharding only exists for hash layers: not worth a reason line
        # on every other table.
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
    order = sorted(
        specs,
        key=lambda s: (0, -s.total_bytes) if s.name in pinned else (1, s.total_bytes),
    )

    def min_footprint(spec):
        opts = [pinned[spec.name]] if spec.name in pinned else _allowed(spec)
        ok = [o for o in opts if not _structural_problem(spec, o, d, processes)]
        if any(o != "data" for o in ok):
            return spec.total_bytes / d  # sharded, or packed whole somewhere
        return spec.total_bytes

    pending = sum(min_footprint(s) for s in order)
    for spec in order:
        lk = lookups_of(spec)
        options = [pinned[spec.name]] if spec.name in pinned else _allowed(spec)
        pending -= min_footprint(spec)
        for reserve in (pending, 0):
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
                    grow = stack.growth(dev, spec.rows)
                    free = cap - max(used) - reserve
                    if grow > free:
                        tried.append(
                            f"table: stack {stack.name} grows by "
                            f"{_fmt_bytes(grow)}/device (to "
                            f"{stack.device_rows[dev] + spec.rows} rows) > "
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
        if best is None:
            raise ValueError(
                f"Table '{spec.name}' ({spec.rows} rows x {spec.dim} dim, "
                f"{_fmt_bytes(spec.total_bytes)} with optimizer slots) fits no "
                f"strategy on {d} devices with "
                f"{_fmt_bytes(cap) if cap != math.inf else 'unlimited'} per device "
                f"({_fmt_bytes(max(used))} already used): " + "; ".join(tried)
            )
        (cost, _), strat, devs, per_dev, comm = best
        if strat == "table":
            stack, grow = best_stack
            stacks.setdefault(_stack_key(spec), stack)
            stack.add(spec.name, devs[0], spec.rows)
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
        results[spec.name] = TablePlan(spec, strat, devs, per_dev, comm, reason)
    ordered = [results[s.name] for s in specs]
    return Plan(ordered, d, memory_per_device, used, stacks.values())
