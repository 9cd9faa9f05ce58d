"""What a prefetch stage's look-ahead did to each hash table, for checkpoints.

The stage maps batches into the hash tables before their training steps run
(`keras_sparse.data.prefetch`), so at any moment a table holds the inserts,
evictions, score and clock updates and admission counts of a few batches
that are not trained yet. A checkpoint (or ``layer.export()``) taken then,
e.g. by ``keras.callbacks.ModelCheckpoint(save_freq=N)``, must show the
table as of the last trained step, as the same run without the stage would.

Each table call of the stage records what it overwrote
(`keras_sparse.table.undo.UndoRecord`, appended under the table's lock, so a
save sees the table and its records together): a `Journal` per table and
pass keeps them tagged with their batch. The layer asks for the records of
the batches its step counter says are not trained yet (`Lookahead`), and the
table computes its state before them. That costs the call a copy of the
found rows and their scores, plus the evicted keys' scores; nothing is
copied at a save beyond what ``export`` copies. The arrays of the found rows
and scores are recycled from dropped records (`RecordBuffers`): memory new
to the process costs a page fault per 4 KiB, more than the copies
themselves.
"""

import collections
import threading
import weakref

import numpy as np

# Batches whose records are kept after they were handed to Keras: Keras'
# own prefetching (tf.data's on TensorFlow) may hold a few untrained; a save
# that needs records already dropped raises rather than writing a wrong
# table. A record holds about two int64 per key of its batch.
KEEP_SERVED = 16
# Spare record arrays kept per table: about the records a pass holds at once
# (the batches kept after serving, plus those prepared ahead).
_SPARES = 2 * KEEP_SERVED


class RecordBuffers:
    """int64 ``[2, n]`` arrays for the found rows and scores of one table's
    undo records (``log.buffer``, see `keras_sparse.table.undo`), taken
    back from the records a `Journal` drops. Shared by the table's journals
    of every pass of a stage."""

    def __init__(self):
        self._lock = threading.Lock()
        self._spare = []

    def take(self, n):
        """A spare array of at least ``n`` columns, else a new one."""
        with self._lock:
            for i in range(len(self._spare) - 1, -1, -1):
                if self._spare[i].shape[1] >= n:
                    return self._spare.pop(i)
        return np.empty((2, n), np.int64)

    def give(self, records):
        """Takes back the arrays of dropped ``records``: no one reads them
        again (saves read records under the table's lock, which the calls
        that reuse them hold too)."""
        with self._lock:
            for r in records:
                if r.buffer is not None and len(self._spare) < _SPARES:
                    self._spare.append(r.buffer)


class Journal:
    """Undo records of one table's calls in one pass, tagged with their
    batch. A table's calls are serialized (one lane), so the caller sets
    ``seq`` before each call and the table `append`s under its lock."""

    def __init__(self, buffers=None):
        self.seq = 0
        self._lock = threading.Lock()
        self._records = collections.deque()  # (seq, UndoRecord), call order
        self._floor = 0  # records of batches below are dropped
        self._buffers = RecordBuffers() if buffers is None else buffers

    def append(self, record):
        with self._lock:
            self._records.append((self.seq, record))

    def buffer(self, n):
        """An array for a call's record (see `RecordBuffers`)."""
        return self._buffers.take(n)

    def _drop_below(self, below):
        """Drops the records of batches before ``below`` (lock held)."""
        dropped = []
        while self._records and self._records[0][0] < below:
            dropped.append(self._records.popleft()[1])
        self._buffers.give(dropped)

    def trim(self, below):
        """Drops the records of batches before ``below``."""
        with self._lock:
            self._floor = max(self._floor, below)
            self._drop_below(below)

    def release(self):
        """Drops every record: the pass is over (every batch it served
        trained, or the stage rolled the untrained ones back)."""
        with self._lock:
            self._drop_below(float("inf"))

    def newest(self, count):
        """Records of the last ``count`` calls, in call order (None when
        fewer are kept)."""
        with self._lock:
            if count > len(self._records):
                return None
            records = list(self._records)
            return [r for _, r in records[len(records) - count :]]

    def since(self, first, name):
        """Records of batches ``first`` on, in call order (``name``: the
        layer, for the error)."""
        with self._lock:
            if first < self._floor:
                raise RuntimeError(
                    f"Layer '{name}': cannot save the hash table as of its last "
                    f"trained step: batch {first} of the prefetch stage's pass "
                    f"is not trained yet, but the stage kept the look-ahead "
                    f"records of batches {self._floor} on only (Keras fetched "
                    f"more than {KEEP_SERVED} batches ahead of training). "
                    "Nothing was saved."
                )
            # Batches before ``first`` are trained: their records are not
            # needed again (the count only grows within a pass).
            self._drop_below(first)
            self._floor = max(self._floor, first)
            return [r for _, r in self._records]


class Lookahead:
    """``layer.stage_lookahead``: ``(layer, trained steps) -> undo records`` of
    the calls its table got for batches not trained yet (see
    `keras_sparse.layers.hash.record_export`). Holds its engine and the model the
    stage feeds weakly."""

    def __init__(self, engine, model=None):
        self._engine = weakref.ref(engine)
        self._model = (lambda: None) if model is None else weakref.ref(model)

    def sync(self):
        """Re-attaches the model's variables, which a JAX ``fit`` keeps in
        its loop mid-epoch (Keras does the same for a callback's
        ``self.model``): a save or read-only call of the layer from a
        callback then reads the trained values."""
        sync = getattr(self._model(), "jax_state_sync", None)
        if sync is not None:
            sync()

    def __call__(self, layer, done):
        engine = self._engine()
        p = None if engine is None else engine._pass
        if p is None:
            return []
        return p.untrained_calls(layer, done)


def install(engine, layers, model=None):
    """Sets ``stage_lookahead`` on the hash layers a training stage maps for
    ``model``."""
    hook = Lookahead(engine, model)
    for layer in layers:
        layer.stage_lookahead = hook


def remove(engine, layers):
    """Clears the hooks `install` set for ``engine`` (not another stage's)."""
    for layer in layers:
        hook = layer.stage_lookahead
        if isinstance(hook, Lookahead) and hook._engine() in (engine, None):
            layer.stage_lookahead = None
