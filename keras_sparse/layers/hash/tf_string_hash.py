"""In-graph string hashing for exported TensorFlow models.

``hash_strings_tf`` computes, with standard TensorFlow ops only (no
``tf.py_function``/``tf.numpy_function``), the same int64 values as
``keras_sparse.table.hash_strings``: FNV-1a-64 of each string's bytes, with
trailing NUL bytes not significant.  A SavedModel that takes raw strings can
then hash them itself and still be served in a fresh process that has only
TensorFlow.  Imported only on the TensorFlow backend.
"""

from __future__ import annotations

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def hash_strings_tf(strings):
    """FNV-1a-64 of each string's bytes as an int64 tensor of the same shape.

    ``strings`` is a dense ``tf.string`` tensor of any (also partly unknown)
    shape; works eagerly and inside ``tf.function``.  Trailing NUL bytes are
    dropped before hashing, as NumPy fixed-width strings drop them in
    ``hash_strings``, so ``b"a\\x00"`` hashes like ``b"a"``.

    >>> int(hash_strings_tf(["a"])[0]) == 0xAF63DC4C8601EC8C - 2**64
    True
    """
    import tensorflow as tf

    strings = tf.convert_to_tensor(strings, tf.string)
    shape = tf.shape(strings)
    flat = tf.reshape(strings, [-1])
    # reduce_max of no lengths is INT_MIN; at least one (all-zero) column.
    width = tf.maximum(tf.reduce_max(tf.strings.length(flat)), 1)
    # Zero-padded bytes, one row per byte column: [width, n].
    cols = tf.transpose(
        tf.cast(tf.io.decode_raw(flat, tf.uint8, fixed_length=width), tf.uint64)
    )
    # Length without trailing NULs: one past the last nonzero byte.
    positions = tf.range(1, width + 1)[:, None]
    lengths = tf.reduce_max(tf.where(cols != 0, positions, 0), axis=0)
    prime = tf.constant(_FNV_PRIME, tf.uint64)

    def step(h, column):
        j, byte = column
        mixed = tf.bitwise.bitwise_xor(h, byte) * prime  # wraps modulo 2**64
        return tf.where(j < lengths, mixed, h)

    start = tf.fill(tf.shape(flat), tf.constant(_FNV_OFFSET, tf.uint64))
    h = tf.foldl(step, (tf.range(width), cols), initializer=start)
    return tf.reshape(tf.bitcast(h, tf.int64), shape)
