/* CPU helpers of the sparse row update on PyTorch (keras_sparse.ops.native_rows)
 * and TensorFlow (included by tf_rows_op.cc).
 *
 * Built on first use by the system C compiler into a shared library and
 * called through ctypes on the data of contiguous CPU tensors. Each helper
 * replaces a chain of eager torch operations by one pass over the batch,
 * with the same floating-point operations in the same order (the library is
 * built with -ffp-contract=off), so results equal the torch route's to the
 * bit.
 */
#include <stdint.h>
#include <string.h>

/* The row loops are compiled for wider vector units too, the version
 * picked when the library loads (function multiversioning: GCC 12 or later
 * on x86-64 Linux with glibc, whose loader resolves the choice):
 * a cache shared by machines of different CPUs stays safe, and since the
 * loops use only correctly rounded operations (add, multiply, divide,
 * square root; no contraction into fused multiply-adds) every version
 * computes the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    __GNUC__ >= 12 && defined(__linux__) && defined(__GLIBC__)
#define KS_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KS_VECTOR_CLONES
#endif

/* Positions ahead whose row is prefetched (random accesses). */
#define KS_AHEAD 16

/* Slots of the dedup hash for n ids: the power of two >= 2n (so at most
 * half full), at least 16. Sets *shift to 64 - log2(slots). */
static int64_t ks_dedup_slots(int64_t n, int *shift) {
  int64_t slots = 16;
  int bits = 4;
  while (slots < 2 * n) {
    slots <<= 1;
    ++bits;
  }
  *shift = 64 - bits;
  return slots;
}

/* int32 scratch entries that ks_distinct_sum_f32 needs for n ids. */
int64_t ks_dedup_scratch_entries(int64_t n) {
  int shift;
  return ks_dedup_slots(n, &shift) + n;
}

/* Distinct valid ids of a batch and their gradients summed.
 *
 * ids[n], valid[n] (0/1 bytes, or NULL for all valid), grads[n / bag][dim]
 * (position p reads gradient row p / bag). scratch: any int32 memory of
 * ks_dedup_scratch_entries(n) entries. Writes unique[count], ordered by
 * each id's last position (the order in which the torch route's dedup lists
 * them, so that both routes run the optimizer on the same rows at the same
 * places), and summed[count][dim], each row 0 plus the gradients of its
 * positions in position order (as index_add_ into zeros sums them). Returns
 * count, or -1 - p for the first valid position p whose id is outside
 * [0, rows) (then nothing but scratch was written).
 *
 * Duplicates are found in an open-addressing hash sized by the batch, not
 * the table: its slots hold the last position of their id (the id itself is
 * read back from ids), so it stays in cache whatever the table's size, where
 * an entry per table row would miss the cache once tables outgrow it.
 */
KS_VECTOR_CLONES
int64_t ks_distinct_sum_strided_f32(const int64_t *ids, const uint8_t *valid,
                                    int64_t n, int64_t rows, const float *grads,
                                    int64_t stride, int64_t bag, int64_t dim,
                                    int32_t *scratch, int64_t *unique,
                                    float *summed) {
  int shift;
  const int64_t slots = ks_dedup_slots(n, &shift);
  const uint64_t mask = (uint64_t)slots - 1;
  int32_t *last = scratch;          /* slot -> last position, or -1 (empty) */
  int32_t *where = scratch + slots; /* position -> its id's slot */
  memset(last, 0xff, (size_t)slots * sizeof(int32_t));
  for (int64_t p = 0; p < n; ++p) {
    if (valid && !valid[p]) continue;
    const int64_t id = ids[p];
    if (id < 0 || id >= rows) return -1 - p;
    /* Fibonacci hashing: the top bits of a multiply spread nearby ids. */
    uint64_t h = ((uint64_t)id * 0x9E3779B97F4A7C15ull) >> shift;
    for (;;) {
      const int32_t q = last[h];
      if (q < 0 || ids[q] == id) break;
      h = (h + 1) & mask;
    }
    last[h] = (int32_t)p;
    where[p] = (int32_t)h;
  }
  /* At its last position an id takes the next slot, stored as -1 - slot. */
  int64_t count = 0;
  for (int64_t p = 0; p < n; ++p) {
    if (valid && !valid[p]) continue;
    const int32_t h = where[p];
    if (last[h] == (int32_t)p) {
      unique[count] = ids[p];
      last[h] = (int32_t)(-1 - count);
      ++count;
    }
  }
  memset(summed, 0, (size_t)(count * dim) * sizeof(float));
  for (int64_t p = 0; p < n; ++p) {
    if (valid && !valid[p]) continue;
    float *out = summed + (int64_t)(-1 - last[where[p]]) * dim;
    const float *g = grads + (p / bag) * stride;
    for (int64_t j = 0; j < dim; ++j) out[j] += g[j];
  }
  return count;
}

/* ks_distinct_sum_strided_f32 of contiguous gradients (stride = dim). The
 * strided form reads a table's columns of a wider gradient (PyTorch: its
 * slice of the concatenated bags' gradient) without copying them first. */
int64_t ks_distinct_sum_f32(const int64_t *ids, const uint8_t *valid,
                            int64_t n, int64_t rows, const float *grads,
                            int64_t bag, int64_t dim, int32_t *scratch,
                            int64_t *unique, float *summed) {
  return ks_distinct_sum_strided_f32(ids, valid, n, rows, grads, dim, bag, dim,
                                     scratch, unique, summed);
}

/* dst[rows[i]][:] = src[i][:] for i < count (rows distinct). */
void ks_scatter_rows_f32(float *dst, const int64_t *rows, const float *src,
                         int64_t count, int64_t dim) {
  for (int64_t i = 0; i < count; ++i) {
    if (i + KS_AHEAD < count) __builtin_prefetch(dst + rows[i + KS_AHEAD] * dim, 1);
    memcpy(dst + rows[i] * dim, src + i * dim, (size_t)dim * sizeof(float));
  }
}

/* The first position p < n with valid[p] (0/1 bytes) whose id is outside
 * [0, rows), or -1. */
int64_t ks_first_outside(const int32_t *ids, const uint8_t *valid, int64_t n,
                         int64_t rows) {
  for (int64_t p = 0; p < n; ++p)
    if (valid[p] && (ids[p] < 0 || ids[p] >= rows)) return p;
  return -1;
}

/* dst[p][:] = table[ids[p]][:] where valid[p], else zeros, for lo <= p < hi
 * (ids checked by ks_first_outside). The row KS_AHEAD positions on is
 * prefetched while this one is copied, so that the cache misses of a large
 * table overlap instead of following each other. */
void ks_gather_rows_f32(const float *table, const int32_t *ids,
                        const uint8_t *valid, int64_t lo, int64_t hi,
                        int64_t dim, float *dst) {
  for (int64_t p = lo; p < hi; ++p) {
    if (p + KS_AHEAD < hi && valid[p + KS_AHEAD])
      __builtin_prefetch(table + (int64_t)ids[p + KS_AHEAD] * dim, 0);
    if (valid[p])
      memcpy(dst + p * dim, table + (int64_t)ids[p] * dim,
             (size_t)dim * sizeof(float));
    else
      memset(dst + p * dim, 0, (size_t)dim * sizeof(float));
  }
}

/* dst[b][:] = the sum of table[ids[p]][:] over the valid positions p of
 * bag b (positions b * bag .. b * bag + bag - 1), for lo <= b < hi (ids
 * checked by ks_first_outside): 0 plus the rows in position order, which
 * is how TensorFlow's reduce_sum adds a small bag (a skipped position adds
 * nothing: a sum that starts at +0 is never -0, so adding +0 changes no
 * bit). Rows ahead are prefetched as in ks_gather_rows_f32. */
void ks_gather_sums_f32(const float *table, const int32_t *ids,
                        const uint8_t *valid, int64_t bag, int64_t lo,
                        int64_t hi, int64_t dim, float *dst) {
  const int64_t end = hi * bag;
  for (int64_t b = lo; b < hi; ++b) {
    float *out = dst + b * dim;
    for (int64_t j = 0; j < dim; ++j) out[j] = 0.0f;
    for (int64_t p = b * bag; p < (b + 1) * bag; ++p) {
      if (p + KS_AHEAD < end && valid[p + KS_AHEAD])
        __builtin_prefetch(table + (int64_t)ids[p + KS_AHEAD] * dim, 0);
      if (!valid[p]) continue;
      const float *row = table + (int64_t)ids[p] * dim;
      for (int64_t j = 0; j < dim; ++j) out[j] += row[j];
    }
  }
}

/* The optimizer updates below change rows[i] of the table and its slots in
 * place from grads[i] (summed gradients, one row per distinct row), for
 * i < count, rows distinct and in range. Each is the arithmetic of the
 * optimizer (keras_sparse.optimizers), operation for operation, with a
 * correctly rounded square root (torch's and TensorFlow's vectorized ones
 * may round an ulp apart). Rows ahead are prefetched:
 * a table far larger than the caches misses on nearly every row, and the
 * prefetches let those misses overlap. */
#define KS_PREFETCH_ROW(ptr, i)                                               \
  do {                                                                        \
    if ((i) + KS_AHEAD < count)                                               \
      __builtin_prefetch((ptr) + rows[(i) + KS_AHEAD] * dim, 1);              \
  } while (0)

/* SGD: row - lr * g. */
KS_VECTOR_CLONES
void ks_sgd_rows_f32(float *table, const int64_t *rows, const float *grads,
                     int64_t count, int64_t dim, float lr) {
  for (int64_t i = 0; i < count; ++i) {
    KS_PREFETCH_ROW(table, i);
    float *row = table + rows[i] * dim;
    const float *g = grads + i * dim;
    for (int64_t j = 0; j < dim; ++j) row[j] = row[j] - lr * g[j];
  }
}

/* Adagrad: acc + g * g, then row - lr * g / sqrt(acc + eps). */
KS_VECTOR_CLONES
void ks_adagrad_rows_f32(float *table, float *acc, const int64_t *rows,
                         const float *grads, int64_t count, int64_t dim,
                         float lr, float eps) {
  for (int64_t i = 0; i < count; ++i) {
    KS_PREFETCH_ROW(table, i);
    KS_PREFETCH_ROW(acc, i);
    float *row = table + rows[i] * dim;
    float *a = acc + rows[i] * dim;
    const float *g = grads + i * dim;
    for (int64_t j = 0; j < dim; ++j) {
      const float sum = a[j] + g[j] * g[j];
      a[j] = sum;
      row[j] = row[j] - lr * g[j] / __builtin_sqrtf(sum + eps);
    }
  }
}

/* Adam: m + (g - m) * keep_1, v + (g * g - v) * keep_2, then
 * row - (m * alpha) / (sqrt(v) + eps); alpha is the step's bias-corrected
 * learning rate. */
KS_VECTOR_CLONES
void ks_adam_rows_f32(float *table, float *momentum, float *velocity,
                      const int64_t *rows, const float *grads, int64_t count,
                      int64_t dim, float keep_1, float keep_2, float alpha,
                      float eps) {
  for (int64_t i = 0; i < count; ++i) {
    KS_PREFETCH_ROW(table, i);
    KS_PREFETCH_ROW(momentum, i);
    KS_PREFETCH_ROW(velocity, i);
    float *row = table + rows[i] * dim;
    float *m = momentum + rows[i] * dim;
    float *v = velocity + rows[i] * dim;
    const float *g = grads + i * dim;
    for (int64_t j = 0; j < dim; ++j) {
      const float new_m = m[j] + (g[j] - m[j]) * keep_1;
      const float new_v = v[j] + (g[j] * g[j] - v[j]) * keep_2;
      m[j] = new_m;
      v[j] = new_v;
      row[j] = row[j] - (new_m * alpha) / (__builtin_sqrtf(new_v) + eps);
    }
  }
}

/* FTRL-Proximal (keras_sparse.optimizers.Ftrl), with p = -learning_rate_power:
 * acc' = acc + g * g, then
 * linear' = linear + (g + shrink2 * row) - ((acc'^p - acc^p) / lr) * row and
 * row' = (clip(linear', -l1, l1) - linear') / (acc'^p / lr + 2 * l2_reg),
 * where shrink2 is 2 * l2_shrinkage and l2_reg is l2 + beta / (2 * lr), as
 * the Python route computes them. The power is a correctly rounded square
 * root at p = 0.5 (the default), else the C library's powf: with a root the
 * row loop vectorizes, and either way every clone computes the same bits. */
static inline __attribute__((always_inline)) void ks_ftrl_row(
    float *row, float *a, float *z, const float *g, int64_t dim, float lr,
    float shrink2, float p, float l1, float l2_reg, int root) {
  for (int64_t j = 0; j < dim; ++j) {
    const float old_acc = a[j];
    const float new_acc = old_acc + g[j] * g[j];
    const float power_new =
        root ? __builtin_sqrtf(new_acc) : __builtin_powf(new_acc, p);
    const float power_old =
        root ? __builtin_sqrtf(old_acc) : __builtin_powf(old_acc, p);
    const float linear =
        (z[j] + (g[j] + shrink2 * row[j])) - ((power_new - power_old) / lr) * row[j];
    const float clipped = linear < -l1 ? -l1 : linear > l1 ? l1 : linear;
    a[j] = new_acc;
    z[j] = linear;
    row[j] = (clipped - linear) / (power_new / lr + 2.0f * l2_reg);
  }
}

KS_VECTOR_CLONES
void ks_ftrl_rows_f32(float *table, float *acc, float *lin, const int64_t *rows,
                      const float *grads, int64_t count, int64_t dim, float lr,
                      float shrink2, float p, float l1, float l2_reg) {
  const int root = p == 0.5f;
  for (int64_t i = 0; i < count; ++i) {
    KS_PREFETCH_ROW(table, i);
    KS_PREFETCH_ROW(acc, i);
    KS_PREFETCH_ROW(lin, i);
    float *row = table + rows[i] * dim;
    float *a = acc + rows[i] * dim;
    float *z = lin + rows[i] * dim;
    const float *g = grads + i * dim;
    if (root)
      ks_ftrl_row(row, a, z, g, dim, lr, shrink2, p, l1, l2_reg, 1);
    else
      ks_ftrl_row(row, a, z, g, dim, lr, shrink2, p, l1, l2_reg, 0);
  }
}

/* Row-wise Adagrad: one accumulator per row (acc[num_rows][1]).
 * acc + mean(g * g), the mean a sum in column order divided by dim, then
 * row - lr * g / sqrt(acc + eps) with the one root of the row. The Python
 * route's mean may sum in another order (a vectorized reduction), so the
 * two may differ by float32 rounding of the sum. */
KS_VECTOR_CLONES
void ks_rowwise_adagrad_rows_f32(float *table, float *acc, const int64_t *rows,
                                 const float *grads, int64_t count,
                                 int64_t dim, float lr, float eps) {
  for (int64_t i = 0; i < count; ++i) {
    KS_PREFETCH_ROW(table, i);
    if (i + KS_AHEAD < count) __builtin_prefetch(acc + rows[i + KS_AHEAD], 1);
    float *row = table + rows[i] * dim;
    const float *g = grads + i * dim;
    float squares = 0.0f;
    for (int64_t j = 0; j < dim; ++j) squares += g[j] * g[j];
    const float sum = acc[rows[i]] + squares / (float)dim;
    acc[rows[i]] = sum;
    const float root = __builtin_sqrtf(sum + eps);
    for (int64_t j = 0; j < dim; ++j) row[j] = row[j] - lr * g[j] / root;
  }
}

/* The passes above by rule code, as the JAX call and the TensorFlow ops
 * name them (keras_sparse.ops.optimizer_rules: 0 SGD, 1 Adagrad, 2 Adam,
 * 3 row-wise Adagrad, 4 Ftrl), so that the float32 and 16-bit handlers of
 * both run one list of rules. */
#define KS_RULES 5

/* Arrays (the table, then its slots) that `rule` updates; -1 if unknown. */
int ks_rule_arrays(int rule) {
  static const int arrays[KS_RULES] = {1, 2, 3, 2, 3};
  return rule >= 0 && rule < KS_RULES ? arrays[rule] : -1;
}

/* Float scalars that `rule` takes per step; -1 if unknown. */
int ks_rule_scalars(int rule) {
  static const int scalars[KS_RULES] = {1, 2, 4, 2, 5};
  return rule >= 0 && rule < KS_RULES ? scalars[rule] : -1;
}

/* Runs `rule`'s pass on arrays[0..ks_rule_arrays(rule)) with scalars k. */
void ks_rule_rows_f32(int rule, float *const *a, const int64_t *rows,
                      const float *g, int64_t count, int64_t dim,
                      const float *k) {
  switch (rule) {
    case 0:
      ks_sgd_rows_f32(a[0], rows, g, count, dim, k[0]);
      break;
    case 1:
      ks_adagrad_rows_f32(a[0], a[1], rows, g, count, dim, k[0], k[1]);
      break;
    case 2:
      ks_adam_rows_f32(a[0], a[1], a[2], rows, g, count, dim, k[0], k[1], k[2],
                       k[3]);
      break;
    case 3:
      ks_rowwise_adagrad_rows_f32(a[0], a[1], rows, g, count, dim, k[0], k[1]);
      break;
    case 4:
      ks_ftrl_rows_f32(a[0], a[1], a[2], rows, g, count, dim, k[0], k[1], k[2],
                       k[3], k[4]);
      break;
  }
}

/* 16-bit tables: widening and rounding rows around the passes above. */
#include "cpu_rounding.c"
