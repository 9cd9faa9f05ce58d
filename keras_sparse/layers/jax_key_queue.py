"""Full 64-bit keys queued per layer for its host mapping (JAX without x64).

The input side (`keras_sparse.layers.jax_full_keys`) pushes each batch's
full int64 keys onto a queue per hash layer; the layer's host mapping takes
them back here (`restore`), checking that their low 32 bits equal what the
compiled step received. A direct ``model(x)`` call queues into queues of its
own (`CALL_QUEUES`), so concurrent calls never see each other's keys.
"""

import collections
import contextvars
import threading

import numpy as np


class KeyMismatchError(RuntimeError):
    """The keys a step received do not match the queued full keys."""


#: Batches of full keys one layer keeps queued at most (oldest dropped).
MAX_QUEUED_BATCHES = 64


class KeyQueue:
    """Full-width host keys of the batches a layer has not mapped yet.

    Appended by the input pipeline (main thread), taken by the layer's host
    mapping (a JAX runtime thread), hence the lock.
    """

    def __init__(self):
        self._items = collections.deque()
        self._parts = {}  # id(entry) -> parts already taken (`take_part`)
        self._lock = threading.Lock()

    def __len__(self):
        return len(self._items)

    def append(self, keys):
        with self._lock:
            self._items.append(keys)
            # A layer whose rows reach no result of the step is pruned from
            # it and never takes its batches: keep the memory bounded. The
            # steps of a running fit take theirs within a batch or two, and
            # a step whose batch was dropped raises KeyMismatchError.
            while len(self._items) > MAX_QUEUED_BATCHES:
                self._parts.pop(id(self._items.popleft()), None)

    def clear(self):
        with self._lock:
            self._items.clear()
            self._parts.clear()

    def head(self):
        """The oldest entry, or None; it stays queued (see `remove`)."""
        with self._lock:
            return self._items[0] if self._items else None

    def remove(self, entry):
        """Removes ``entry`` (an object `head` returned) if still queued."""
        with self._lock:
            for i, item in enumerate(self._items):
                if item is entry:
                    del self._items[i]
                    return

    def take_match(self, keys, xp=np):
        """Removes and returns the oldest entry whose low 32 bits are ``keys``'.

        Usually the head. Entries before it stay: they belong to batches of
        another iterator still to run (e.g. a training look-ahead batch queued
        before the validation batches of the same epoch). With ``xp=cupy``
        ``keys`` are device keys: each candidate is copied to the device and
        compared there (the step's keys never come to the host), and the
        match is returned as a device array.
        """
        low = keys.astype(xp.int32)
        with self._lock:
            for i, full in enumerate(self._items):
                if full.shape != low.shape:
                    continue
                candidate = full if xp is np else xp.asarray(full)
                if bool((candidate.astype(xp.int32) == low).all()):
                    del self._items[i]
                    return candidate
        return None

    def take_part(self, keys, part, parts):
        """The full keys of ``part`` of ``parts`` equal slices of the oldest
        entry whose slice matches ``keys``' low 32 bits.

        For a step split over ``parts`` local devices, each mapping its own
        slice (key sharding): an entry leaves the queue once every part was
        taken. Returns None when no entry matches.
        """
        low = keys.astype(np.int32)
        with self._lock:
            for i, full in enumerate(self._items):
                if full.size != low.size * parts:
                    continue
                taken = self._parts.setdefault(id(full), set())
                if part in taken:
                    continue
                piece = full.reshape(parts, -1)[part]
                if bool((piece.astype(np.int32) == low.reshape(-1)).all()):
                    taken.add(part)
                    if len(taken) == parts:
                        del self._items[i]
                        del self._parts[id(full)]
                    return piece
        return None


# A direct call ``model(x)`` maps its keys eagerly in the calling thread: its
# full keys live in queues of its own, held by this context variable for the
# call's duration, so calls from several threads (a model server) never see
# one another's keys nor disturb the queues of a running ``fit``.
CALL_QUEUES = contextvars.ContextVar("keras_sparse_call_key_queues", default=None)


def key_queue(layer):
    """The layer's `KeyQueue` for the batches of ``fit``/``evaluate``/
    ``predict`` (created on first use)."""
    q = layer.__dict__.get("_ks_full_key_queue")
    if q is None:
        q = KeyQueue()
        layer.__dict__["_ks_full_key_queue"] = q
    return q


def _queue_of(layer):
    """The queue ``layer`` restores from now: the current direct call's own
    (None when that call queued nothing for it), else the trainer's."""
    local = CALL_QUEUES.get()
    if local is not None:
        return local.get(id(layer))
    return layer.__dict__.get("_ks_full_key_queue")


def has_queued(layer):
    """True when the input pipeline queued full keys for ``layer``."""
    return bool(_queue_of(layer))


def restore(layer, keys, xp=np):
    """``keys`` (flat int64, NumPy or with ``xp=cupy`` CuPy) with their high
    32 bits restored.

    Returns ``keys`` unchanged when the layer has no queued full keys (keys
    within int32, x64 mode).
    """
    q = _queue_of(layer)
    if not q:
        return keys
    full = q.take_match(keys, xp)
    if full is not None:
        return full
    raise KeyMismatchError(
        f"Layer '{layer.name}': the keys of this step match none of the full "
        "64-bit keys queued by the input pipeline. This should not happen; "
        "enable `jax_enable_x64` or use `keras_sparse.data.prefetch` as a "
        "workaround and report the model that triggered it."
    )


def restore_part(layer, keys, part, parts):
    """`restore` for the slice ``part`` of ``parts`` of a step's batch (the
    keys one of a process's ``parts`` devices holds); flat int64 NumPy."""
    q = _queue_of(layer)
    keys = np.asarray(keys).reshape(-1)
    if not q:
        return keys.astype(np.int64)
    full = q.take_part(keys, part, parts)
    if full is not None:
        return full
    raise KeyMismatchError(
        f"Layer '{layer.name}': the keys of device slice {part} of {parts} "
        "match none of the full 64-bit keys queued by the input pipeline. "
        "This should not happen; enable `jax_enable_x64` as a workaround and "
        "report the model that triggered it."
    )
