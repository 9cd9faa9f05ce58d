"""The CUDA kernels run on the host (tests/cuda_emulation) against the NumPy twin.

These check keras_sparse/kernels/hash_table.cu itself on a machine without a GPU: its
hashing, its 16-lane ballot probe and its placement kernel give what
keras_sparse.table's NumPy code gives, and the emulator reports what a GPU
would get wrong or leave undefined (divergent ballots, mistyped arguments).
"""

import numpy as np
import pytest

from keras_sparse.kernel_sources import kernel_source
from keras_sparse.table.keys import bucket_pair
from keras_sparse.table.keys import digest
from keras_sparse.table.keys import hash_keys
from keras_sparse.table.numpy_table import NumpyTable
from tests.cuda_emulation import kernel_emulator as emu

pytestmark = [
    pytest.mark.backend_independent,
    pytest.mark.skipif(emu.CXX is None, reason="no C++ compiler for the emulator"),
]


@pytest.fixture(scope="module")
def kernels():
    return emu.compile_module(kernel_source("hash_table.cu"))


def _launch(kernels, name, n, args, lanes=1, block=256):
    threads = n * lanes
    kernels.get_function(name)(((threads + block - 1) // block,), (block,), args)


def _filled_table(bucket_size, n_keys, seed=0):
    # NumpyTable(num_buckets, bucket_size, eviction, admit_after, seed)
    table = NumpyTable(64, bucket_size, "lru", 1, seed)
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, n_keys, dtype=np.int64))
    table.lookup_or_insert(keys)
    return table, keys


def test_hash_kernel_matches_the_numpy_hash(kernels):
    rng = np.random.default_rng(1)
    keys = rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64)
    keys[:4] = [0, -1, np.iinfo(np.int64).min, np.iinfo(np.int64).max]
    salt, nb = np.uint64(0x1234_5678_9ABC_DEF1), 1000
    b1, b2 = np.empty(3000, np.int64), np.empty(3000, np.int64)
    dg = np.empty(3000, np.uint8)
    args = (keys, np.int64(3000), salt, np.uint64(nb), b1, b2, dg)
    _launch(kernels, "ks_hash", 3000, args)
    h = hash_keys(keys, salt)
    want_b1, want_b2 = bucket_pair(h, nb)
    np.testing.assert_array_equal(b1, want_b1)
    np.testing.assert_array_equal(b2, want_b2)
    np.testing.assert_array_equal(dg, digest(h))


@pytest.mark.parametrize("bucket_size", [8, 16, 32])
@pytest.mark.parametrize("kernel,lanes", [("ks_find", 16), ("ks_lookup", 1)])
def test_probe_kernels_match_the_numpy_probe(kernels, kernel, lanes, bucket_size):
    """Both probes (the 16-lane ballot tile, vector digest loads when the
    bucket is a multiple of 16, and the one-thread reference) find every live
    key at the twin's row and miss absent keys; the query count is not a
    multiple of the block so the last warp is partly out of range (8: byte
    loads, 16/32: vector loads)."""
    table, keys = _filled_table(bucket_size, 40 * bucket_size)
    absent = np.arange(-500, 500, dtype=np.int64) * 7919
    query = np.concatenate([keys, absent, keys[::3]])
    n = query.shape[0]
    rows = np.full(n, -7, np.int64)
    args = (
        query,
        np.int64(n),
        np.uint64(table.salt),
        np.uint64(table.num_buckets),
        np.int32(bucket_size),
        table.keys,
        table.digest,
        rows,
    )
    _launch(kernels, kernel, n, args, lanes=lanes)
    np.testing.assert_array_equal(rows, table.find(query))
    assert (rows[: keys.shape[0]] >= 0).all()


def test_claim_kernel_places_like_the_numpy_round(kernels):
    """ks_claim_compact ranks keys per chosen bucket and writes them where the
    generic CuPy/NumPy round would; keys past a bucket's free room are refused."""
    S, nb = 8, 64
    base = NumpyTable(nb, S, "lru", 1, 0)
    base.lookup_or_insert(np.arange(100, dtype=np.int64) * 1_000_003)
    rng = np.random.default_rng(3)
    n = 300  # more than the free room of the busiest buckets
    ak = rng.integers(1, 2**62, n, dtype=np.int64)
    choose = rng.integers(0, nb, n).astype(np.int64)
    d = rng.integers(0, 256, n).astype(np.uint8)
    new_score = np.full(n, 5, np.int64)
    a = np.arange(n, dtype=np.int64)

    # The generic round of ArrayTable (what CupyTable falls back to).
    want = NumpyTable(nb, S, "lru", 1, 0)
    want.lookup_or_insert(np.arange(100, dtype=np.int64) * 1_000_003)
    placed, slots, refused = super(NumpyTable, want)._claim_write(
        a.copy(), choose, ak, d, new_score
    )

    got_keys, got_dig, got_score = (
        base.keys.copy(),
        base.digest.copy(),
        base.score.copy(),
    )
    sh = max(n - 1, 1).bit_length()
    comp = np.sort((choose << sh) | a)
    out_slots = np.full(n, -9, np.int64)
    ok = np.zeros(n, np.bool_)
    args = (comp, np.int64(n), np.int32(sh), np.int32(S), base.load, a, ak, d,
            new_score, got_keys, got_dig, got_score, out_slots, ok)  # fmt: skip
    _launch(kernels, "ks_claim_compact", n, args)

    order = np.argsort(placed)  # the generic round returns them by bucket
    np.testing.assert_array_equal(a[ok], placed[order])
    np.testing.assert_array_equal(out_slots[ok], slots[order])
    np.testing.assert_array_equal(a[~ok], refused)
    assert refused.shape[0] > 0
    np.testing.assert_array_equal(got_keys[slots], want.keys[slots])
    np.testing.assert_array_equal(got_dig[slots], want.digest[slots])
    np.testing.assert_array_equal(got_score[slots], want.score[slots])


def test_scatter_add_kernels_accumulate_duplicates(kernels):
    idx = np.array([0, 3, 3, 3, 9, 0], np.int64)
    val = np.array([1, -2, 5, 7, 1 << 40, 4], np.int64)
    got = np.zeros(10, np.int64)
    _launch(kernels, "ks_add_i64", 6, (got, idx, val, np.int64(6)))
    want = np.zeros(10, np.int64)
    np.add.at(want, idx, val)
    np.testing.assert_array_equal(got, want)
    got32 = np.zeros(10, np.uint32)
    val32 = np.arange(6, dtype=np.uint32)
    _launch(kernels, "ks_add_u32", 6, (got32, idx, val32, np.int64(6)))
    want32 = np.zeros(10, np.uint32)
    np.add.at(want32, idx, val32)
    np.testing.assert_array_equal(got32, want32)


_DIVERGENT = r"""
extern "C" __global__ void early_exit_ballot(const int* x, int n, unsigned int* out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;  // the out-of-range lanes leave before the ballot
  unsigned int b = __ballot_sync(0xFFFFFFFFu, x[i] > 0);
  if ((threadIdx.x & 31) == 0) out[i / 32] = b;
}
"""


def test_emulator_reports_a_ballot_after_an_early_exit():
    """The bug ks_find's fixed trip counts avoid: lanes that returned early
    cannot take part in a full-mask ballot (undefined on a GPU)."""
    kernel = emu.compile_module(_DIVERGENT).get_function("early_exit_ballot")
    x = np.array([1, 0, 2] * 20, np.int32)
    out = np.zeros(2, np.uint32)
    kernel((1,), (64,), (x, np.int32(64), out))  # every lane in range: fine
    assert out[0] == sum(1 << j for j in range(32) if x[j] > 0)
    with pytest.raises(emu.EmulatedLaunchError, match="divergent __ballot_sync"):
        kernel((1,), (64,), (x, np.int32(60), out))


def test_emulator_rejects_arguments_a_gpu_would_misread(kernels):
    keys = np.arange(8, dtype=np.int64)
    rows = np.empty(8, np.int64)
    table = (np.zeros(32, np.int64), np.zeros(32, np.uint8))
    good = (keys, np.int64(8), np.uint64(1), np.uint64(2), np.int32(16)) + table
    find = kernels.get_function("ks_find")
    find((1,), (128,), good + (rows,))
    with pytest.raises(
        emu.KernelArgumentError, match=r"`int S`.*int32 scalar, got int64"
    ):
        find((1,), (128,), good[:4] + (np.int64(16),) + table + (rows,))
    with pytest.raises(
        emu.KernelArgumentError, match="int64 elements, got an array of int32"
    ):
        find((1,), (128,), (keys.astype(np.int32),) + good[1:] + (rows,))
    read_only = rows.copy()
    read_only.flags.writeable = False
    with pytest.raises(emu.KernelArgumentError, match="read-only"):
        find((1,), (128,), good + (read_only,))
    with pytest.raises(emu.KernelArgumentError, match="non-contiguous"):
        find((1,), (128,), (np.arange(16, dtype=np.int64)[::2],) + good[1:] + (rows,))


_ORDER_DEPENDENT = r"""
extern "C" __global__ void last_writer(int* out) {
  out[0] = threadIdx.x;  // every thread writes one cell: the survivor is any
}
"""


def test_emulator_runs_threads_out_of_order():
    """Threads of a block do not run in index order (a GPU promises none),
    so a result that depends on the order does not look deterministic."""
    out = np.zeros(1, np.int32)
    emu.compile_module(_ORDER_DEPENDENT).get_function("last_writer")(
        (1,), (256,), (out,)
    )
    assert out[0] != 255


def test_emulator_runs_a_cooperative_grid_with_a_spinning_barrier():
    """A cooperative launch runs its blocks side by side, so a grid barrier
    made of atomics and a spin (as in ks_insert_grid) completes, and every
    block then reads what every other block wrote before the barrier; a
    block's shared memory stays its own."""
    src = r"""
    extern "C" __global__ void grid_sum(long long* part, unsigned int* bar,
                                        long long* out) {
      __shared__ long long mine;
      if (threadIdx.x == 0) mine = 0;
      __syncthreads();
      atomicAdd((unsigned long long*)&mine, (unsigned long long)(blockIdx.x + 1));
      __syncthreads();
      if (threadIdx.x == 0) {
        part[blockIdx.x] = mine;
        __threadfence();
        atomicAdd(bar, 1u);  // one-shot barrier: wait for every block
        while (*(volatile unsigned int*)bar < gridDim.x) __nanosleep(32);
      }
      __syncthreads();
      long long all = 0;
      for (unsigned int b = 0; b < gridDim.x; ++b)
        all += ((volatile long long*)part)[b];
      out[blockIdx.x * blockDim.x + threadIdx.x] = all + mine;
    }
    """
    kernel = emu.compile_module(src).get_function("grid_sum")
    blocks, threads = 4, 64
    part = np.zeros(blocks, np.int64)
    bar = np.zeros(1, np.uint32)
    out = np.zeros(blocks * threads, np.int64)
    kernel((blocks,), (threads,), (part, bar, out), enable_cooperative_groups=True)
    sums = np.arange(1, blocks + 1) * threads  # each block's own shared sum
    want = np.repeat(sums.sum() + sums, threads)
    np.testing.assert_array_equal(out, want)
    assert bar.tolist() == [blocks]


def test_emulator_stops_a_cooperative_grid_when_a_block_fails():
    """A block that fails (here a divergent ballot) never reaches the grid
    barrier the others spin at: the launch reports that block's error
    instead of hanging."""
    src = r"""
    extern "C" __global__ void fail_then_wait(unsigned int* bar, int bad) {
      if (blockIdx.x == bad && threadIdx.x < 16) return;
      if (blockIdx.x == bad) __ballot_sync(0xFFFFFFFFu, true);
      if (threadIdx.x == 0) {
        atomicAdd(bar, 1u);
        while (*(volatile unsigned int*)bar < gridDim.x) __nanosleep(32);
      }
    }
    """
    kernel = emu.compile_module(src).get_function("fail_then_wait")
    bar = np.zeros(1, np.uint32)
    kernel((3,), (32,), (bar, np.int32(-1)), enable_cooperative_groups=True)
    assert bar[0] == 3
    bar[0] = 0
    with pytest.raises(emu.EmulatedLaunchError, match="divergent __ballot_sync"):
        kernel((3,), (32,), (bar, np.int32(1)), enable_cooperative_groups=True)
