"""Codes + segments stacked along the batch axis for a prefetch stage."""

import keras
import numpy as np
import pytest

from keras_sparse.layers.hash.prepared_inputs import host_segments
from keras_sparse.layers.hash.prepared_inputs import pack_prepared
from keras_sparse.layers.hash.prepared_inputs import segment_scratch
from keras_sparse.layers.hash.prepared_inputs import unpack_prepared


def test_host_segments_number_distinct_rows_densely_in_row_order():
    codes = np.array([[5, -1, -2 - 3], [3, 5, -1], [-2 - 9, 0, 5]], np.int32)
    seg = host_segments(codes)
    assert seg.dtype == np.int32 and seg.shape == codes.shape
    rows = np.where(codes <= -2, -2 - codes, codes)
    # Rows 0, 3, 5, 9 then "no row": segments 0..4, fresh codes by their row.
    want = {0: 0, 3: 1, 5: 2, 9: 3, -1: 4}
    np.testing.assert_array_equal(seg, np.vectorize(want.get)(rows))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scratch_segments_partition_positions_like_the_sorted_ones(seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(-40, 60, (500, 3)).astype(np.int32)
    codes[codes < -1] = np.maximum(codes[codes < -1], -1 - 40)  # fresh rows
    scratch = segment_scratch(60)
    scratch[:] = rng.integers(-5, 5, scratch.shape)  # stale contents
    got = host_segments(codes, scratch)
    want = host_segments(codes)
    assert got.dtype == np.int32 and got.shape == codes.shape
    # Same partition of the positions, numbered densely from 0.
    assert set(np.unique(got)) == set(range(int(want.max()) + 1))
    pairs = set(zip(got.ravel().tolist(), want.ravel().tolist()))
    assert len(pairs) == int(want.max()) + 1  # a bijection between numberings
    assert host_segments(codes, scratch).tolist() == got.tolist()  # reusable


def test_very_large_tables_get_no_scratch():
    from keras_sparse.layers.hash import prepared_inputs

    assert segment_scratch(100).shape == (102,)
    assert segment_scratch(prepared_inputs.SCRATCH_MAX_ROWS + 1) is None


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("rest", [(), (3,)])
def test_pack_unpack_round_trip(replicas, rest):
    rng = np.random.default_rng(replicas)
    codes = rng.integers(-5, 50, (8,) + rest).astype(np.int32)
    seg = host_segments(codes)
    packed = pack_prepared(codes, seg, replicas)
    assert packed.shape == (16,) + rest
    # Each replica's contiguous slice holds its own codes, then segments.
    per = 16 // replicas
    for r in range(replicas):
        part = packed[r * per : (r + 1) * per]
        half = per // 2
        np.testing.assert_array_equal(part[:half], codes[r * half : (r + 1) * half])
        np.testing.assert_array_equal(part[half:], seg[r * half : (r + 1) * half])
    got_codes, got_seg = (
        keras.ops.convert_to_numpy(t)
        for t in unpack_prepared(keras.ops.convert_to_tensor(packed), replicas)
    )
    np.testing.assert_array_equal(got_codes, codes)
    np.testing.assert_array_equal(got_seg, seg)


def test_pack_refuses_a_batch_that_does_not_split_over_replicas():
    codes = np.zeros(6, np.int32)
    with pytest.raises(ValueError, match="6 samples .* 4 data-parallel replicas"):
        pack_prepared(codes, codes, 4)


def _split_words(keys):
    """Reference: (high, low) int32 words of the int64 keys, via Python ints."""
    from keras_sparse.layers.hash.host_keys import host_keys

    flat = [int(v) % 2**64 for v in host_keys(keys).tolist()]

    def signed(w):
        return w - 2**32 if w >= 2**31 else w

    high = np.array([signed(v >> 32) for v in flat], np.int32).reshape(keys.shape)
    low = np.array([signed(v & 0xFFFFFFFF) for v in flat], np.int32)
    return high, low.reshape(keys.shape)


def _stacked(arrays, replicas):
    """Reference layout: ``[replicas, k, B / replicas, ...]`` by np.stack."""
    b, rest = arrays[0].shape[0], arrays[0].shape[1:]
    parts = [a.reshape((replicas, b // replicas) + rest) for a in arrays]
    return np.stack(parts, axis=1).reshape((len(arrays) * b,) + rest)


_KEY_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


@pytest.mark.parametrize("dtype", _KEY_DTYPES + ["str", "object"])
@pytest.mark.parametrize("shape", [(8,), (8, 3)])
def test_key_words_are_packed_as_the_keys_int64_words(dtype, shape):
    from keras_sparse.layers.hash.prepared_inputs import KeyWords
    from keras_sparse.layers.hash.prepared_inputs import pack_blocks

    rng = np.random.default_rng(7)
    n = int(np.prod(shape))
    if dtype == "str":
        keys = np.array([f"k{i}" for i in rng.integers(0, 99, n)]).reshape(shape)
    elif dtype == "object":
        values = [int(v) for v in rng.integers(-(2**62), 2**62, n)]
        values[:2] = [2**64 - 1, -(2**63)]  # uint64 bits; the int64 minimum
        keys = np.array(values, dtype=object).reshape(shape)
    else:
        info = np.iinfo(dtype)
        keys = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
        keys.flat[:2] = [info.min, info.max]
    codes = rng.integers(-5, 50, shape).astype(np.int32)
    for replicas in (1, 2, 4):
        got = pack_blocks([codes, KeyWords(keys), codes + 1], replicas)
        want = _stacked([codes, *_split_words(keys), codes + 1], replicas)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
    # A strided view reads the same words as its copy.
    wide = np.repeat(keys, 2, axis=0)[::2]
    got = pack_blocks([codes, KeyWords(wide)], 2)
    np.testing.assert_array_equal(got, _stacked([codes, *_split_words(keys)], 2))


def test_pack_groups_lay_each_group_out_alone():
    from keras_sparse.layers.hash.prepared_inputs import pack_groups

    rng = np.random.default_rng(2)
    a = [rng.integers(0, 9, (12,)).astype(np.int32) for _ in range(3)]
    b = [rng.integers(0, 9, (12, 5)).astype(np.int64) for _ in range(2)]
    c = [rng.integers(0, 9, (12,)).astype(np.int32)]
    groups = [(a, 2), (b, 4), (c, 1), (a[:2], 3)]
    got = pack_groups(groups)
    for packed, (arrays, replicas) in zip(got, groups):
        want = _stacked(arrays, replicas)
        assert packed.dtype == want.dtype
        np.testing.assert_array_equal(packed, want)
        assert packed.ctypes.data % 64 == 0  # cache-line aligned views
    got[0][:] = -7  # views of one allocation, not overlapping
    np.testing.assert_array_equal(got[1], _stacked(b, 4))
    np.testing.assert_array_equal(got[2], _stacked(c, 1))


def test_segments_from_given_rows_equal_those_from_codes():
    rng = np.random.default_rng(4)
    codes = rng.integers(-40, 60, (300, 2)).astype(np.int32)
    codes[codes < -1] = np.maximum(codes[codes < -1], -1 - 40)
    rows = np.where(codes <= -2, -2 - codes, codes)
    scratch = segment_scratch(60)
    want = host_segments(codes, scratch)
    np.testing.assert_array_equal(host_segments(codes, scratch, rows=rows), want)
    np.testing.assert_array_equal(host_segments(codes, rows=rows), host_segments(codes))
