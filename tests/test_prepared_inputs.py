"""Codes + segments stacked along the batch axis for a prefetch stage."""

import keras
import numpy as np
import pytest

from keras_sparse.layers.prepared_inputs import host_segments
from keras_sparse.layers.prepared_inputs import pack_prepared
from keras_sparse.layers.prepared_inputs import segment_scratch
from keras_sparse.layers.prepared_inputs import unpack_prepared


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
    from keras_sparse.layers import prepared_inputs

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
