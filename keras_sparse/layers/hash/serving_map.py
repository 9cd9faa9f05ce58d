"""A hash layer's serving map: its key->row map as arrays in the model.

A `DistributedHashEmbedding` maps keys to rows in a Python hash table, which a
compiled inference step can only reach through a host callback and an
exported SavedModel cannot reach at all. The serving map is a frozen copy of
that map held in four non-trainable variables of the layer:

``serving_key_words``  int32 ``[capacity, 2]``: each live key as (high 32 bits
                       signed, low 32 bits with the sign bit flipped), so
                       that comparing pairs as signed int32 orders them as
                       int64; sorted by (bucket, key); unused rows hold
                       int32 max.
``serving_rows``       int32 ``[capacity]``: each listed key's table row.
``serving_directory``  int32 ``[2**bits + 1]``: where each bucket's keys start
                       (a key's bucket: the top ``bits`` bits of a 32-bit
                       mix of its words, ``2**bits >= capacity``).
``serving_meta``       int32 ``[4]``: the number of keys, the table version
                       (`keras_sparse.table.HashTable.version`) they reflect,
                       the search rounds the fullest bucket needs, and a
                       random stamp of the layer's table.

Inference in a compiled step (``training=False`` under ``jax.jit``, a
``tf.function``, an exported artifact) hashes each key (int32 multiplies and
shifts), reads its bucket's range from the directory and binary-searches
that range: about one key per bucket, so a handful of rounds of vectorized
gathers and compares, plain ops that every backend and ``model.export``
handle, in int32 so JAX without x64 can hold them. Unknown keys get row -1
and read zeros, exactly as the table's own lookup. `refresh` rewrites the
variables from the table when its version moved (once per ``predict``/
``evaluate``/export call, see `keras_sparse.layers.hash.serving_hooks`), so a
step never sees a stale map.

Why not the table's own buckets: its hash functions need 64-bit unsigned
arithmetic, which JAX without x64 lacks; this layout needs none, and a
server can rebuild it from records (`keras_sparse.layers.hash.serving_export`).
"""

import math

import keras
import numpy as np
from keras import ops

from keras_sparse.layers.hash import serving_state
from keras_sparse.progress import tracker
from keras_sparse.table.keys import to_host

#: Key words of unused serving rows (after every live key in sorted order).
PAD_WORD = np.iinfo(np.int32).max
_VERSION_MOD = 2**31 - 1
# murmur3's 32-bit multipliers, as int32 (multiplication wraps alike in
# NumPy, XLA, TensorFlow and torch).
_MIX = tuple(
    int(np.array(m, np.uint32).view(np.int32))
    for m in (0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35)
)


def directory_bits(capacity):
    """Bits of a key's bucket: ``2**bits >= capacity`` (about a key each)."""
    return max(1, math.ceil(math.log2(max(capacity, 2))))


def build(layer):
    """Creates the layer's serving-map variables (an empty map).

    A process holding only some shards of a key-sharded table cannot know
    the other keys: its map gets no rows (such layers infer through their
    callbacks).
    """
    capacity = layer.table.capacity if is_complete(layer) else 0
    specs = (
        ("serving_key_words", (capacity, 2), PAD_WORD),
        ("serving_rows", (capacity,), -1),
        ("serving_directory", (2 ** directory_bits(capacity) + 1,), 0),
        # size, table version, rounds, and which table: a map copied from
        # another layer's variables (set_weights) is never taken as current.
        ("serving_meta", (4,), 0),
    )
    for name, shape, value in specs:
        variable = layer.add_weight(
            shape=shape,
            dtype="int32",
            initializer=keras.initializers.Constant(value),
            trainable=False,
            autocast=False,
            name=name,
        )
        setattr(layer, name, variable)
    # Left out of JAX training steps' state (`serving_state`).
    layer._serving_ids = frozenset(id(getattr(layer, name)) for name, *_ in specs)
    layer._serving_stamp = int(np.random.default_rng().integers(1, 2**31 - 1))


# ------------------------------------------------------------------ host side
def key_words(keys):
    """``(high, low)`` int32 serving words of int64 keys (NumPy)."""
    k = np.asarray(keys, np.int64).reshape(-1)
    high = (k >> 32).astype(np.int32)
    low = ((k & 0xFFFFFFFF) - 2**31).astype(np.int32)
    return high, low


def _mix_host(high, low):
    h = high.astype(np.uint32) * np.uint32(_MIX[0] & 0xFFFFFFFF)
    h ^= low.astype(np.uint32)
    for shift, mult in ((16, _MIX[1]), (13, _MIX[2])):
        h ^= h >> np.uint32(shift)
        h *= np.uint32(mult & 0xFFFFFFFF)
    h ^= h >> np.uint32(16)
    return h


def buckets(high, low, bits):
    """Bucket of each key's words: the top ``bits`` bits of their mix."""
    return (_mix_host(high, low) >> np.uint32(32 - bits)).astype(np.int64)


def padded_map(keys, rows, capacity):
    """Host ``(words, rows, directory, rounds)`` of the serving variables
    for ``keys`` at ``rows`` in a map of ``capacity`` rows."""
    n = len(keys)
    if n > capacity:
        raise ValueError(f"{n} keys do not fit a serving map of {capacity} rows.")
    bits = directory_bits(capacity)
    high, low = key_words(keys)
    bucket = buckets(high, low, bits)
    order = np.lexsort((low, high, bucket))
    all_words = np.full((capacity, 2), PAD_WORD, np.int32)
    all_words[:n, 0], all_words[:n, 1] = high[order], low[order]
    all_rows = np.full(capacity, -1, np.int32)
    all_rows[:n] = np.asarray(rows, np.int64)[order]
    counts = np.bincount(bucket, minlength=2**bits)
    directory = np.zeros(2**bits + 1, np.int32)
    np.cumsum(counts, out=directory[1:])
    # Rounds of a lower-bound search over the fullest bucket's n keys:
    # ceil(log2(n + 1)), the bit length of n.
    return all_words, all_rows, directory, int(counts.max(initial=0)).bit_length()


def is_complete(layer):
    """False when this process holds only some of a key-sharded table's
    shards (the others' keys are unknown here)."""
    local = getattr(layer.table, "local", None)
    return local is None or len(local) == layer.table.num_shards


def is_current(layer):
    """True when the serving variables reflect the table's current map."""
    meta = ops.convert_to_numpy(layer.serving_meta.value)
    return (
        int(meta[1]) == layer.table.version % _VERSION_MOD
        and int(meta[3]) == layer._serving_stamp
    )


# Seconds each stage of `refresh` took at 10M keys on a CPU host (the
# bar's pace; only the ratios matter).
_REFRESH_STAGES = {"table": 0.2, "sort": 7, "assign": 0.3}


def refresh(layer, show_progress=False):
    """Rewrites the serving map from the table if the table changed since.

    Returns True when it wrote. One scalar read when nothing changed;
    otherwise one export of the table and four variable assignments, all
    under the table's lock. ``show_progress``: a bar for a big table (see
    `keras_sparse.set_progress`).
    """
    if not layer.built or not is_complete(layer):
        return False
    # Under the table's lock: no insert lands between the export and the
    # writes, and concurrent refreshes do not interleave their writes.
    with layer.table._lock:
        if is_current(layer):
            return False
        version = layer.table.version
        n = layer.table.size if show_progress else 0
        title = f"Layer '{layer.name}': building the serving map of {n:,} keys"
        with tracker(n, title, _REFRESH_STAGES) as progress:
            progress.stage("table")
            keys, rows, _ = (to_host(x) for x in layer.table.export())
            progress.stage("sort")
            words, rows, directory, rounds = padded_map(
                keys, rows, layer.serving_rows.shape[0]
            )
            progress.stage("assign")
            written = (
                (layer.serving_key_words, words),
                (layer.serving_rows, rows),
                (layer.serving_directory, directory),
            )
            for variable, value in progress.each(written):
                variable.assign(value)
        meta = [len(keys), version % _VERSION_MOD, rounds, layer._serving_stamp]
        layer.serving_meta.assign(np.array(meta, np.int32))
    return True


def hash_layers(model):
    """The hash layers of a model or layer (itself included)."""
    layers = [model]
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is not None:
        layers = list(flatten(include_self=True, recursive=True))
    return [x for x in layers if getattr(x, "keras_sparse_kind", None) == "hash"]


def refresh_all(model, show_progress=True):
    """Brings the serving maps of ``model``'s hash layers up to date.

    ``predict``, ``evaluate``, ``*_on_batch`` and ``model.export`` do this
    themselves; call it before inference you compile yourself (a
    ``jax.jit`` of ``model.stateless_call``, a ``tf.function`` of
    ``model(x)``) once training has changed the tables. Returns the names
    of the layers whose map was rewritten. A big table's map shows a
    progress bar as it is built (`keras_sparse.set_progress`) unless
    ``show_progress`` is False (as while ``fit`` or ``predict`` show theirs).

    Example:

    >>> import numpy as np, keras_sparse as ks
    >>> layer = ks.DistributedHashEmbedding(4, capacity=64, optimizer="sgd")
    >>> _ = layer(np.array([3, 5]), training=True)
    >>> ks.refresh_serving_maps(layer) == [layer.name]
    True
    >>> ks.refresh_serving_maps(layer)  # unchanged since
    []
    """
    return [x.name for x in hash_layers(model) if refresh(x, show_progress)]


# ----------------------------------------------------------------- in a graph
def usable(layer, keys):
    """Whether the compiled inference of ``keys`` can use the serving map.

    On JAX without x64 int64 batches arrive truncated to 32 bits: the map
    is exact for them only when the layer declares ``key_dtype="int32"``
    (whose keys are checked to fit as batches are fed).
    """
    if serving_state.hidden():
        # Inside a training step the map is not in the step's state (it
        # would read as a constant of the traced step): the table maps.
        return False
    if not is_complete(layer) or layer.prepared_form is not None:
        # A stage-held layer's keys map as of its last trained step
        # (`trained_rows`), which the map, a copy of the table, is not.
        return False
    dtype = getattr(keys, "dtype", None)
    dtype = "" if dtype is None else keras.backend.standardize_dtype(dtype)
    if "int" not in dtype:
        return False
    if keras.backend.backend() == "jax":
        if dtype == "uint32":  # needs 64-bit words to stay unsigned
            return False
        if dtype == "int32":
            return layer.key_dtype == "int32"
    return True


def _query_words(keys):
    """(high, low) int32 serving words of flat integer key tensors."""
    dtype = keras.backend.standardize_dtype(keys.dtype)
    if dtype in ("int64", "uint64", "uint32"):
        keys = ops.cast(keys, "int64")
        high64 = ops.right_shift(keys, 32)
        low = ops.subtract(keys, ops.left_shift(high64, 32))  # [0, 2**32)
        low = ops.subtract(low, ops.convert_to_tensor(2**31, "int64"))
        return ops.cast(high64, "int32"), ops.cast(low, "int32")
    keys = ops.cast(keys, "int32")
    high = ops.where(ops.less(keys, 0), -1, 0)
    # The low word with its sign bit flipped, without int32 overflow.
    low = ops.where(
        ops.less(keys, 0),
        ops.add(ops.add(keys, 2**31 - 1), 1),
        ops.subtract(ops.subtract(keys, 2**31 - 1), 1),
    )
    return ops.cast(high, "int32"), low


def bucket_of(high, low, bits, xp=ops):
    """In-graph twin of `buckets` (int32 arithmetic, wrapping); ``xp``: a
    namespace with keras.ops' ``multiply``, ``bitwise_xor``,
    ``right_shift`` and ``bitwise_and`` (TensorFlow's for served models)."""

    def shifted_right(x, shift):  # logical
        return xp.bitwise_and(xp.right_shift(x, shift), (1 << (32 - shift)) - 1)

    h = xp.bitwise_xor(xp.multiply(high, _MIX[0]), low)
    for shift, mult in ((16, _MIX[1]), (13, _MIX[2])):
        h = xp.multiply(xp.bitwise_xor(h, shifted_right(h, shift)), mult)
    h = xp.bitwise_xor(h, shifted_right(h, 16))
    return shifted_right(h, 32 - bits)


def lookup(layer, keys):
    """Rows (int32, -1 where absent) of flat integer ``keys``, in the graph."""
    words = layer.serving_key_words.value
    rows = layer.serving_rows.value
    directory = layer.serving_directory.value
    size, rounds = layer.serving_meta.value[0], layer.serving_meta.value[2]
    last = int(words.shape[0]) - 1
    bits = directory_bits(int(words.shape[0]))
    want_high, want_low = _query_words(keys)
    bucket = bucket_of(want_high, want_low, bits)
    start = ops.take(directory, bucket, axis=0)
    # Capped by the size: a map being replaced (size 0 first) finds nothing.
    end = ops.minimum(ops.take(directory, bucket + 1, axis=0), size)

    def less_than_wanted(at):
        w = ops.take(words, ops.minimum(at, last), axis=0)
        high, low = w[:, 0], w[:, 1]
        return ops.logical_or(
            ops.less(high, want_high),
            ops.logical_and(ops.equal(high, want_high), ops.less(low, want_low)),
        )

    def search_round(_, bounds):
        # Lower bound in [lo, hi): the first key of the bucket >= the wanted.
        lo, hi = bounds
        open_ = ops.less(lo, hi)
        mid = ops.floor_divide(lo + hi, 2)
        less = less_than_wanted(mid)
        lo = ops.where(ops.logical_and(open_, less), mid + 1, lo)
        hi = ops.where(ops.logical_and(open_, ops.logical_not(less)), mid, hi)
        return lo, hi

    # A loop, not unrolled rounds: the round count lives in the map (it
    # changes with the keys), and XLA's CPU compiler handles long unrolled
    # gather chains very slowly.
    lo, _ = ops.fori_loop(0, rounds, search_round, (start, end))
    at = ops.minimum(lo, last)
    w = ops.take(words, at, axis=0)
    found = ops.logical_and(
        ops.less(lo, end),
        ops.logical_and(ops.equal(w[:, 0], want_high), ops.equal(w[:, 1], want_low)),
    )
    return ops.where(found, ops.take(rows, at, axis=0), -1)
