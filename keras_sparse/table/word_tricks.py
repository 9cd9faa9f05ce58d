"""Integer constants the table's vectorized probes share.

NumPy has no count-trailing-zeros: the position of a word's lowest set bit
is found by multiplying the isolated bit by a de Bruijn sequence and
looking the top six bits up in `DEBRUIJN_TABLE`.
"""

import numpy as np

INT64_MAX = np.iinfo(np.int64).max
DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
DEBRUIJN_TABLE = np.zeros(64, np.int64)
for _i in range(64):
    DEBRUIJN_TABLE[((1 << _i) * 0x03F79D71B4CB0A89 & 0xFFFFFFFFFFFFFFFF) >> 58] = _i
#: Unsigned integer type of each word size in bytes.
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
