"""How a prefetch stage hands a hash layer its codes and segments in one array.

The stage (`keras_sparse.data.prefetch`) maps keys to int32 codes (see
`DistributedHashEmbedding._call_prepared`) and also numbers each position's
row among the batch's distinct rows (its *segment*), so the sparse update in
the step needs no sort. Both must reach the layer through the model's one
input for the keys, so they travel stacked along the batch axis: a batch of
``B`` samples becomes ``2B`` "samples", laid out per data-parallel replica
as ``[replicas, 2, B / replicas, ...]`` (codes then segments) and flattened,
so that splitting the batch axis over ``replicas`` devices gives each device
its own codes and segments with no exchange. The layer undoes the layout.

One model input may feed several hash layers; the stage then stacks every
layer's blocks (codes, or codes and segments) into that input the same way,
``[replicas, blocks, B / replicas, ...]``, and each layer takes its own
(`take_blocks`, ``PreparedForm.share``).
"""

import math
import sys
from dataclasses import dataclass

import numpy as np
from keras import ops

from keras_sparse.layers.hash.host_keys import host_keys
from keras_sparse.table.sharded_table import key_words


@dataclass(frozen=True)
class PreparedForm:
    """How an input stage lays out the int32 codes it feeds a hash layer.

    ``layout``: None (codes only) or ``(replicas, channel)``: a second
    block per position, its segment (``channel == "segments"``) or its slot
    in an `ExchangeBuckets` buffer (`unpack_prepared`). ``share``: None, or
    which of the input's blocks are this layer's when one model input feeds
    several hash layers (`take_blocks`). ``words``: 0, or the replicas two
    trailing blocks of key words are packed for (`split_words`).
    """

    layout: tuple = None
    share: tuple = None
    words: int = 0


# Segment key of positions without a row: sorts after every row.
_NO_ROW = np.iinfo(np.int32).max
# Largest table (rows) whose segments use a row-indexed scratch array.
SCRATCH_MAX_ROWS = 1 << 26


def rows_of_codes(codes):
    """Row of each prepared code (NumPy): ``-2 - code`` for fresh rows
    (``code <= -2``), the code itself otherwise (``-1``: no row)."""
    codes = np.asarray(codes)
    return np.where(codes <= -2, -2 - codes, codes)


def host_segments(codes, scratch=None, rows=None):
    """int32 segment of each position of ``codes`` (any shape), row-major.

    Positions with the same row share a segment, and so do positions without
    a row (code ``-1``); segments number them densely from 0. Without
    ``scratch`` they are numbered in ascending row order via ``np.unique``
    (a sort). With ``scratch`` (an int array longer than every row + 1,
    reused across calls, contents irrelevant) the numbering takes O(n)
    vectorized passes and no sort: each row's last position claims a scratch
    slot, every position reads its row's claimant, and claimants are numbered
    in position order. Any dense numbering gives the step the same result.
    ``rows``: `rows_of_codes` of ``codes`` when the caller has them.
    """
    codes = np.asarray(codes)
    rows = rows_of_codes(codes) if rows is None else np.asarray(rows)
    rows = rows.reshape(-1)
    if scratch is None:
        keys = np.where(rows >= 0, rows, _NO_ROW)
        _, inverse = np.unique(keys, return_inverse=True)
        return inverse.astype(np.int32).reshape(codes.shape)
    # Positions without a row (-1) claim the scratch's last slot, which no
    # row uses (Python's negative indexing).
    positions = np.arange(rows.shape[0], dtype=scratch.dtype)
    scratch[rows] = positions  # duplicates: one position wins per row
    claimant = scratch.take(rows)
    is_claimant = claimant == positions
    number = np.cumsum(is_claimant, dtype=np.int32)
    number -= 1
    return number.take(claimant).reshape(codes.shape)


def segment_scratch(num_rows):
    """A scratch array for `host_segments`, or None for very large tables."""
    if num_rows > SCRATCH_MAX_ROWS:
        return None
    return np.empty(num_rows + 2, np.int32)


def pack_blocks(arrays, replicas):
    """``[k B, ...]`` array holding the ``k`` ``arrays`` (each ``[B, ...]``;
    a `KeyWords` item stands for its two blocks).

    Laid out per data-parallel replica as ``[replicas, k, B / replicas, ...]``
    and flattened, so that each replica's share of the batch axis holds its
    samples of every array.
    """
    return pack_groups([(arrays, replicas)])[0]


# Offsets of the packed arrays inside their common allocation: cache lines.
_ALIGN = 64


def pack_groups(groups):
    """`pack_blocks` of each ``(arrays, replicas)`` in ``groups``, as views
    of one allocation: a batch's arrays are new memory, which the OS maps a
    page at a time on first write (a fault per 4 KiB, about as costly as
    the copy), and one large allocation takes fewer, larger pages."""
    plans, total = [], 0
    for arrays, replicas in groups:
        items = [a if isinstance(a, KeyWords) else np.asarray(a) for a in arrays]
        b, rest = items[0].shape[0], items[0].shape[1:]
        if b % replicas:
            raise ValueError(
                f"prefetch: a batch of {b} samples does not split evenly over "
                f"{replicas} data-parallel replicas."
            )
        dtypes = [np.int32 if isinstance(a, KeyWords) else a.dtype for a in items]
        dtype = np.result_type(*dtypes)
        count = sum(2 if isinstance(a, KeyWords) else 1 for a in items)
        shape = (replicas, count, b // replicas) + rest
        size = math.prod(shape) * dtype.itemsize
        plans.append((items, shape, dtype, total, size))
        total += -(-size // _ALIGN) * _ALIGN
    memory = np.empty(total + _ALIGN, np.uint8)
    skip = -memory.ctypes.data % _ALIGN
    out = []
    for items, shape, dtype, offset, size in plans:
        at = skip + offset
        packed = memory[at : at + size].view(dtype).reshape(shape)
        # Each block is written once, in place (no per-block temporaries).
        i = 0
        for a in items:
            if isinstance(a, KeyWords):
                a.fill(packed[:, i], packed[:, i + 1])
                i += 2
            else:
                packed[:, i] = a.reshape(shape[:1] + shape[2:])
                i += 1
        out.append(packed.reshape((shape[1] * shape[0] * shape[2],) + shape[3:]))
    return out


def pack_prepared(codes, segments, replicas):
    """``[2B, ...]`` array holding ``codes`` and ``segments`` (both ``[B, ...]``)."""
    return pack_blocks([codes, segments], replicas)


def take_blocks(x, replicas, start, count, blocks):
    """Blocks ``start : start + count`` of a `pack_blocks` array of
    ``blocks`` blocks (a tensor), laid out as `pack_blocks` would lay out
    those blocks alone.

    Several hash layers reading one model input each take their own blocks
    (codes, or codes and segments) of the array the stage packed for them.
    """
    rest = _rest_shape(x)
    per_replica = ops.reshape(x, (replicas, blocks, -1) + rest)
    return ops.reshape(per_replica[:, start : start + count], (-1,) + rest)


def unpack_prepared(x, replicas):
    """``(codes, segments)`` from `pack_prepared`'s array (a tensor)."""
    rest = _rest_shape(x)
    both = ops.reshape(x, (replicas, 2, -1) + rest)
    codes = ops.reshape(both[:, 0], (-1,) + rest)
    segments = ops.reshape(both[:, 1], (-1,) + rest)
    return codes, segments


class KeyWords:
    """The two blocks of key words a stage adds for a layer drawing fresh
    rows per key: the ``(high, low)`` int32 words of the int64 keys that
    `host_keys` makes of host ``keys`` (the keys' shape), as
    `keras_sparse.table.sharded_table.key_words` splits them. `pack_blocks`
    has them written straight into the packed array."""

    shape = property(lambda self: self.keys.shape)

    def __init__(self, keys):
        self.keys = np.asarray(keys)

    def fill(self, high, low):
        """Writes the words into ``high`` and ``low`` (int32 arrays of
        ``[replicas, B / replicas, ...]``)."""
        keys = self.keys
        kind, size = keys.dtype.kind, keys.dtype.itemsize
        if kind in "iu" and size <= 4:
            # Narrow integers: the low word is the value (uint32: its bits),
            # the high word its sign.
            np.copyto(low, keys.reshape(low.shape), casting="unsafe")
            if kind == "i":
                np.right_shift(low, 31, out=high)
            else:
                high.fill(0)
            return
        # Contiguous int64 (a copy only where it is not).
        flat = keys if keys.dtype == np.int64 else host_keys(keys)
        flat = np.ascontiguousarray(flat).reshape(-1)
        if sys.byteorder != "little":
            words = key_words(flat)
            np.copyto(high, words[:, 0].reshape(high.shape))
            np.copyto(low, words[:, 1].reshape(low.shape))
            return
        # int64 as (low, high) int32 pairs in memory: two strided copies.
        pairs = flat.view(np.int32).reshape(-1, 2)
        np.copyto(low, pairs[:, 0].reshape(low.shape))
        np.copyto(high, pairs[:, 1].reshape(high.shape))


def split_words(x, replicas, blocks):
    """``(rest, words)`` of a tensor whose last two of ``blocks`` blocks
    (see `pack_blocks`) are key words: the other blocks as they would be
    packed alone, and int32 ``[n, 2]`` (high, low word per position)."""
    rest = _rest_shape(x)
    per_replica = ops.reshape(x, (replicas, blocks, -1) + rest)
    high = ops.reshape(per_replica[:, blocks - 2], (-1,))
    low = ops.reshape(per_replica[:, blocks - 1], (-1,))
    others = ops.reshape(per_replica[:, : blocks - 2], (-1,) + rest)
    return others, ops.stack([high, low], axis=-1)


def _rest_shape(x):
    """The shape of ``x`` after the batch axis (dynamic where unknown)."""
    rest = tuple(x.shape[1:])
    if None in rest:
        rest = tuple(ops.shape(x)[1:])
    return rest
