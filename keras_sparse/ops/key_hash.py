"""Uniform numbers hashed from (seed, 64-bit key, column), in `keras.ops`.

A hash layer's fresh row must start from a vector that depends on its key
alone, whatever step, batch position, device or process admits it. A
counter-based draw gives that: element ``j`` of key ``k``'s vector is a hash
of ``(seed, high word of k, low word of k, j)``, turned into a uniform
number. Every operation is int32 arithmetic that wraps identically on JAX,
TensorFlow, PyTorch and NumPy (multiplication modulo 2**32, logical shifts
as arithmetic shifts then a mask), so the three backends compute the same
bits. The mixing function is MurmurHash3's 32-bit finalizer (a bijection
with full avalanche). Each key's pair of states ``(a, b)`` is a bijection of
its two words, so two keys never share a vector unless a 32-bit hash
collides in every column.
"""

import numpy as np
from keras import ops

_M1 = -2048144789  # 0x85EBCA6B as int32
_M2 = -1028477387  # 0xC2B2AE35
_GOLDEN = -1640531527  # 0x9E3779B9
# Uniform numbers carry 23 bits: (m + 0.5) / 2**23 is exact in float32.
_BITS = 23


def _int32(value):
    """A Python int taken modulo 2**32, as a signed int32 value."""
    return int(np.array(value % (1 << 32), np.uint64).astype(np.uint32).view(np.int32))


def _shr(x, s):
    """Logical right shift of int32 ``x`` by ``s`` bits."""
    return ops.bitwise_and(ops.right_shift(x, s), (1 << (32 - s)) - 1)


def mix32(x):
    """MurmurHash3's fmix32 of int32 ``x`` (wrapping arithmetic)."""
    x = ops.bitwise_xor(x, _shr(x, 16))
    x = ops.multiply(x, ops.convert_to_tensor(np.int32(_M1)))
    x = ops.bitwise_xor(x, _shr(x, 13))
    x = ops.multiply(x, ops.convert_to_tensor(np.int32(_M2)))
    return ops.bitwise_xor(x, _shr(x, 16))


def _mix32_int(x):
    """`mix32` of one Python int (the seed, hashed once when tracing)."""
    x %= 1 << 32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) % (1 << 32)
    x ^= x >> 13
    x = (x * 0xC2B2AE35) % (1 << 32)
    return _int32(x ^ (x >> 16))


def seed_word(seed):
    """The int32 state of an integer ``seed``."""
    return _mix32_int(int(seed) + 0x9E3779B9)


def key_uniforms(words, seed, dim):
    """float32 ``[m, dim]`` uniforms in (0, 1), a function of ``seed`` and
    each row of ``words`` (int32 ``[m, 2]``: a key's high and low word).

    The values are ``(h >> 9 + 0.5) / 2**23`` for a 32-bit hash ``h``: 23
    random bits, never exactly 0 or 1, so inverse CDFs stay finite.
    """
    words = ops.cast(words, "int32")
    a = mix32(ops.bitwise_xor(words[:, 0], seed_word(seed)))
    b = mix32(ops.bitwise_xor(words[:, 1], a))
    columns = np.arange(dim, dtype=np.int64) * (_GOLDEN % (1 << 32))
    columns = (columns % (1 << 32)).astype(np.uint32).view(np.int32)
    h = mix32(ops.bitwise_xor(b[:, None], ops.convert_to_tensor(columns)[None, :]))
    h = mix32(ops.bitwise_xor(h, a[:, None]))
    m = ops.cast(_shr(h, 32 - _BITS), "float32")
    return (m + 0.5) * (2.0**-_BITS)


def words_of_keys(keys):
    """int32 ``[n, 2]`` (high, low word) of flat integer ``keys`` (a tensor):
    int64 keys split in two, narrower keys extended as NumPy widens them.
    Matches `keras_sparse.table.sharded_table.key_words` on the host."""
    if "64" in str(keys.dtype):
        keys = ops.cast(keys, "int64")
        hi = ops.cast(ops.right_shift(keys, 32), "int32")
        lo = ops.cast(ops.bitwise_and(keys, 0xFFFFFFFF), "int32")
        return ops.stack([hi, lo], axis=-1)
    unsigned = "uint" in str(keys.dtype)
    keys = ops.cast(keys, "int32")  # wraps for uint32
    high = ops.zeros_like(keys) if unsigned else ops.right_shift(keys, 31)
    return ops.stack([high, keys], axis=-1)


def step_words(high, keys):
    """int32 ``[n, 2]`` words of a compiled step's flat ``keys`` whose high
    words ``high`` (int32 ``[n]``) came from the host: on JAX without x64
    the step's keys are the low words of the int64 keys (truncated)."""
    low = ops.cast(keys, "int32")  # wraps: the low word of int64 keys
    return ops.stack([ops.cast(high, "int32"), low], axis=-1)
