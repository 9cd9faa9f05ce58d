"""What each device hands to collectives per step: from the buffer shapes
of the sharded lookups (`exchange_bytes`), and read back from a compiled
step's HLO (`hlo_collective_bytes`) to check them.
"""

import re

from keras_sparse.sharding.jax_row_buffers import row_capacity
from keras_sparse.sharding.jax_sharded_lookup import ROUTED_STRATEGIES


def exchange_bytes(
    strategy,
    num_rows,
    dim,
    num_ids,
    num_devices,
    training=True,
    dtype_bytes=4,
    id_bytes=4,
    slack=None,
    reset=False,
    capacity=None,
    reset_capacity=None,
):
    """Bytes one device hands to collectives per step, from the buffer shapes.

    Args:
        num_ids: ids of this table in the global batch (``n = num_ids / D``
            per device).
        slack: the row exchange slack (`row_capacity`); None: full buffers.
            The bytes are those of the static buffers: they do not depend
            on the ids (each device's distinct ids fill the slots, see
            `exchange_buckets.bucket_fill` for the smallest fitting size).
        reset: count the fresh-row reset of a `DistributedHashEmbedding`
            (`sharded_reset`: every training step, row and column only).
        capacity: row slots per destination, instead of the slack's (e.g.
            the largest `bucket_fill` of a workload).
        reset_capacity: row only: the reset's slots per destination when it
            sends only the fresh rows (a key-sharded layer's key exchange,
            `jax_sharded_reset.compact_reset_capacity`); None, or not below
            the ids per device: gathered.

    Returns:
        dict with ``ids``, ``vectors``, ``grads``, ``reset``, ``total``
        (buffer bytes, including each device's block to itself) and
        ``remote`` (the part that actually leaves the device).
    """
    d = num_devices
    n = num_ids // d
    resets = 0
    if reset and training:
        if strategy not in ROUTED_STRATEGIES:
            raise ValueError(f"resets are counted for {ROUTED_STRATEGIES} only")
        # Row: all-gathered (id, flag, value). Column: the flags all-gathered
        # (the lookup's all-gather of the same ids is reused) and each device's
        # columns of the values sent by all_to_all.
        gathered = n * (1 + (id_bytes if strategy == "row" else 0))
        values = n * dim * dtype_bytes
        resets = gathered + values
        share = d - 1 if strategy == "row" else (d - 1) / d
        remote_resets = (d - 1) * gathered + values * share
        if strategy == "row" and reset_capacity is not None and reset_capacity < n:
            # [D, C] local rows and [D, C, dim] values, all_to_all to owners.
            resets = d * int(reset_capacity) * (id_bytes + dim * dtype_bytes)
            remote_resets = resets * (d - 1) / d
    if strategy == "row":
        c = row_capacity(n, d, slack) if capacity is None else min(int(capacity), n)
        ids = d * c * id_bytes  # [D, C] int32 all_to_all
        vectors = d * c * dim * dtype_bytes  # [D, C, dim] all_to_all back
        grads = vectors if training else 0  # [D, C, dim] all_to_all to owners
        if c < n:  # the overflow check: a pmax of one int32
            ids += id_bytes
        remote = (ids + vectors + grads) * (d - 1) / d
    elif strategy == "column":
        ids = n * (id_bytes + 1)  # all_gather of [n] ids and [n] bool valid
        vectors = d * n * (dim // d) * dtype_bytes  # [D, n, dim/D] all_to_all
        grads = vectors if training else 0
        remote = ids * (d - 1) + (vectors + grads) * (d - 1) / d
    elif strategy == "data":
        # The single-device primitive partitioned by XLA (jax 0.10, CPU): an
        # all-gather of the local ids, then an all-reduce of the zero-padded
        # global [N, dim] row gradients.
        big = n * d
        ids = n * id_bytes if training else 0
        vectors = 0
        grads = big * dim * dtype_bytes if training else 0
        remote = n * id_bytes * (d - 1) + 2 * grads * (d - 1) / d
    elif strategy == "table":
        ids = d * n * id_bytes
        vectors = d * n * dim * dtype_bytes
        grads = vectors if training else 0
        remote = (ids + vectors + grads) * (d - 1) / d
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    total = ids + vectors + grads + resets
    if resets:
        remote += remote_resets
    return {
        "ids": int(ids),
        "vectors": int(vectors),
        "grads": int(grads),
        "reset": int(resets),
        "total": int(total),
        "remote": int(round(remote)),
    }


def table_all_gather_bytes(num_rows, dim, num_devices, dtype_bytes=4):
    """Bytes per device of the naive alternative: all-gathering the table."""
    return int(num_rows * dim * dtype_bytes // num_devices)


_HLO_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_HLO_COLLECTIVE = re.compile(
    r"=\s*(?P<shapes>\(.*?\)|\S+)\s+(?P<op>all-to-all|all-gather|all-reduce|"
    r"reduce-scatter|collective-permute)(?:-start)?\("
)
_HLO_SHAPE = re.compile(r"\b([a-z]+\d*|pred)\[([\d,]*)\]")


def hlo_collective_bytes(hlo_text, num_devices):
    """Bytes each device hands to collectives in a compiled (per-device) HLO.

    Counts the input size of every all-to-all / all-gather / all-reduce /
    reduce-scatter / collective-permute (an all-gather's input is its output
    over the group size). Returns ``{op: bytes}`` plus ``"total"``.
    """
    out = {}
    for line in hlo_text.splitlines():
        m = _HLO_COLLECTIVE.search(line)
        if not m:
            continue
        size = 0
        for dtype, dims in _HLO_SHAPE.findall(m.group("shapes")):
            if dtype not in _HLO_DTYPE_BYTES:
                continue
            count = 1
            for dim in filter(None, dims.split(",")):
                count *= int(dim)
            size += count * _HLO_DTYPE_BYTES[dtype]
        if m.group("op") == "all-gather":
            size //= num_devices
        out[m.group("op")] = out.get(m.group("op"), 0) + size
    out["total"] = sum(out.values())
    return out
