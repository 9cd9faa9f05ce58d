"""Key conversion and the hash functions shared by the CPU and GPU tables.

All hashing is plain 64-bit integer arithmetic (``uint64`` wraps modulo 2**64
in NumPy, CuPy and CUDA alike), so a key lands in the same buckets on every
backend, process and platform.  ``keras_sparse/kernels/hash_table.cu`` mirrors
``mix64`` and ``bucket_pair`` bit for bit; change both together.
"""

from __future__ import annotations

import numpy as np

_U64 = np.uint64
# splitmix64 finalizer constants: a bijection on 64-bit words, so distinct keys
# never share a full hash and sorting/grouping by hash is safe.
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_MASK32 = _U64(0xFFFFFFFF)
_FNV_OFFSET = _U64(0xCBF29CE484222325)
_FNV_PRIME = _U64(0x100000001B3)


def to_host(x):
    """NumPy of a NumPy or CuPy array (a GPU table's result)."""
    if hasattr(x, "get") and not isinstance(x, np.ndarray):
        return x.get()
    return np.asarray(x)


def seed_word(seed: int) -> np.uint64:
    """Per-table 64-bit salt derived from the integer ``seed``."""
    return _U64((_GOLDEN * (int(seed) + 1)) & 0xFFFFFFFFFFFFFFFF)


def mix64(x, salt, xp=np):
    """splitmix64 finalizer of ``x ^ salt`` (uint64 in, new uint64 array out)."""
    z = x ^ salt
    # In-place steps: these arrays are large and temporaries dominate otherwise.
    z ^= z >> _U64(30)
    z *= _M1
    z ^= z >> _U64(27)
    z *= _M2
    z ^= z >> _U64(31)
    return z


def hash_keys(keys, salt, xp=np):
    """64-bit hash of int64 keys (bit pattern reinterpreted as uint64)."""
    return mix64(keys.view(xp.uint64), salt, xp)


def bucket_pair(h, num_buckets: int, xp=np):
    """Two distinct candidate buckets from one hash word.

    The high 32 bits pick the first bucket with Lemire's multiply-shift range
    reduction (no division, also cheap in CUDA); the low 32 bits pick an offset
    in ``[1, num_buckets)`` so the second bucket always differs from the first.
    """
    nb = _U64(num_buckets)
    b1 = h >> _U64(32)
    b1 *= nb
    b1 >>= _U64(32)
    b2 = h & _MASK32
    b2 *= _U64(num_buckets - 1)
    b2 >>= _U64(32)
    b2 += b1
    b2 += _U64(1)
    b2 -= (b2 >= nb).astype(xp.uint64) * nb
    return b1.view(xp.int64), b2.view(xp.int64)


def digest(h, xp=np):
    """8-bit fingerprint per slot; uses low bits that barely affect the buckets."""
    return (h & _U64(0xFF)).astype(xp.uint8)


def _is_cuda_array(x) -> bool:
    return hasattr(x, "__cuda_array_interface__")


def _check_integer(arr, name: str):
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        raise TypeError(
            f"{name} must be an integer array (int32/int64/uint64), "
            f"got dtype {arr.dtype}"
        )


_INT64_MIN = -(2**63)
_UINT64_END = 2**64


def object_keys(arr, name: str = "keys", strings: bool = False):
    """An integer (or, with ``strings``, str/bytes) array from an object array.

    pandas gives object arrays for nullable integer columns: their integers
    are read as the integers they are, never as their decimal text. Mixed
    contents, floats, bools, None and missing values (``pd.NA``) raise
    TypeError naming the first offending element; integers outside
    ``[-2**63, 2**64)`` raise ValueError. Integers ``>= 2**63`` keep their
    bits as uint64 keys do (they become negative int64 keys).

    >>> object_keys(np.array([[7, 8]], dtype=object)).tolist()
    [[7, 8]]
    """
    flat = arr.reshape(-1)
    if not flat.size:
        return np.zeros(arr.shape, np.int64)
    text = (str, bytes, np.str_, np.bytes_)
    if strings and all(isinstance(v, text) for v in flat):
        kind = str if all(isinstance(v, (str, np.str_)) for v in flat) else None
        if kind is None and not all(isinstance(v, (bytes, np.bytes_)) for v in flat):
            raise TypeError(
                f"{name} mixes str and bytes; pass one kind of string per array"
            )
        return np.array(flat.tolist(), dtype="U" if kind else "S").reshape(arr.shape)
    for v in flat:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            allowed = "integers or strings" if strings else "integers"
            raise TypeError(
                f"{name} must be {allowed}; this object array holds "
                f"{v!r} ({type(v).__name__}). Drop or fill missing values "
                "and cast the column to int64 first"
            )
    ints = [int(v) for v in flat]
    low, high = min(ints), max(ints)
    if low < _INT64_MIN or high >= _UINT64_END:
        bad = low if low < _INT64_MIN else high
        raise ValueError(
            f"{name}: {bad} is outside the 64-bit key range [-2**63, 2**64)"
        )
    words = np.array([v % _UINT64_END for v in ints], dtype=np.uint64)
    return words.view(np.int64).reshape(arr.shape)


def to_numpy_keys(keys, name: str = "keys"):
    """Return ``(flat int64 NumPy array, original shape)`` for keys on any framework.

    uint64 keys are reinterpreted bit for bit as int64 (values >= 2**63 become
    negative keys), so every 64-bit pattern is a distinct key.
    """
    if isinstance(keys, np.ndarray):
        arr = keys
    elif _is_cuda_array(keys) and hasattr(keys, "get"):  # CuPy on a CPU table
        arr = keys.get()
    elif hasattr(keys, "detach") and hasattr(keys, "cpu"):  # torch
        arr = keys.detach().cpu().numpy()
    elif hasattr(keys, "numpy") and callable(keys.numpy):  # tensorflow eager
        arr = keys.numpy()
    else:
        arr = np.asarray(keys)
        if arr.size == 0 and arr.dtype.kind == "f":  # [] defaults to float64
            arr = arr.astype(np.int64)
    if arr.dtype == object:
        arr = object_keys(arr, name)
    _check_integer(arr, name)
    shape = arr.shape
    if arr.dtype == np.uint64:
        flat = np.ascontiguousarray(arr).reshape(-1).view(np.int64)
    else:
        flat = np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)
    return flat, shape


def to_cupy_keys(keys, name: str = "keys"):
    """Like ``to_numpy_keys`` but returns a CuPy array; CUDA inputs stay on device.

    Objects exposing ``__dlpack__`` or ``__cuda_array_interface__`` on a CUDA
    device (torch, JAX, TF, CuPy) are wrapped zero-copy.
    """
    import cupy as cp

    arr = None
    if isinstance(keys, cp.ndarray):
        arr = keys
    elif _is_cuda_array(keys):
        arr = cp.asarray(keys)
    elif hasattr(keys, "__dlpack__") and hasattr(keys, "__dlpack_device__"):
        dev_type = keys.__dlpack_device__()[0]
        if int(dev_type) in (2, 3):  # kDLCUDA, kDLCUDAHost
            arr = cp.from_dlpack(keys)
    if arr is None:
        flat, shape = to_numpy_keys(keys, name)
        return cp.asarray(flat), shape
    _check_integer(arr, name)
    shape = arr.shape
    if arr.dtype == cp.uint64:
        flat = cp.ascontiguousarray(arr).reshape(-1).view(cp.int64)
    else:
        flat = cp.ascontiguousarray(arr, dtype=cp.int64).reshape(-1)
    return flat, shape


def hash_strings(strings) -> np.ndarray:
    """Stable 64-bit FNV-1a hash of the UTF-8 bytes of each string, as int64.

    Standard FNV-1a-64 (offset basis 0xcbf29ce484222325, prime 0x100000001b3),
    so values match other implementations and never change across processes,
    platforms or NumPy versions (unlike Python's salted ``hash``).  Accepts str
    or bytes items of any shape; the result has the input's shape.  Trailing
    NUL characters are not significant (NumPy fixed-width strings drop them).
    Vectorized: one NumPy pass per byte column, not per string.

    >>> int(hash_strings(["a"])[0]) == 0xAF63DC4C8601EC8C - 2**64
    True
    """
    arr = np.asarray(strings)
    shape = arr.shape
    if arr.dtype.kind == "U":
        arr = np.strings.encode(arr, "utf-8")
    elif arr.dtype.kind != "S":
        if arr.size == 0:
            return np.zeros(shape, np.int64)
        raise TypeError(f"strings must be str or bytes, got dtype {arr.dtype}")
    flat = np.ascontiguousarray(arr.reshape(-1))
    width = flat.dtype.itemsize
    lengths = np.strings.str_len(flat)
    h = np.full(flat.shape[0], _FNV_OFFSET, dtype=np.uint64)
    if width and flat.size:
        cols = flat.view(np.uint8).reshape(-1, width)
        for j in range(int(lengths.max(initial=0))):
            live = lengths > j
            h = np.where(live, (h ^ cols[:, j].astype(np.uint64)) * _FNV_PRIME, h)
    return h.view(np.int64).reshape(shape)
