/* 16-bit tables on the compiled CPU routes (included by cpu_rows.c).
 *
 * The optimizer passes of cpu_rows.c run on float32 rows. A bfloat16 or
 * float16 table (or slot) is updated by widening its touched rows into
 * float32 scratch (ks_widen_rows), running the float32 pass on the scratch,
 * and writing the rows back (ks_narrow_rows): stochastically rounded with
 * the bits of keras_sparse/ops/row_rounding.py (a counter hash of the
 * array's seed, the row and the column), bit for bit, or rounded to
 * nearest. Integer operations and correctly rounded float32 ones only,
 * in the order of the Python route, so every route stores the same bits.
 */
#include <stdint.h>
#include <string.h>

/* Storage kinds of an array: its element type. */
#define KS_FLOAT32 0
#define KS_BFLOAT16 1
#define KS_FLOAT16 2

static inline uint32_t ks_float_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return b;
}

static inline float ks_bits_float(uint32_t b) {
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
}

/* lowbias32: row_rounding.mix32 on the 32-bit word. */
static inline uint32_t ks_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

static inline float ks_f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return ks_bits_float(sign | 0x7F800000u | (man << 13));
  if (exp == 0) /* zero or subnormal: man * 2**-24, exact in float32 */
    return ks_bits_float(sign | ks_float_bits((float)man * 0x1p-24f));
  return ks_bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

/* Round to nearest, ties to even (what a cast does). */
static inline uint16_t ks_f32_to_f16(float x) {
  const uint32_t b = ks_float_bits(x);
  const uint16_t sign = (uint16_t)((b >> 16) & 0x8000);
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00 | ((a >> 13) & 0x3FF); /* NaN */
  if (a >= 0x477FF000u) return sign | 0x7C00; /* from 65520 on: inf */
  if (a < 0x38800000u) { /* below 2**-14: a float16 subnormal, or 0 */
    const int shift = 126 - (int)(a >> 23);
    if (a < 0x00800000u || shift > 24) return sign;
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
    uint32_t q = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1))) ++q;
    return sign | (uint16_t)q;
  }
  uint32_t q = ((a >> 23) - 112) << 10 | ((a >> 13) & 0x3FF);
  const uint32_t rest = a & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (q & 1))) ++q;
  return sign | (uint16_t)q;
}

static inline uint16_t ks_f32_to_bf16(float x) {
  const uint32_t b = ks_float_bits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40);
  return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1)) >> 16);
}

/* x stochastically rounded with the random word `noise`
 * (row_rounding._round_bfloat16 / _round_float16). */
static inline uint16_t ks_stochastic_16(float x, uint32_t noise, int kind) {
  if ((ks_float_bits(x) & 0x7F800000u) == 0x7F800000u) /* inf, NaN: a cast */
    return kind == KS_BFLOAT16 ? ks_f32_to_bf16(x) : ks_f32_to_f16(x);
  if (kind == KS_BFLOAT16)
    return (uint16_t)((ks_float_bits(x) + (noise & 0xFFFF)) >> 16);
  const float magnitude = __builtin_fabsf(x);
  int32_t exponent = (int32_t)((ks_float_bits(magnitude) >> 23) & 0xFF) - 127;
  if (exponent < -14) exponent = -14; /* float16's subnormal spacing 2**-24 */
  const float ulp = ks_bits_float((uint32_t)(exponent - 10 + 127) << 23);
  const float inverse = ks_bits_float((uint32_t)(10 - exponent + 127) << 23);
  const float fraction = (float)(noise & 0x1FFF) * 0x1p-13f;
  const float scaled = magnitude * inverse;
  float rounded = __builtin_floorf(scaled + fraction) * ulp;
  if (x < 0) rounded = -rounded;
  return ks_f32_to_f16(rounded);
}

/* dst[i][:] = src[rows[i]][:] as float32, for i < count (src of `kind`,
 * width columns). */
void ks_widen_rows(const void *src, int kind, const int64_t *rows,
                   int64_t count, int64_t width, float *dst) {
  for (int64_t i = 0; i < count; ++i) {
    float *out = dst + i * width;
    if (kind == KS_FLOAT32) {
      memcpy(out, (const float *)src + rows[i] * width,
             (size_t)width * sizeof(float));
      continue;
    }
    const uint16_t *in = (const uint16_t *)src + rows[i] * width;
    for (int64_t j = 0; j < width; ++j)
      out[j] = kind == KS_BFLOAT16 ? ks_bits_float((uint32_t)in[j] << 16)
                                   : ks_f16_to_f32(in[j]);
  }
}

/* dst[rows[i]][:] = src[i][:] in dst's `kind`, for i < count. 16-bit
 * kinds round stochastically where `stochastic` (the word of row r,
 * column j: mix32((first_row + r) * width + j ^ seed), as
 * row_rounding.random_bits), else to nearest. */
void ks_narrow_rows(void *dst, int kind, const int64_t *rows,
                    const float *src, int64_t count, int64_t width,
                    int stochastic, int32_t seed, int64_t first_row) {
  for (int64_t i = 0; i < count; ++i) {
    const float *in = src + i * width;
    if (kind == KS_FLOAT32) {
      memcpy((float *)dst + rows[i] * width, in,
             (size_t)width * sizeof(float));
      continue;
    }
    uint16_t *out = (uint16_t *)dst + rows[i] * width;
    const uint32_t key = (uint32_t)(first_row + rows[i]) * (uint32_t)width;
    for (int64_t j = 0; j < width; ++j) {
      if (stochastic)
        out[j] = ks_stochastic_16(
            in[j], ks_mix32((key + (uint32_t)j) ^ (uint32_t)seed), kind);
      else
        out[j] = kind == KS_BFLOAT16 ? ks_f32_to_bf16(in[j])
                                     : ks_f32_to_f16(in[j]);
    }
  }
}
