"""The planner's result: `Plan`, a `TablePlan` per table, the `TableStack`
of the table-wise tables, and the plan's printed table.

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
"""

from keras_sparse.sharding import plan_store

_fmt_bytes = plan_store.fmt_bytes


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


def stack_key(spec):
    # As `collection_stacks`: one stack per collection and dim (the row size
    # adds nothing there; it keeps apart layer-less specs that differ).
    owner = None if spec.layer is None else id(spec.layer)
    return owner, spec.dim, spec.bytes_per_row


def stack_name(spec):
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
