// Hashing shared by every kernel file (included textually: NVRTC has no
// standard headers, and keras_sparse/kernel_sources.py expands the include).
// Must stay bit-identical to keras_sparse/table/keys.py (mix64, bucket_pair,
// digest): the CPU twin and the GPU table place keys in the same buckets.
#ifndef KS_HASH_CUH
#define KS_HASH_CUH

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

#endif  // KS_HASH_CUH
