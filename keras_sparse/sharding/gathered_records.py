"""One checkpoint from the hash records of several processes or workers."""

import numpy as np


def merge_records(parts):
    """``(records, admission, clock)`` of a whole key-sharded layer from each
    holder's ``(records, admission, clock)`` (in holder order): records
    concatenated per name, pending admission counts sorted by key (None
    without admission), and the latest LRU clock."""
    first = parts[0]
    merged = {
        name: np.concatenate([np.asarray(p[0][name]) for p in parts])
        for name in first[0]
    }
    pending = None
    if first[1] is not None:
        keys = np.concatenate([p[1][0] for p in parts])
        counts = np.concatenate([p[1][1] for p in parts])
        order = np.argsort(keys, kind="stable")
        pending = keys[order], counts[order]
    return merged, pending, max(p[2] for p in parts)
