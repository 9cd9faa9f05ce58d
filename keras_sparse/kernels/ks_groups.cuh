// The threads that run one hash-table call (insert_call.cu), as its phases
// see them: a group of KS_FT-thread blocks with a barrier, an exclusive
// prefix sum over all its threads, stable compaction and a stable radix
// sort.  KsBlock is one block; KsGrid is every block of a cooperative
// launch.  Included textually (keras_sparse/kernel_sources.py expands it).
#ifndef KS_GROUPS_CUH
#define KS_GROUPS_CUH

#include "ks_hash.cuh"

#define KS_FT 512  // threads of a block (THREADS in keras_sparse/table/insert_call.py)

__device__ __forceinline__ i64 ks_imin(i64 a, i64 b) { return a < b ? a : b; }

// Exclusive prefix sum of one value per thread of the block; *total gets
// the block's sum (every thread).  Ends with a barrier, so its buffers may
// be reused at once.
__device__ i64 ks_block_scan(i64 v, i64* total) {
  __shared__ i64 s_v[KS_FT];
  __shared__ i64 s_w[KS_FT / 32 + 1];
  const int t = threadIdx.x;
  s_v[t] = v;
  __syncthreads();
  if ((t & 31) == 0) {
    i64 run = 0;
    for (int j = 0; j < 32; ++j) {
      const i64 x = s_v[t + j];
      s_v[t + j] = run;
      run += x;
    }
    s_w[t >> 5] = run;
  }
  __syncthreads();
  if (t == 0) {
    i64 run = 0;
    for (int w = 0; w < KS_FT / 32; ++w) {
      const i64 x = s_w[w];
      s_w[w] = run;
      run += x;
    }
    s_w[KS_FT / 32] = run;
  }
  __syncthreads();
  const i64 r = s_v[t] + s_w[t >> 5];
  *total = s_w[KS_FT / 32];
  __syncthreads();
  return r;
}

// The threads that run one call, as the phases below see them: rank t of
// nt, a barrier, an exclusive prefix sum over all of them, 16 * nt ints of
// sort counts and 5 call counters (KS_C_*).  KsBlock: one block (a call of
// up to ~64K keys; several such calls share a launch, one block each).
// KsGrid: several blocks of a cooperative launch (larger calls), the same
// phases with barriers across those blocks, so a call's result does not depend on
// which of the two runs it.
#define KS_C_OVER 0
#define KS_C_MISS 1
#define KS_C_REJ 2
#define KS_C_UNUSED 3
#define KS_C_HIT_ROWS 4

struct KsBlock {
  i64 t, nt;
  int* cnt;
  i64* c;
  __device__ void sync() { __syncthreads(); }
  __device__ i64 scan(i64 v, i64* total) { return ks_block_scan(v, total); }
};

// A team's scratch (int64 words, zeroed once when allocated; the barrier's
// count returns to zero after each barrier, its generation only grows):
// [0] barrier arrivals and generation (two uint32), [1..5] counters, [8, 8
// + 2 * blocks) block totals (two sets, used in turn), then the sort counts.
#define KS_G_TOTALS 8

// KsGrid: `blocks` consecutive blocks of a cooperative launch (a team; the
// whole grid when there is one team), its barrier and prefix sums over
// their threads only, so teams run their calls side by side.
struct KsGrid {
  i64 t, nt;
  int* cnt;
  i64* c;
  unsigned int* bar;
  i64* totals;
  int parity;
  int blocks, rank;  // the team's blocks, this block's rank among them

  __device__ KsGrid(i64* gws, int team_blocks) {
    blocks = team_blocks;
    rank = blockIdx.x % team_blocks;
    t = (i64)rank * KS_FT + threadIdx.x;
    nt = (i64)blocks * KS_FT;
    bar = (unsigned int*)gws;
    c = gws + 1;
    totals = gws + KS_G_TOTALS;
    cnt = (int*)(gws + KS_G_TOTALS + 2 * (i64)blocks);
    parity = 0;
  }

  // Every thread of the team arrives before any leaves (the launch is
  // cooperative: all blocks are resident).  Thread 0 of each block counts
  // its block in; the last one in resets the count and opens the next
  // generation.
  __device__ void sync() {
    __syncthreads();
    if (threadIdx.x == 0) {
      volatile unsigned int* gen = bar + 1;
      const unsigned int g = *gen;
      __threadfence();
      if (atomicAdd(bar, 1u) == (unsigned int)blocks - 1) {
        atomicExch(bar, 0u);
        __threadfence();
        atomicAdd(bar + 1, 1u);
      } else {
        while (*gen == g) __nanosleep(32);
      }
      __threadfence();
    }
    __syncthreads();
  }

  // Block sums, one team barrier, then each block scans the blocks' sums
  // (one per thread: blocks <= KS_FT) for the sum of those before it.
  // The sums alternate between two sets, so a block still reading this
  // scan's set cannot see the next scan's writes (those come after the
  // next barrier).
  __device__ i64 scan(i64 v, i64* total) {
    i64 mine;
    const i64 r = ks_block_scan(v, &mine);
    i64* set = totals + parity * (i64)blocks;
    parity ^= 1;
    if (threadIdx.x == 0) set[rank] = mine;
    sync();
    const i64 x = threadIdx.x < blocks ? *(volatile i64*)&set[threadIdx.x] : 0;
    const i64 before = ks_block_scan(x, total);
    // Read before the next scan's ks_block_scan barriers let a thread write it.
    __shared__ i64 s_before;
    if (threadIdx.x == rank) s_before = before;
    __syncthreads();
    return r + s_before;
  }
};

// Contiguous share [*lo, *hi) of m items for this thread (keeps order).
template <class G>
__device__ __forceinline__ void ks_share(const G& g, i64 m, i64* lo, i64* hi) {
  const i64 c = (m + g.nt - 1) / g.nt;
  *lo = ks_imin(m, g.t * c);
  *hi = ks_imin(m, *lo + c);
}

// Stable compaction: emit(i, base + rank) for each i in [0, m) with pred(i),
// ranks in order of i; returns the count.  emit must not change what pred
// reads (pred runs twice).
template <class G, class Pred, class Emit>
__device__ i64 ks_compact(G& g, i64 m, i64 base, Pred pred, Emit emit) {
  i64 lo, hi, cnt = 0, total;
  ks_share(g, m, &lo, &hi);
  for (i64 i = lo; i < hi; ++i) cnt += pred(i) ? 1 : 0;
  i64 o = base + g.scan(cnt, &total);
  for (i64 i = lo; i < hi; ++i)
    if (pred(i)) emit(i, o++);
  g.sync();
  return total;
}

// Stable LSD radix sort of m non-negative words below 2**bits by their bits
// from `from` up, 4 bits a pass, ping-ponging between a and b; returns the
// buffer holding the result.  Words already in order of their bits below
// `from` end in order of the whole word.
template <class G>
__device__ i64* ks_sort(G& g, i64* a, i64* b, i64 m, int from, int bits) {
  int* cnt = g.cnt;
  const i64 t = g.t, nt = g.nt;
  i64 lo, hi, total;
  ks_share(g, m, &lo, &hi);
  for (int s = from; s < bits; s += 4) {
    int local[16];
    for (int d = 0; d < 16; ++d) local[d] = 0;
    for (i64 i = lo; i < hi; ++i) ++local[(a[i] >> s) & 15];
    for (int d = 0; d < 16; ++d) cnt[d * nt + t] = local[d];
    g.sync();
    // Digit-major, thread-minor offsets: thread t owns entries [16t, 16t+16).
    i64 mine = 0;
    for (int q = 0; q < 16; ++q) mine += cnt[16 * t + q];
    i64 off = g.scan(mine, &total);
    for (int q = 0; q < 16; ++q) {
      const int x = cnt[16 * t + q];
      cnt[16 * t + q] = (int)off;
      off += x;
    }
    g.sync();
    for (int d = 0; d < 16; ++d) local[d] = cnt[d * nt + t];
    for (i64 i = lo; i < hi; ++i) b[local[(a[i] >> s) & 15]++] = a[i];
    g.sync();
    i64* x = a;
    a = b;
    b = x;
  }
  return a;
}

#endif  // KS_GROUPS_CUH
