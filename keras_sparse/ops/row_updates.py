"""Backend-neutral half of the sparse update: dedup, sum, optimizer math.

Written with keras.ops so the same code runs inside a JAX custom_vjp, a
TensorFlow custom_gradient and a PyTorch autograd.Function. Shapes stay
static (``N`` = number of looked-up ids) so XLA can compile it.
"""

import keras
from keras import ops

from keras_sparse.ops import count_buckets
from keras_sparse.ops import take_rows
from keras_sparse.ops.row_rounding import to_compute

SEGMENT_ALGORITHMS = ("search", "argsort", "packed")
# None: pick per backend, device and size (see `segment_algorithm`); one of
# SEGMENT_ALGORITHMS forces it (tests compare them on any machine).
FORCE_SEGMENT_ALGORITHM = None


def _bit_length(value):
    return max(1, int(value).bit_length())


def _packed_dtype():
    # JAX sorts and shifts uint32 natively; TensorFlow and PyTorch get a
    # non-negative int32 (one bit less).
    return "uint32" if keras.backend.backend() == "jax" else "int32"


def packs_into_word(n, num_rows, bits=None):
    """Whether ``(id << position_bits) | position`` fits the packed dtype.

    Ids run up to ``num_rows`` (the sentinel of invalid positions) and
    positions up to ``n - 1``; ``bits`` defaults to 32 on JAX (uint32),
    else 31 (non-negative int32).
    """
    if bits is None:
        bits = 32 if _packed_dtype() == "uint32" else 31
    return _bit_length(num_rows) + _bit_length(n - 1) <= bits


def segment_algorithm(n, num_rows):
    """How `find_segments` finds each position's segment.

    - ``"packed"`` (JAX on CPU, when ``id`` and position pack into 32
      bits): one sort of ``id << bits | position`` gives the order and the
      segments at once. XLA:CPU sorts with a comparator call per comparison,
      so one single-operand sort is ~2x faster than the search below and ~8x
      faster than a (key, position) argsort (26 x 16K ids: 12 vs 22-27 vs
      93 ms).
    - ``"search"``: sort the ids alone, find each position's segment by
      binary search. XLA lowers ``searchsorted`` to ``log2(n)`` dependent
      passes: fine on CPU, a chain of small kernel launches on a GPU.
      TensorFlow and PyTorch (native search kernels) use it everywhere.
    - ``"argsort"`` (JAX on accelerators): a (key, position) sort, ~3x
      faster than the search on a GPU (26 x 16K ids on an H100: 2.9 ms vs
      8.8 ms).
    """
    if FORCE_SEGMENT_ALGORITHM is not None:
        return FORCE_SEGMENT_ALGORITHM
    if keras.backend.backend() != "jax":
        return "search"
    import jax

    if jax.default_backend() != "cpu":
        return "argsort"
    return "packed" if packs_into_word(n, num_rows) else "search"


class Segments:
    """The distinct ids of a batch and each position's index among them.

    ``unique_ids``: ``[n]``, the first ``num_unique`` entries the distinct
    keys in ascending order (invalid positions share the key ``num_rows``,
    last), the rest ``num_rows``. ``position``: ``[n]`` segment of each
    position.
    """

    def __init__(self, unique_ids, num_unique, position):
        self.unique_ids = unique_ids
        self.num_unique = num_unique
        self.position = position


def find_segments(ids, valid, num_rows):
    """`Segments` of ``ids`` (``[n]``; invalid positions get ``num_rows``)."""
    n = ids.shape[0]
    keys = ops.where(valid, ops.cast(ids, "int32"), num_rows)
    known = n is not None
    algorithm = segment_algorithm(n if known else 2**31 - 1, num_rows)
    if algorithm == "packed" and not (known and packs_into_word(n, num_rows)):
        algorithm = "search"
    if not known:
        n = ops.shape(ids)[0]
    order = None
    if algorithm == "packed":
        bits, word = _bit_length(n - 1), _packed_dtype()
        packed = ops.left_shift(ops.cast(keys, word), bits)
        packed = ops.sort(ops.bitwise_or(packed, ops.arange(n, dtype=word)))
        sorted_keys = ops.cast(ops.right_shift(packed, bits), "int32")
        order = ops.cast(ops.bitwise_and(packed, (1 << bits) - 1), "int32")
    elif algorithm == "argsort":
        order = ops.cast(ops.argsort(keys), "int32")
        sorted_keys = ops.take(keys, order)
    else:
        sorted_keys = ops.sort(keys)
    is_start = ops.concatenate(
        [ops.ones((1,), "bool"), ops.not_equal(sorted_keys[1:], sorted_keys[:-1])]
    )
    segment = ops.cumsum(ops.cast(is_start, "int32")) - 1
    unique_ids = ops.scatter_update(
        ops.full((n,), num_rows, "int32"), ops.expand_dims(segment, -1), sorted_keys
    )
    if order is not None:
        position = ops.scatter_update(
            ops.zeros((n,), "int32"), ops.expand_dims(order, -1), segment
        )
    else:
        position = ops.cast(ops.searchsorted(unique_ids, keys, side="left"), "int32")
    return Segments(unique_ids, segment[-1] + 1, position)


def segments_from_positions(ids, valid, num_rows, position):
    """`Segments` from a given segment index per position (no sort).

    ``position`` must number the distinct keys (``ids`` where ``valid``,
    else the shared key ``num_rows``) densely from 0, any order: the input
    stage computes it on the host (`keras_sparse.data.prefetch`). The
    unique ids then follow by one scatter, in that numbering.
    """
    n = ids.shape[0]
    if n is None:
        n = ops.shape(ids)[0]
    keys = ops.where(valid, ops.cast(ids, "int32"), num_rows)
    position = ops.cast(position, "int32")
    unique_ids = ops.scatter_update(
        ops.full((n,), num_rows, "int32"), ops.expand_dims(position, -1), keys
    )
    return Segments(unique_ids, ops.max(position) + 1, position)


def scratch_keys(ids, valid, num_rows):
    """The keys `scratch_segments` writes: ``ids`` where valid, else ``num_rows``."""
    return ops.where(valid, ops.cast(ids, "int32"), num_rows)


def scratch_segments(scratch, ids, valid, num_rows):
    """Segments by a scratch array instead of a sort: ``(scratch, position)``.

    ``scratch``: ``[num_rows + 1]`` int32 whose contents do not matter; each
    position writes its index at its key's entry (`scratch_keys`) and reads
    the entry back, so the positions of one key agree on one of them (the
    last writer). Numbering those representatives in order gives
    ``position``, a dense numbering of the distinct keys as
    `segments_from_positions` takes it. Two O(n) passes where a sort costs
    O(n log n): ~3x faster on XLA:CPU for 16K ids. Every entry read was
    written first, so what the scratch holds between steps does not matter;
    it is not cleared after the read, because XLA would keep the written
    scratch for the read and copy the whole (table-sized) array to clear it
    (26 tables of 1e6 rows: ~10 ms per step). Returns the scratch to keep
    (its buffer updates in place when the caller's state is donated) and
    the segments.
    """
    keys = ops.expand_dims(scratch_keys(ids, valid, num_rows), -1)
    position = ops.arange(ids.shape[0], dtype="int32")
    written = ops.scatter_update(scratch, keys, position)
    representative = take_rows(written, keys[:, 0])
    return written, number_representatives(representative)


def number_representatives(representative):
    """Dense segment numbers from each position's representative position."""
    position = ops.arange(representative.shape[0], dtype="int32")
    is_first = ops.equal(representative, position)
    numbering = ops.cumsum(ops.cast(is_first, "int32")) - 1
    return take_rows(numbering, representative)


def dedup_and_sum(ids, valid, grads, num_rows):
    """Sums the gradients of duplicate ids (exact, not Hogwild).

    Args:
        ids: ``[N]`` int row ids.
        valid: ``[N]`` bool, False for padding and out-of-range ids.
        grads: ``[N, D]`` gradient of each looked-up vector.
        num_rows: table rows; used as the "no row" sentinel.

    Returns:
        ``(unique_ids, is_real, summed)``: ``[N]`` ids where the first
        ``num_unique`` entries are the distinct valid ids, ``[N]`` bool marking
        those entries, and ``[N, D]`` their summed gradients (zeros elsewhere).
    """
    seg = find_segments(ids, valid, num_rows)
    n = ops.shape(ids)[0]
    summed = ops.segment_sum(grads, seg.position, num_segments=n)
    is_real = ops.logical_and(
        ops.arange(n, dtype="int32") < seg.num_unique, seg.unique_ids < num_rows
    )
    return seg.unique_ids, is_real, summed


def _pad_rows(x, n, fill):
    """``x`` (``[m, ...]``) extended to ``n`` rows of ``fill``."""
    missing = n - ops.shape(x)[0]
    if isinstance(missing, int) and missing == 0:
        return x
    pad = ops.full((missing,) + tuple(x.shape[1:]), fill, x.dtype)
    return ops.concatenate([x, pad], axis=0)


def compute_row_updates(
    optimizer,
    gather,
    slot_names,
    ids,
    valid,
    grads,
    iterations,
    num_rows,
    constraint=None,
    segments=None,
    looked_up=None,
):
    """New values of the touched rows and of their optimizer slots.

    The gradient sums, the row and slot gathers and the optimizer math run on
    the smallest of ``n/32, n/8, n/2, n`` rows that holds the batch's
    distinct ids (`keras_sparse.ops.count_buckets`; always ``n`` rows on
    accelerators, under a JAX distribution and for fewer than 8192 ids); the
    results are padded back to ``n`` entries.

    Args:
        optimizer: a `keras_sparse.optimizers.SparseOptimizer`.
        gather: ``gather(name, row_ids) -> values``; name is ``"table"`` or a
            slot name. Ids are always in range.
        slot_names: names of the optimizer slots.
        ids, valid, grads, num_rows: see `dedup_and_sum`.
        iterations: updates applied before this one.
        constraint: optional callable applied to the new rows.
        segments: optional ``[N]`` segment index of each position, computed
            ahead of the step (see `segments_from_positions`); skips the sort.
        looked_up: optional ``[N, dim]`` table rows of each position as the
            forward pass gathered them (any values where not ``valid``); the
            touched rows are then read from it instead of from the table.

    Returns:
        ``(unique_ids, is_real, new_values)`` where new_values maps "table" and
        each slot name to ``[N, width]`` arrays aligned with ``unique_ids``.
    """
    if segments is None:
        seg = find_segments(ids, valid, num_rows)
    else:
        seg = segments_from_positions(ids, valid, num_rows, segments)
    n = ids.shape[0]
    if n is None:
        n = ops.shape(ids)[0]
    if looked_up is not None:
        # One position of each segment (equal ids: any one will do).
        holder = ops.scatter_update(
            ops.zeros((n,), "int32"),
            ops.expand_dims(seg.position, -1),
            ops.arange(n, dtype="int32"),
        )

    def branch(size):
        def update():
            summed = ops.segment_sum(grads, seg.position, num_segments=size)
            unique_ids = seg.unique_ids[:size]
            is_real = ops.logical_and(
                ops.arange(size, dtype="int32") < seg.num_unique,
                unique_ids < num_rows,
            )
            safe_ids = ops.where(is_real, unique_ids, 0)
            if looked_up is None:
                rows = to_compute(gather("table", safe_ids))
            elif constraint is None:
                rows = take_rows(looked_up, holder[:size])
            else:
                # Unused entries hold row 0, as the gather gives them: a
                # constraint may see every entry (``MaxNorm(axis=0)``).
                rows = ops.where(
                    ops.expand_dims(is_real, -1),
                    take_rows(looked_up, holder[:size]),
                    to_compute(gather("table", ops.zeros((1,), "int32"))),
                )
            # The optimizer's math runs in float32 for 16-bit arrays too.
            slots = {name: to_compute(gather(name, safe_ids)) for name in slot_names}
            new_rows, new_slots = optimizer.update(rows, slots, summed, iterations)
            if constraint is not None:
                new_rows = constraint(new_rows)
            values = {"table": new_rows, **new_slots}
            return (
                _pad_rows(unique_ids, n, num_rows),
                _pad_rows(is_real, n, False),
                {name: _pad_rows(v, n, 0) for name, v in values.items()},
            )

        return update

    return count_buckets.switch_on_count(
        seg.num_unique,
        count_buckets.bucket_sizes(n),
        branch,
        count_buckets.sized_by_count(under_distribution=False, n=n),
    )


def fill_unused_entries(unique_ids, is_real, new_values, old_first):
    """Makes a scatter with no out-of-range index that changes only real rows.

    Backends whose scatters reject out-of-range indices (TensorFlow, PyTorch)
    write the unused entries onto the first entry's row with the same value,
    so duplicate writes agree. If no entry is real, they rewrite row 0 with
    its old value (``old_first``, a dict like ``new_values`` holding row 0).
    """
    any_real = is_real[0]
    target = ops.where(any_real, unique_ids[0], 0)
    indices = ops.where(is_real, unique_ids, target)
    filled = {}
    for name, values in new_values.items():
        first = ops.where(any_real, values[0], to_compute(old_first[name][0]))
        filled[name] = ops.where(ops.expand_dims(is_real, -1), values, first[None])
    return indices, filled


class TableBlocks:
    """Where each table of a stacked variable sits: its positions and rows.

    A collection's stack holds several tables in one variable; updating
    them one by one keeps each table's rows (not the whole stack's) in the
    CPU caches while its duplicates are summed and its rows rewritten (26
    tables of 1e5 rows on torch: 2.2x faster than one update over the
    stack). The eager (PyTorch) and graph (TensorFlow without XLA) updates
    use it; under XLA the per-table writes into one variable would run one
    after another, so JAX updates a stack at once.

    Args:
        batch_major: positions form ``[batch, sum(extents)]`` (each table
            its ``extents[t]`` columns); else tables follow one another
            (``extents[t]`` positions each).
        extents: per table, its columns (batch-major) or positions.
        row_ranges: per table, ``(first, end)`` rows of the stack.
    """

    def __init__(self, batch_major, extents, row_ranges):
        self.batch_major = bool(batch_major)
        self.extents = tuple(int(e) for e in extents)
        self.row_ranges = tuple((int(a), int(b)) for a, b in row_ranges)

    def parts(self, x):
        """Each table's share of ``x`` (``[N, ...]`` in position order)."""
        tail = tuple(x.shape[1:])
        if self.batch_major:
            x = ops.reshape(x, (-1, sum(self.extents)) + tail)
        out, start = [], 0
        for extent in self.extents:
            part = slice(start, start + extent)
            start += extent
            out.append(ops.reshape(x[:, part], (-1,) + tail) if self.batch_major
                       else x[part])  # fmt: skip
        return out

    def split(self, ids, valid, grads):
        """Yields ``(ids, valid, grads, first_row, end_row)`` per table,
        ids relative to the table's first row."""
        for table_ids, table_valid, table_grads, (first, end) in zip(
            self.parts(ids), self.parts(valid), self.parts(grads), self.row_ranges
        ):
            yield table_ids - first, table_valid, table_grads, first, end
