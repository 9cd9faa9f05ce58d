"""Where hash-layer records go when they cannot keep their saved rows:
hottest first, one key at a time, and what a partial placement says."""

import numpy as np


def hottest_first(scores, n):
    """Indices by descending score (ties keep their order); ``arange(n)``
    without scores."""
    if scores is None:
        return np.arange(n)
    return np.argsort(-scores, kind="stable")


def greedy_rows(b1, b2, order, num_buckets, bucket_size, progress):
    """Rows in an empty table for keys with candidate buckets ``b1``/``b2``,
    placed one at a time in ``order``: each takes the lowest free slot of
    its less loaded bucket (ties: the first), or -1 when both are full.

    One key at a time, so a key is dropped only when both its buckets hold
    keys placed before it (hotter ones); rounds of vectorized claims could
    let a colder key take the last slot a hotter one needed.
    """
    load = [0] * num_buckets
    rows = [-1] * len(order)
    b1, b2 = b1.tolist(), b2.tolist()
    free = num_buckets * bucket_size
    # In chunks of keys, in the same order: the same rows, with progress.
    for part in progress.chunks(len(order)):
        for i in order[part].tolist():
            if not free:
                break
            bucket = b2[i] if load[b2[i]] < load[b1[i]] else b1[i]
            if load[bucket] < bucket_size:
                rows[i] = bucket * bucket_size + load[bucket]
                load[bucket] += 1
                free -= 1
    return np.asarray(rows, dtype=np.int64)


def import_drop_reason(layer, n, stored):
    """Why `import_` through the table's placement stored fewer than ``n``."""
    capacity = layer.table.capacity
    offered = min(n, capacity)
    parts = []
    if n > offered:
        parts.append(
            f"{n - offered} keys, the coldest by score (the last ones without "
            f"scores), exceed the capacity of {capacity} and were not offered."
        )
    if offered > stored:
        parts.append(
            f"{offered - stored} keys found both of their candidate buckets "
            f"({layer.table.bucket_size} rows each) full of keys imported "
            "by this call (hotter ones first)."
        )
    return " ".join(parts)


def load_drop_message(layer, saved_geometry, n, kept):
    """The warning of a load that could not place every saved key."""
    table = layer.table
    parts = [
        f"Layer '{layer.name}': {n - kept} of {n} saved keys were dropped on "
        f"load; {kept} were restored with their vectors, optimizer slots and "
        "scores."
    ]
    if n > table.capacity:
        parts.append(f"The table's capacity ({table.capacity}) is below {n}.")
    parts.append(
        f"A key can only use its two candidate buckets ({table.bucket_size} "
        "rows each); keys were placed hottest first (by score) and each "
        "dropped key found both of its buckets full of hotter keys."
    )
    if saved_geometry is None:
        parts.append("The checkpoint has no saved rows, so keys were re-placed.")
    else:
        parts.append(
            f"Saved from a table with (capacity, bucket_size, seed)="
            f"{saved_geometry}; this one has {layer._geometry()}."
        )
    return " ".join(parts)
