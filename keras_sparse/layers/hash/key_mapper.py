"""The key mapping's public interface: `KeyMapper` and its `MappedKeys`.

Every route that turns a hash layer's keys into rows implements `KeyMapper`
and returns one `MappedKeys`: the placements of
`keras_sparse.layers.hash.key_mapping` (eager host or GPU, compiled JAX
step, TensorFlow graph, serving map, shape inference) and the key-sharded
placements of `keras_sparse.sharding` (JAX, TensorFlow, PyTorch), which
are also the layer's `TablePlacement`. The table call on the host gives
one too, with the keys it evicted (`MappedKeys.of_table_call`); the row
store under the table (`keras_sparse.layers.row_tier.RowTier.record`)
plans its moves from it.
"""

from typing import NamedTuple
from typing import Protocol
from typing import runtime_checkable

import numpy as np


class MappedKeys(NamedTuple):
    """What a mapping of flat keys gives (a JAX pytree: None fields are
    empty).

    ``rows``: int32 ``[n]``, -1 where a key has none (absent, not admitted,
    or padding). ``fresh``: bool ``[n]``, True at the first position of
    each row newly assigned to a key (training only).

    Set by some routes only:

    - ``words``: int32 ``[n, 2]``, each key's two 32-bit halves, in
      training calls whose fresh rows are drawn per key
      (`keras_sparse.layers.hash.keyed_fresh_rows`);
    - ``init``: ``[n, dim]`` initial values of the fresh rows, drawn by the
      mapping itself (key sharding: on each key's owner);
    - ``keys``, ``evicted_keys``, ``evicted_rows``, ``evicted_scores``:
      host (NumPy) results of a training table call: its flat int64 keys,
      and the keys it evicted with the rows they left and their table
      scores (LRU step or LFU count) then;
    - ``exchange_slot``: int32 ``[n]``, each position's slot in a
      key-sharded row exchange (JAX key sharding: the key exchange's
      packing of each device's distinct keys, reused by the row lookup).
    """

    rows: object
    fresh: object
    words: object = None
    init: object = None
    keys: object = None
    evicted_keys: object = None
    evicted_rows: object = None
    evicted_scores: object = None
    exchange_slot: object = None

    @classmethod
    def of_table_call(cls, keys, rows, fresh, undo_record=None):
        """The host result of one table call: ``keys``/``rows``/``fresh``
        flat NumPy, and its evictions from ``undo_record`` (the call's
        `keras_sparse.table.undo.UndoRecord`; None: it evicted none)."""
        empty = np.zeros(0, np.int64)
        if undo_record is None:
            evicted = (empty, empty, empty)
        else:
            evicted = (
                np.asarray(undo_record.evicted_keys, np.int64),
                np.asarray(undo_record.evicted_rows, np.int64),
                np.asarray(undo_record.evicted_scores, np.int64),
            )
        return cls(rows, fresh, None, None, keys, *evicted)

    def drawn(self):
        """``{"words" | "init": ...}`` of the fields this mapping set, for
        drawing fresh rows (None when neither is set)."""
        out = {
            name: value
            for name, value in (("words", self.words), ("init", self.init))
            if value is not None
        }
        return out or None


@runtime_checkable
class KeyMapper(Protocol):
    """Where a hash layer's keys become rows (one route or placement).

    ``map_keys`` takes the layer, its ``keys`` (flat int64 for the
    key-sharded placements; any shape for the routes of
    `keras_sparse.layers.hash.key_mapping`), flat bool ``use`` (False:
    padding, never mapped), ``insert`` (training: admitted new keys get
    rows) and ``draw`` (the layer's ``keyed_draw()``, for mappings that
    draw fresh rows themselves; None: the route draws it when it needs
    one) and returns flat `MappedKeys`.
    """

    def map_keys(self, layer, keys, use, insert, draw=None) -> MappedKeys: ...


class UndoCollector:
    """Receives a table call's undo record (its evictions with their
    scores, for `MappedKeys.of_table_call`) and passes it on to the input
    stage's journal, if any."""

    def __init__(self, journal=None):
        self.record = None
        self._journal = journal

    def append(self, record):
        self.record = record
        if self._journal is not None:
            self._journal.append(record)

    def __getattr__(self, name):
        # The stage's journal may lend buffers (`buffer`); forward them.
        if name == "buffer" and self._journal is not None:
            return self._journal.buffer
        raise AttributeError(name)
