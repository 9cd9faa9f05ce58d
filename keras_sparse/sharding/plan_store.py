"""The planner's view of a row store: a device cache over a host or disk
store, what each level holds, and the largest cache a budget allows.

A table with a row store (``DistributedHashEmbedding(store=...)``,
``AllToAllDenseEmbedding(cache_rows=C, store=...)``) holds on the device a
cache of ``device_rows`` rows (values and optimizer slots) and, a hash
layer, a serving map over them; the whole table lives one level down. A
hash layer's cache is its hash table's rows, so a cache of ``C`` rows holds
`cache_capacity` ``(C)`` rows: ``C`` rounded up to whole buckets of
`BUCKET_ROWS`, at least `MIN_CACHE_ROWS`; a fixed vocabulary's cache holds
``C`` rows exactly (its id map lives on the host).

Store bytes (`store_bytes`), for ``rows`` rows (a hash layer: its keys):

* dense store (a fixed vocabulary): ``rows x bytes_per_row`` (values and
  slots), no keys: an id is its row;
* keyed store (a hash layer): per key its row, its table score (one int64,
  `SCORE_BYTES`) and at most `KEY_INDEX_BYTES` of key index
  (`keras_sparse.store.key_index`, arrays grown by doubling): the key, 8-16
  bytes; its int32 hash-table position at a load of 0.25-0.6, 7-16 bytes;
  a live flag, 1-2 bytes (about 17 in all right after a growth, 34 at
  most). A key keeps its stored copy while the cache holds it again, so
  the store reaches ``rows`` keys: every key the layer ever evicted.

Not counted: rows allocated ahead of the keys (a host store grows by
doubling up to blocks of 64 MiB per field, then a block at a time) and the
page cache of a disk store.

A host store holds all of it in host memory; a disk store keeps the rows
in files and the keys and their index in host memory. Row- or key-sharded
tables are assumed to keep on each process the store of the rows its own
devices own (`store_bytes_per_process`).
"""

import math

#: Rows per bucket of a hash table (`keras_sparse.table.HashTable`).
BUCKET_ROWS = 16
#: The fewest rows of a hash table: 4 buckets.
MIN_CACHE_ROWS = 4 * BUCKET_ROWS
#: A keyed store's index per key, at most: the key (8, up to 2x as its
#: array doubles), its int32 hash-table position (load 0.25 at least:
#: 16), its live flag (1, up to 2x).
KEY_INDEX_BYTES = 16 + 16 + 2
#: A keyed store's score field per key (LRU step or LFU count, int64).
SCORE_BYTES = 8
STORE_KINDS = (None, "host", "disk")


def cache_capacity(rows, hashed=True):
    """Rows a cache of ``rows`` requested rows holds: a hash table's whole
    buckets (``hashed``), else exactly ``rows``."""
    if not hashed:
        return int(rows)
    buckets = max(-(-int(rows) // BUCKET_ROWS), MIN_CACHE_ROWS // BUCKET_ROWS)
    return buckets * BUCKET_ROWS


def store_kind(spec):
    """ "host", "disk" or None for a layer's ``store`` spec."""
    if spec is None:
        return None
    from keras_sparse import store as row_stores

    return "disk" if isinstance(row_stores.get(spec), row_stores.Disk) else "host"


def store_bytes(spec):
    """``(host bytes, disk bytes)`` of ``spec``'s whole store (see module)."""
    if spec.store is None:
        return 0, 0
    rows = spec.rows * spec.bytes_per_row
    keys = 0
    if spec.hash_keys:  # keyed: score per key, and the index (in memory)
        rows += spec.rows * SCORE_BYTES
        keys = spec.rows * KEY_INDEX_BYTES
    if spec.store == "disk":
        return keys, rows
    return rows + keys, 0


def store_bytes_per_process(spec, strategy, processes):
    """``(host, disk)`` bytes of the store on each process's host.

    Assumes each process keeps the store of the rows (keys) its own devices
    own: a row- or key-sharded table splits its store evenly over the
    processes; replicated and table-wise ones hold it whole on each.
    """
    host, disk = store_bytes(spec)
    if strategy in ("row", "key") and processes > 1:
        return math.ceil(host / processes), math.ceil(disk / processes)
    return host, disk


def largest_cache(spec, budget, cache_bytes):
    """The most rows (at most ``spec.rows``) whose ``cache_bytes(rows)``
    fits ``budget`` (0: none); the bytes grow with the rows."""
    lo, hi = 0, max(spec.rows, 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cache_bytes(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def hit_rate(ids_sample, cache_rows):
    """Fraction of the lookups of ``ids_sample`` (any array of ids) that
    fall on its ``cache_rows`` most frequent ids: the hit rate of a cache
    holding exactly those (an LRU or LFU cache comes close to it when the
    sample's frequencies are stable)."""
    import numpy as np

    ids = np.asarray(ids_sample).reshape(-1)
    if ids.size == 0:
        return 0.0
    counts = np.sort(np.unique(ids, return_counts=True)[1])[::-1]
    return float(counts[: max(int(cache_rows), 0)].sum() / ids.size)


def asked_tables(specs, propose_cache):
    """The names ``plan(propose_cache=...)`` asks caches for."""
    if propose_cache is True:
        return {s.name for s in specs if s.store is not None}
    if not propose_cache:
        return set()
    names = {propose_cache} if isinstance(propose_cache, str) else set(propose_cache)
    stores = {s.name for s in specs if s.store is not None}
    if names - stores:
        raise ValueError(
            f"`propose_cache` names tables without a row store or unknown: "
            f"{sorted(names - stores)}; tables with a store: {sorted(stores)}."
        )
    return names


def propose(spec, share, free, strategies, cache_bytes):
    """``(cache rows, reason)``: the largest cache of ``spec`` within
    ``share`` bytes per device, under the best of ``strategies`` (0 rows
    when none fits); ``cache_bytes(spec, rows, strategy)``: its bytes per
    device."""
    rows = max(
        (
            largest_cache(spec, share, lambda c, s=s: cache_bytes(spec, c, s))
            for s in strategies
        ),
        default=0,
    )
    left = f"{_fmt(share)} of {_fmt(free)} left after other tables"
    if share < free:
        left = f"its share {_fmt(share)} of {_fmt(free)} left after other tables"
    if not rows:
        return 0, (
            f"not even a cache of {cache_capacity(1, spec.hash_keys)} rows "
            f"({_fmt(cache_bytes(spec, 1, 'data'))}/device) fits "
            f"{left} (strategies {list(strategies)})"
        )
    kept = cache_capacity(rows, spec.hash_keys) * spec.bytes_per_row
    return rows, (
        f"cache {rows:,} of {spec.rows:,} rows ({_pct(rows, spec.rows)}): "
        f"{_fmt(kept)} of values and slots, within {left}"
    )


def store_suggestion(spec, free, devices, cache_bytes):
    """The end of a "fits no strategy" error of a table without a store:
    the cache that would fit over a row store (empty where there is none
    to suggest); ``cache_bytes`` as for `propose`."""
    # Layers with a ``store`` argument (a `TableSpec` without a layer, too).
    if spec.collection_table is not None or not spec.shardable:
        return ""
    layer = "DistributedHashEmbedding" if spec.hash_keys else "AllToAllDenseEmbedding"
    stored = _with_store(spec, "host")
    # A fixed vocabulary's cache runs replicated (`cache_checks`).
    strategies = ["data"]
    rows = max(
        largest_cache(stored, free, lambda c, s=s: cache_bytes(stored, c, s))
        for s in strategies
    )
    if not rows:
        return ""
    arg = "capacity" if spec.hash_keys else "cache_rows"
    return (
        f". With a row store a cache fits: {arg}={rows:,} of {spec.rows:,} rows "
        f"({_pct(rows, spec.rows)}) in the {_fmt(free)} left, e.g. "
        f"{layer}(..., {arg}={rows}, store='host') (whole table "
        f"{_fmt(store_bytes(stored)[0])} in host memory; ks.store.Disk(path) "
        "puts it on disk)"
        + (
            ""
            if spec.hash_keys or devices == 1
            else "; `cache_rows` runs replicated (a copy per process)"
        )
    )


def host_notes(plan):
    """``{table: note}`` when the stores' host bytes exceed
    ``plan.host_memory``: the host stores to move to ``ks.store.Disk``,
    largest first, until the rest fits (all of them if it never does)."""
    room = plan.host_memory
    if room is None or plan.host_bytes <= room:
        return {}
    out, need = {}, plan.host_bytes
    hosted = [t for t in plan if t.spec.store == "host"]
    for t in sorted(hosted, key=lambda t: -t.host_bytes):
        if need <= room:
            break
        on_disk = _with_store(t.spec, "disk")
        keys = store_bytes_per_process(on_disk, t.strategy, plan.processes)[0]
        need -= t.host_bytes - keys
        out[t.name] = (
            f"host stores need {_fmt(plan.host_bytes)} per process > host_memory "
            f"{_fmt(room)}: store=ks.store.Disk(path) keeps this table's rows "
            f"({_fmt(t.host_bytes - keys)}) on local disk"
            + (f", its keys' index ({_fmt(keys)}) in host memory" if keys else "")
        )
    return out


def _with_store(spec, kind):
    import copy

    out = copy.copy(spec)
    out.store = kind
    return out


def _pct(part, whole):
    share = 100 * part / max(whole, 1)
    return f"{share:.0f}%" if share >= 1 else f"{share:.2g}%"


def fmt_bytes(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


_fmt = fmt_bytes
