// Kernels for keras_sparse.table.CupyTable, compiled at run time by CuPy
// (NVRTC) -- so no standard headers; 64-bit types are spelled out.
//
// Hashing must stay bit-identical to keras_sparse/table/keys.py (mix64,
// bucket_pair, digest): the CPU twin and the GPU table place keys in the same
// buckets.  Table layout: keys[int64 capacity], digest[uint8 capacity], slot
// == row == bucket * S + position.  Empty slots hold a per-bucket sentinel key
// that can never be probed in that bucket, so lookups need no state array.

#include "ks_hash.cuh"

extern "C" __global__ void ks_hash(const i64* __restrict__ keys, i64 n, u64 salt, u64 nb,
                                   i64* __restrict__ b1, i64* __restrict__ b2,
                                   unsigned char* __restrict__ dg) {
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  u64 h = ks_mix64((u64)keys[i], salt);
  ks_buckets(h, nb, &b1[i], &b2[i]);
  dg[i] = (unsigned char)(h & 0xFF);
}

// One thread per key: compare the bucket's digests (L1-resident bytes) and
// verify candidate keys.  A key lives in at most one slot, so stop at a match.
extern "C" __global__ void ks_lookup(const i64* __restrict__ keys, i64 n, u64 salt, u64 nb,
                                     int S, const i64* __restrict__ tkeys,
                                     const unsigned char* __restrict__ tdig,
                                     i64* __restrict__ rows) {
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  i64 k = keys[i];
  u64 h = ks_mix64((u64)k, salt);
  i64 b[2];
  ks_buckets(h, nb, &b[0], &b[1]);
  unsigned char d = (unsigned char)(h & 0xFF);
  i64 found = -1;
  for (int c = 0; c < 2 && found < 0; ++c) {
    i64 base = b[c] * (i64)S;
    for (int j = 0; j < S; ++j) {
      if (tdig[base + j] == d && tkeys[base + j] == k) {
        found = base + j;
        break;
      }
    }
  }
  rows[i] = found;
}

// Tile probe: 16 lanes (half a warp) per key.  Each lane owns one position of
// a 16-slot chunk of the bucket; for S % 16 == 0 the chunk's 16 digests come
// in with one 16-byte vector load (same address in all lanes of the tile, so
// one transaction), else with coalesced byte loads.  Lanes whose digest
// matches load and compare their slot's key; a tile ballot picks the lowest
// matching position.  Loop trip counts depend only on S, never on data, so
// all 32 lanes of a warp always reach the same __ballot_sync (no divergent
// collective), and out-of-range keys participate with active == false.
// Result == ks_lookup == the CPU twin's probe (a key lives in <= 1 slot).
#define KS_TILE 16

__device__ __forceinline__ unsigned int ks_byte_of(uint4 v, int j) {
  unsigned int w = (j < 4) ? v.x : (j < 8) ? v.y : (j < 12) ? v.z : v.w;
  return (w >> (8 * (j & 3))) & 0xFFu;
}

extern "C" __global__ void ks_find(const i64* __restrict__ keys, i64 n, u64 salt, u64 nb,
                                   int S, const i64* __restrict__ tkeys,
                                   const unsigned char* __restrict__ tdig,
                                   i64* __restrict__ rows) {
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const i64 i = t / KS_TILE;                 // key of this tile
  const int lane = (int)(threadIdx.x & (KS_TILE - 1));
  const int shift = (int)(threadIdx.x & 31) & ~(KS_TILE - 1);  // 0 or 16
  const bool active = i < n;
  i64 k = active ? keys[i] : 0;
  u64 h = ks_mix64((u64)k, salt);
  i64 b[2];
  ks_buckets(h, nb, &b[0], &b[1]);
  const unsigned int d = (unsigned int)(h & 0xFF);
  i64 found = -1;
  const bool vec = (S % KS_TILE) == 0;
  for (int c = 0; c < 2; ++c) {
    const i64 base = b[c] * (i64)S;
    for (int off = 0; off < S; off += KS_TILE) {
      const int j = off + lane;
      bool match = false;
      if (active && j < S) {
        unsigned int dj;
        if (vec) {
          uint4 v = *reinterpret_cast<const uint4*>(tdig + base + off);
          dj = ks_byte_of(v, lane);
        } else {
          dj = tdig[base + j];
        }
        match = (dj == d) && (tkeys[base + j] == k);
      }
      unsigned int bal = (__ballot_sync(0xFFFFFFFFu, match) >> shift) & 0xFFFFu;
      if (found < 0 && bal != 0u) found = base + off + (__ffs((int)bal) - 1);
    }
  }
  if (active && lane == 0) rows[i] = found;
}

// One placement round for keys whose chosen bucket is compact (the host
// checks holey[] first and uses the generic path otherwise; see
// ArrayTable.holey): live slots are exactly [0, load[b]), so the r-th key of
// this round choosing b takes position load[b] + r.
//
// comp[i] = (bucket << sh) | arrival, sorted ascending (host cp.sort), so
// equal buckets are adjacent and ordered by arrival.  rank = distance to the
// group start, found by walking back at most S steps (ranks >= S - load are
// refused anyway).  load[] is only read here; the host adds the placed counts
// afterwards, so every thread sees the round-start loads like the CPU twin.
// Each (bucket, rank) pair is unique, so the slots written are distinct: no
// two threads write the same slot and no atomics are needed.
extern "C" __global__ void ks_claim_compact(
    const i64* __restrict__ comp, i64 n, int sh, int S, const i64* __restrict__ load,
    const i64* __restrict__ cand, const i64* __restrict__ ak,
    const unsigned char* __restrict__ dg, const i64* __restrict__ new_score,
    i64* __restrict__ tkeys, unsigned char* __restrict__ tdig, i64* __restrict__ tscore,
    i64* __restrict__ slots, unsigned char* __restrict__ ok) {
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const i64 c = comp[i];
  const i64 bkt = c >> sh;
  const i64 arrival = c & ((1LL << sh) - 1);
  const i64 free_slots = (i64)S - load[bkt];
  i64 rank = 0;
  while (rank < free_slots && i - rank - 1 >= 0 && (comp[i - rank - 1] >> sh) == bkt) ++rank;
  if (rank < free_slots) {
    const i64 slot = bkt * (i64)S + load[bkt] + rank;
    const i64 u = cand[arrival];  // index of the key in ak/dg/new_score
    tkeys[slot] = ak[u];
    tdig[slot] = dg[u];
    tscore[slot] = new_score[u];
    slots[arrival] = slot;
    ok[arrival] = 1;
  } else {
    slots[arrival] = -1;
    ok[arrival] = 0;
  }
}

// arr[idx[i]] += val[i] with duplicates accumulating (LFU scores, sketch).
// Two's complement makes the unsigned atomic correct for signed values.
extern "C" __global__ void ks_add_i64(i64* arr, const i64* __restrict__ idx,
                                      const i64* __restrict__ val, i64 n) {
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  atomicAdd((u64*)&arr[idx[i]], (u64)val[i]);
}

extern "C" __global__ void ks_add_u32(unsigned int* arr, const i64* __restrict__ idx,
                                      const unsigned int* __restrict__ val, i64 n) {
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  atomicAdd(&arr[idx[i]], val[i]);
}

// Every eviction round of one lookup_or_insert in one launch (one block), so
// the host pays one launch instead of a dozen CuPy operations and host syncs
// per round.  Same result as repeating ArrayTable._evict_round on the keys
// pend[0..m) (indices into ak/dg/b1/b2, in arrival order): per round, each
// pending key takes the first lowest-score slot of [its first bucket's
// lanes, its second's], protected slots counting as INT64_MAX; a key whose
// pick is protected overflows; of the keys picking one slot the earliest
// wins, and the others try again next round (the slot is protected now).
// All keys picking a bucket pick that bucket's one minimum slot, so bids are
// kept per bucket (claim[], all KS_NO_BID between rounds).  Protected: slots
// this call touched, marked in prot[] or, with prot_is_step (LRU), holding
// score == step (winners get score step, so they are protected at once).
// won_round[i]: -1 pending, -2 overflowed, else the round key i won in.
#define KS_NO_BID 0x7FFFFFFFFFFFFFFFLL

extern "C" __global__ void ks_evict_rounds(
    const i64* __restrict__ pend, i64 m, int S, int rounds, const i64* __restrict__ b1,
    const i64* __restrict__ b2, const i64* __restrict__ ak,
    const unsigned char* __restrict__ dg, const i64* __restrict__ new_score,
    int score_per_key, i64 step, int prot_is_step, unsigned char* __restrict__ prot,
    i64* __restrict__ tkeys,
    unsigned char* __restrict__ tdig, i64* __restrict__ tscore, i64* __restrict__ claim,
    i64* __restrict__ victim, int* __restrict__ won_round, i64* __restrict__ ev_key,
    i64* __restrict__ res, i64* __restrict__ overflows) {
  __shared__ int bidders;
  for (int r = 0; r < rounds; ++r) {
    if (threadIdx.x == 0) bidders = 0;
    __syncthreads();
    for (i64 i = threadIdx.x; i < m; i += blockDim.x) {
      if (won_round[i] != -1) continue;
      const i64 u = pend[i];
      i64 best = KS_NO_BID, slot = -1;
      for (int c = 0; c < 2; ++c) {
        const i64 base = (c == 0 ? b1[u] : b2[u]) * (i64)S;
        for (int j = 0; j < S; ++j) {
          const i64 t = tscore[base + j];
          const bool p = prot_is_step ? t == step : prot[base + j] != 0;
          const i64 sc = p ? KS_NO_BID : t;
          if (slot < 0 || sc < best) {
            best = sc;
            slot = base + j;
          }
        }
      }
      if (prot_is_step ? tscore[slot] == step : prot[slot] != 0) {
        // both buckets hold only keys of this call
        won_round[i] = -2;
        atomicAdd((u64*)overflows, 1ULL);
        continue;
      }
      victim[i] = slot;
      atomicMin(&claim[slot / S], i);
      atomicAdd(&bidders, 1);
    }
    __syncthreads();
    if (bidders == 0) break;  // read by every thread before the next reset
    for (i64 i = threadIdx.x; i < m; i += blockDim.x) {
      if (won_round[i] != -1 || claim[victim[i] / S] != i) continue;
      const i64 s = victim[i], u = pend[i];
      ev_key[i] = tkeys[s];
      tkeys[s] = ak[u];
      tdig[s] = dg[u];
      tscore[s] = score_per_key ? new_score[u] : new_score[0];
      if (!prot_is_step) prot[s] = 1;
      res[u] = s;
      won_round[i] = r;
    }
    __syncthreads();
    for (i64 i = threadIdx.x; i < m; i += blockDim.x) {
      if (won_round[i] == -1 || won_round[i] == r) claim[victim[i] / S] = KS_NO_BID;
    }
    __syncthreads();
  }
}
