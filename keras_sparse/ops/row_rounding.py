"""Storing float32 rows in a table's dtype: the cast every row write makes.

A sparse optimizer does its math in float32; `to_storage` turns its new
rows (or slots) into the table's dtype. float32 tables get a plain cast,
bit for bit what they always got. 16-bit tables (``"bfloat16"``,
``"float16"``) get **stochastic rounding** by default: each value rounds
up to the next representable value with probability equal to its distance
from the one below, in ulps, so the expected stored value is the float32
value and updates smaller than half an ulp are not all lost (100 SGD
steps of 1e-4 on a bfloat16 1.0 reach ~0.99; rounding to nearest leaves
1.0). With ``stochastic=False`` they round to nearest.

The random bits come from a counter hash of (seed, row, column), not from
a random generator: every route (sparse, dense, per-table, sharded) and
every backend draws the same bits for the same row at the same step, and
`tests/test_row_rounding.py` reproduces them in NumPy. The seed is the
layer's step counter mixed with a salt per array (`array_seed`), so runs
are reproducible and steps independent.

- bfloat16 keeps the top 16 bits of a float32: add 16 random bits below
  them and truncate (integer ops on the float32 bit pattern). Exactly
  unbiased for finite values.
- float16 keeps 10 mantissa bits over a narrower exponent range: scale by
  the float16 ulp of the value (``2**(e - 10)``, at least ``2**-24``),
  add a uniform 13-bit fraction and floor. Exactly unbiased on float16's
  normal range (``|x| >= 6.1e-5``); below it, within ``2**-13`` of an ulp.

Non-finite values are cast as they are.
"""

import zlib

import keras
import numpy as np
from keras import ops

SIXTEEN_BIT = ("bfloat16", "float16")

# lowbias32 (a 32-bit integer hash with low bias), written for int32
# arithmetic that wraps: its multipliers as signed int32.
_MUL_1 = 0x7FEB352D
_MUL_2 = 0x846CA68B - (1 << 32)


def dtype_name(dtype):
    """``"float32"``, ``"bfloat16"``, ... of any backend's dtype object."""
    return keras.backend.standardize_dtype(dtype)


def is_sixteen_bit(dtype):
    return dtype_name(dtype) in SIXTEEN_BIT


def to_compute(values):
    """``values`` in float32 where they are stored in 16 bits, else as they
    are: the optimizer's math and the lookups' outputs are float32."""
    if is_sixteen_bit(values.dtype):
        return ops.cast(values, "float32")
    return values


def _shift_right(x, bits):
    """Logical right shift of int32 ``x`` (``>>`` is arithmetic)."""
    return ops.bitwise_and(ops.right_shift(x, bits), (1 << (32 - bits)) - 1)


def mix32(x):
    """lowbias32 of int32 ``x``: a bijection of the 32-bit words."""
    x = ops.bitwise_xor(x, _shift_right(x, 16))
    x = ops.multiply(x, np.int32(_MUL_1))
    x = ops.bitwise_xor(x, _shift_right(x, 15))
    x = ops.multiply(x, np.int32(_MUL_2))
    return ops.bitwise_xor(x, _shift_right(x, 16))


def name_salt(name):
    """A stable non-negative int32 per array name (``"table"``, slots)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def array_seed(iterations, name):
    """The int32 seed of array ``name``'s writes at step ``iterations``."""
    step = ops.cast(ops.convert_to_tensor(iterations), "int32")
    return mix32(ops.bitwise_xor(step, np.int32(name_salt(name))))


def int_seed(iterations, name):
    """`array_seed` as a Python int (signed int32), for compiled code."""
    x = (int(iterations) ^ name_salt(name)) & 0xFFFFFFFF
    for shift, multiplier in ((16, _MUL_1), (15, _MUL_2), (16, None)):
        x ^= x >> shift
        if multiplier is not None:
            x = (x * multiplier) & 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


class Seed:
    """What the writes of one array at one step round with: made for every
    write, computed (`array_seed`) only where a 16-bit array needs it."""

    def __init__(self, iterations, name):
        self.iterations = iterations
        self.name = name

    def value(self):
        return array_seed(self.iterations, self.name)


def write_seed(iterations, name, stochastic=True):
    """The `Seed` of array ``name`` at step ``iterations``; None (round to
    nearest) with ``stochastic=False`` or without a step."""
    if not stochastic or iterations is None:
        return None
    return Seed(iterations, name)


def random_bits(rows, width, seed):
    """``[n, width]`` int32 words from (``seed``, row, column): the same
    words for the same row wherever it is written from."""
    rows = ops.cast(rows, "int32")
    columns = ops.arange(width, dtype="int32")
    keys = ops.add(
        ops.multiply(ops.expand_dims(rows, -1), np.int32(width)),
        ops.expand_dims(columns, 0),
    )
    return mix32(ops.bitwise_xor(keys, ops.cast(seed, "int32")))


def _bits(x):
    return ops.view(x, "int32")


def _float(bits):
    return ops.view(bits, "float32")


def _round_bfloat16(x, noise):
    kept = ops.bitwise_and(
        ops.add(_bits(x), ops.bitwise_and(noise, 0xFFFF)), np.int32(-65536)
    )
    return _float(kept)


def _round_float16(x, noise):
    magnitude = ops.abs(x)
    exponent = ops.bitwise_and(_shift_right(_bits(magnitude), 23), 0xFF) - 127
    exponent = ops.maximum(exponent, -14)  # float16's subnormal spacing 2**-24
    ulp = _float(ops.left_shift(exponent - 10 + 127, 23))
    inverse_ulp = _float(ops.left_shift(10 - exponent + 127, 23))
    fraction = ops.multiply(
        ops.cast(ops.bitwise_and(noise, 0x1FFF), "float32"), np.float32(2.0**-13)
    )
    rounded = ops.multiply(ops.floor(ops.add(magnitude * inverse_ulp, fraction)), ulp)
    return ops.where(ops.less(x, 0), ops.negative(rounded), rounded)


def stochastic_round(values, dtype, rows, seed):
    """float32 ``values`` (``[n, width]``, row ``rows[i]`` of the array)
    stochastically rounded to ``dtype`` (``"bfloat16"`` or ``"float16"``)."""
    x = ops.cast(values, "float32")
    noise = random_bits(rows, x.shape[-1], seed)
    if dtype_name(dtype) == "bfloat16":
        rounded = _round_bfloat16(x, noise)
    else:
        rounded = _round_float16(x, noise)
    return ops.cast(ops.where(ops.isfinite(x), rounded, x), dtype)


def to_storage(values, dtype, rows=None, seed=None):
    """``values`` as stored in an array of ``dtype``.

    float32 (and any dtype not 16-bit): a cast, as always. 16-bit with a
    ``seed`` (a `Seed`): `stochastic_round` (``rows``: each value's row,
    ``[n]``); without one, round to nearest.
    """
    if is_sixteen_bit(dtype) and seed is not None:
        return stochastic_round(values, dtype, rows, seed.value())
    return ops.cast(values, dtype)
