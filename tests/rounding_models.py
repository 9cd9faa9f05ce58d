"""NumPy model of stochastic rounding into 16-bit tables: the same counter
hash of (seed, row, column), the rounding decided in float64 from the
distance to the two neighbours (an independent route to the same bits)."""

import zlib

import numpy as np

M32 = 0xFFFFFFFF


def mix32(x):
    x = np.asarray(x, np.uint64) & M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def array_seed(step, name):
    salt = zlib.crc32(name.encode()) & 0x7FFFFFFF
    return mix32(np.uint64((step ^ salt) & M32))


def noise(rows, width, step, name):
    """``[n, width]`` uint64 words, the bits the package draws."""
    keys = (np.asarray(rows, np.int64)[:, None] * width + np.arange(width)) & M32
    return mix32(keys.astype(np.uint64) ^ array_seed(step, name))


def _neighbours(x, dtype):
    """float64 ``(below, above)``: the representable values of ``dtype``
    around ``|x|`` (equal where ``x`` is representable)."""
    a = np.abs(x.astype(np.float64))
    if dtype == "bfloat16":
        bits = np.abs(x).astype(np.float32).view(np.uint32)
        below = (bits & 0xFFFF0000).view(np.float32).astype(np.float64)
        above = ((bits & 0xFFFF0000) + 0x10000).view(np.float32).astype(np.float64)
    else:
        near = a.astype(np.float16).astype(np.float64)
        below = np.where(near > a, np.nextafter(near.astype(np.float16),
                                                np.float16(0)).astype(np.float64),
                         near)  # fmt: skip
        above = np.nextafter(below.astype(np.float16), np.float16(np.inf))
        above = above.astype(np.float64)
    return a, below, above


def stochastic_round(x, rows, step, name, dtype):
    """``x`` (float32 ``[n, width]``) as stored, as float32 values."""
    x = np.asarray(x, np.float32)
    words = noise(rows, x.shape[1], step, name)
    a, below, above = _neighbours(x, dtype)
    if dtype == "bfloat16":
        u = (words & 0xFFFF).astype(np.float64) / 65536.0
    else:
        u = (words & 0x1FFF).astype(np.float64) / 8192.0
    frac = np.where(above > below, (a - below) / (above - below), 0.0)
    up = u >= 1.0 - frac
    out = np.where(up & (frac > 0), above, below) * np.sign(x)
    return out.astype(np.float32)
