// Kernels for keras_sparse.table.CupyTable, compiled at run time by CuPy
// (NVRTC) -- so no standard headers; 64-bit types are spelled out.
//
// Hashing must stay bit-identical to keras_sparse/table/keys.py (mix64,
// bucket_pair, digest): the CPU twin and the GPU table place keys in the same
// buckets.  Table layout: keys[int64 capacity], digest[uint8 capacity], slot
// == row == bucket * S + position.  Empty slots hold a per-bucket sentinel key
// that can never be probed in that bucket, so lookups need no state array.

typedef unsigned long long u64;
typedef long long i64;

__device__ __forceinline__ u64 ks_mix64(u64 z, u64 salt) {
  z ^= salt;
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ULL;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return z;
}

__device__ __forceinline__ void ks_buckets(u64 h, u64 nb, i64* b1, i64* b2) {
  u64 a = ((h >> 32) * nb) >> 32;                  // Lemire range reduction
  u64 off = ((h & 0xFFFFFFFFULL) * (nb - 1)) >> 32;  // second bucket != first
  u64 b = a + off + 1;
  if (b >= nb) b -= nb;
  *b1 = (i64)a;
  *b2 = (i64)b;
}

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
