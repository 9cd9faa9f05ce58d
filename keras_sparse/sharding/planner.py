"""Sharding planner: picks a placement per embedding table from a cost model.

Pure Python (no backend calls). The tables' specs come from
`keras_sparse.sharding.plan_spec`, the bytes and communication of each
strategy from `keras_sparse.sharding.plan_cost`, row stores' caches from
`keras_sparse.sharding.plan_store`; `plan` returns a
`keras_sparse.sharding.plan_result.Plan`.

Choice: the cheapest strategy that fits in ``memory_per_device``; pinned
strategies are honoured as given. Cost (an alpha-beta model, in bytes):
``comm_bytes * imbalance + rounds * collective_latency_bytes`` where
``rounds`` is the number of collective exchanges per step (data: 1, the
gradient combine, which XLA can fuse with the dense all-reduce; row, table,
column: 3) and ``imbalance`` (table-wise only) is the busiest device's lookups
over the fair share after placing the table.
"""

import math

from keras_sparse.sharding import plan_store
from keras_sparse.sharding.plan_cost import ROUNDS
from keras_sparse.sharding.plan_cost import STRATEGIES
from keras_sparse.sharding.plan_cost import TIE_ORDER
from keras_sparse.sharding.plan_cost import bytes_per_device
from keras_sparse.sharding.plan_cost import cache_bytes_for
from keras_sparse.sharding.plan_cost import comm_bytes
from keras_sparse.sharding.plan_cost import structural_problem
from keras_sparse.sharding.plan_result import Plan
from keras_sparse.sharding.plan_result import TablePlan
from keras_sparse.sharding.plan_result import TableStack
from keras_sparse.sharding.plan_result import stack_key
from keras_sparse.sharding.plan_result import stack_name
from keras_sparse.sharding.plan_spec import collect_layers

_fmt_bytes = plan_store.fmt_bytes


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
    specs = collect_layers(model_or_layers, num_keys)
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
    stacks = {}  # stack_key -> TableStack, in creation order
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
        return [o for o in opts if not structural_problem(spec, o, d, processes)]

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
                problem = structural_problem(spec, strat, d, processes)
                per_dev = bytes_per_device(spec, strat, d)
                comm = comm_bytes(spec, strat, d, lk)
                if problem:
                    tried.append(f"{strat}: {problem}")
                    continue
                if strat == "table":
                    # Every device holds the stack's busiest block: the device
                    # with the fewest rows of the stack (the smallest growth
                    # of that block), then the fewest lookups.
                    stack = stacks.get(stack_key(spec)) or TableStack(
                        stack_name(spec), spec.dim, spec.bytes_per_row, d
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
                key = (cost, TIE_ORDER[strat])
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
            stacks.setdefault(stack_key(spec), stack)
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
                + plan_store.store_suggestion(spec, free_now(), d, cache_bytes_for(d))
            )
        commit(spec, best, best_stack, tried)
    for i, spec in enumerate(deferred):
        # The memory left is shared by the tables still to size, in
        # proportion to their whole tables.
        share = free_now() * spec.table_bytes / sum(s.table_bytes for s in deferred[i:])
        rows, note = plan_store.propose(
            spec, share, free_now(), usable(spec), cache_bytes_for(d)
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
