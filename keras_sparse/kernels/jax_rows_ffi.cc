/* JAX CPU custom calls (keras_sparse.ops.jax.native_rows): the sparse row
 * update of a table and its optimizer slots, in place, in one pass; and the
 * forward's gather of a table's rows, prefetched.
 *
 * XLA:CPU runs the update as a dozen fused loops per table (the dedup by a
 * table-sized scratch, a cumulative sum, segment sums, gathers of the table
 * and of each slot, the optimizer, a scatter per array), each a pass over
 * the batch, the gathers and scatters each a random access to every touched
 * row. This call dedups with the hash of cpu_rows.c and updates each
 * distinct row with one read and one write of each array. Its results are
 * aliased to the arrays it updates (input_output_aliases), so with donated
 * state XLA hands it the table's own buffer and nothing is copied.
 * Built on first use against the installed jaxlib's FFI headers.
 */
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

extern "C" {
#include "cpu_rows.c"
}

namespace ffi = xla::ffi;

namespace {

// Named types: a template's comma would split the binding macros' arguments.
using Ids = ffi::Buffer<ffi::S32, 1>;
using Flags = ffi::Buffer<ffi::PRED, 1>;
using Rows = ffi::Buffer<ffi::F32, 2>;
using Scalars = ffi::Buffer<ffi::F32, 1>;
using Seeds = ffi::Buffer<ffi::S32, 1>;

// Per-thread scratch of the update, kept between calls: a step updates
// dozens of tables, and fresh megabyte buffers would each be mapped and
// faulted in anew.
struct Scratch {
  std::vector<int64_t> wide;
  std::vector<int32_t> hash;
  std::vector<int64_t> unique;
  std::vector<float> summed;
};

// A thread's scratch is released after a call that needed more than this.
constexpr size_t kKeptScratchBytes = size_t{64} << 20;

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// The distinct valid ids of a batch into s.unique (their count in *count)
// and their summed gradient rows into s.summed (ks_distinct_sum_f32). An id
// outside [0, rows) is an error, returned before any row changes.
ffi::Error DistinctSum(Ids ids, Flags valid, Rows grads, int64_t rows,
                       int64_t dim, Scratch& s, int64_t* count) {
  const int64_t n = ids.element_count();
  s.wide.resize(n);
  s.hash.resize(ks_dedup_scratch_entries(n));
  s.unique.resize(n);
  s.summed.resize(size_t(n) * size_t(dim));
  const int32_t* narrow = ids.typed_data();
  for (int64_t p = 0; p < n; ++p) s.wide[p] = narrow[p];
  *count = ks_distinct_sum_f32(
      s.wide.data(), reinterpret_cast<const uint8_t*>(valid.typed_data()), n,
      rows, grads.typed_data(), 1, dim, s.hash.data(), s.unique.data(),
      s.summed.data());
  if (*count < 0) {
    return ffi::Error::InvalidArgument(
        "keras_sparse row update: id " + std::to_string(narrow[-1 - *count]) +
        " at position " + std::to_string(-1 - *count) +
        " is outside the table's rows [0, " + std::to_string(rows) + ")");
  }
  return ffi::Error::Success();
}


ffi::Error RowUpdate(Ids ids, Flags valid, Rows grads, Scalars scalars,
                     ffi::RemainingArgs arrays,
                     ffi::RemainingRets outs, int32_t rule) {
  const int64_t n = ids.element_count();
  // Rules: cpu_rows.c's codes (3, row-wise Adagrad: its accumulator
  // [rows, 1]).
  const int wanted = ks_rule_arrays(rule);
  const int64_t n_scalars = ks_rule_scalars(rule);
  if (wanted < 0 || int64_t(arrays.size()) != wanted ||
      int64_t(outs.size()) != wanted ||
      int64_t(scalars.element_count()) != n_scalars) {
    return ffi::Error::InvalidArgument(
        "keras_sparse row update: rule " + std::to_string(rule) + " with " +
        std::to_string(arrays.size()) + " arrays and " +
        std::to_string(scalars.element_count()) + " scalars");
  }
  const int64_t dim = grads.dimensions()[1];
  if (int64_t(valid.element_count()) != n || grads.dimensions()[0] != n ||
      n > (int64_t{1} << 30)) {
    return ffi::Error::InvalidArgument(
        "keras_sparse row update: ids [n] (n <= 2**30), valid [n] and grads "
        "[n, dim] do not fit");
  }
  int64_t rows = -1;
  std::vector<float*> data(wanted);
  for (int i = 0; i < wanted; ++i) {
    auto in = arrays.get<Rows>(i);
    auto out = outs.get<Rows>(i);
    if (!in.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument(
          "keras_sparse row update: arrays must be float32 [rows, dim]");
    }
    const auto shape = in->dimensions();
    const int64_t width = rule == 3 && i > 0 ? 1 : dim;
    if (shape[1] != width || (rows >= 0 && shape[0] != rows) ||
        (*out)->dimensions()[0] != shape[0] ||
        (*out)->dimensions()[1] != width) {
      return ffi::Error::InvalidArgument(
          "keras_sparse row update: the table must be [rows, " +
          std::to_string(dim) + "] and its slots [rows, " +
          std::to_string(rule == 3 ? 1 : dim) + "]");
    }
    rows = shape[0];
    float* target = (*out)->typed_data();
    // Aliased by the caller: XLA gives the result the input's buffer (it
    // copies first where the input is still read elsewhere). Copy here
    // only if it did not.
    if (target != in->typed_data()) {
      std::memcpy(target, in->typed_data(), in->size_bytes());
    }
    data[i] = target;
  }
  if (n == 0) return ffi::Error::Success();
  Scratch& s = thread_scratch();
  int64_t count = 0;
  ffi::Error summed = DistinctSum(ids, valid, grads, rows, dim, s, &count);
  if (summed.failure()) return summed;
  ks_rule_rows_f32(rule, data.data(), s.unique.data(), s.summed.data(), count,
                   dim, scalars.typed_data());
  // Kept for the next call unless one unusually large batch grew it.
  if (s.summed.capacity() * sizeof(float) > kKeptScratchBytes) s = Scratch();
  return ffi::Error::Success();
}

// The update of RowUpdate where the table or a slot is bfloat16 or float16:
// the touched rows of every array are widened into float32 scratch, the
// rule's float32 pass runs on the scratch, and the rows are written back
// rounded (ks_narrow_rows: stochastically with seeds[i], the int32 seed of
// array i, where `stochastic`, else to nearest), as the XLA route rounds
// them (keras_sparse/ops/row_rounding.py), to the bit.
struct Scratch16 {
  std::vector<float> rows;
  std::vector<int64_t> order;
};

int StorageKind(ffi::DataType type) {
  return type == ffi::DataType::F32    ? KS_FLOAT32
         : type == ffi::DataType::BF16 ? KS_BFLOAT16
         : type == ffi::DataType::F16  ? KS_FLOAT16
                                       : -1;
}

ffi::Error RowUpdate16(Ids ids, Flags valid, Rows grads, Scalars scalars,
                       Seeds seeds,
                       ffi::RemainingArgs arrays, ffi::RemainingRets outs,
                       int32_t rule, int32_t stochastic) {
  const int64_t n = ids.element_count();
  const int wanted = ks_rule_arrays(rule);
  const int64_t n_scalars = ks_rule_scalars(rule);
  if (wanted < 0 || int64_t(arrays.size()) != wanted ||
      int64_t(outs.size()) != wanted ||
      int64_t(scalars.element_count()) != n_scalars ||
      int64_t(seeds.element_count()) != wanted) {
    return ffi::Error::InvalidArgument(
        "keras_sparse 16-bit row update: rule " + std::to_string(rule) +
        " with " + std::to_string(arrays.size()) + " arrays, " +
        std::to_string(scalars.element_count()) + " scalars and " +
        std::to_string(seeds.element_count()) + " seeds");
  }
  const int64_t dim = grads.dimensions()[1];
  if (int64_t(valid.element_count()) != n || grads.dimensions()[0] != n ||
      n > (int64_t{1} << 30)) {
    return ffi::Error::InvalidArgument(
        "keras_sparse 16-bit row update: ids [n] (n <= 2**30), valid [n] and "
        "grads [n, dim] do not fit");
  }
  int64_t rows = -1;
  std::vector<void*> data(wanted);
  std::vector<int> kinds(wanted);
  std::vector<int64_t> widths(wanted);
  for (int i = 0; i < wanted; ++i) {
    auto in = arrays.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument(
          "keras_sparse 16-bit row update: arrays must be buffers");
    }
    const auto shape = in->dimensions();
    const auto out_shape = (*out)->dimensions();
    const int64_t width = rule == 3 && i > 0 ? 1 : dim;
    kinds[i] = StorageKind(in->element_type());
    if (kinds[i] < 0 || (*out)->element_type() != in->element_type() ||
        shape.size() != 2 || out_shape.size() != 2 || shape[1] != width ||
        (rows >= 0 && shape[0] != rows) || out_shape[0] != shape[0] ||
        out_shape[1] != width) {
      return ffi::Error::InvalidArgument(
          "keras_sparse 16-bit row update: the table must be [rows, " +
          std::to_string(dim) + "] and its slots [rows, " +
          std::to_string(rule == 3 ? 1 : dim) +
          "], each float32, bfloat16 or float16");
    }
    rows = shape[0];
    widths[i] = width;
    void* target = (*out)->untyped_data();
    if (target != in->untyped_data()) {
      std::memcpy(target, in->untyped_data(), in->size_bytes());
    }
    data[i] = target;
  }
  if (n == 0) return ffi::Error::Success();
  Scratch& s = thread_scratch();
  int64_t count = 0;
  ffi::Error summed = DistinctSum(ids, valid, grads, rows, dim, s, &count);
  if (summed.failure()) return summed;
  thread_local Scratch16 t;
  std::vector<float*> compact(wanted);
  size_t total = 0;
  for (int i = 0; i < wanted; ++i) total += size_t(count) * size_t(widths[i]);
  t.rows.resize(total);
  t.order.resize(count);
  for (int64_t i = 0; i < count; ++i) t.order[i] = i;
  float* next = t.rows.data();
  for (int i = 0; i < wanted; ++i) {
    compact[i] = next;
    ks_widen_rows(data[i], kinds[i], s.unique.data(), count, widths[i], next);
    next += count * widths[i];
  }
  ks_rule_rows_f32(rule, compact.data(), t.order.data(), s.summed.data(),
                   count, dim, scalars.typed_data());
  for (int i = 0; i < wanted; ++i) {
    ks_narrow_rows(data[i], kinds[i], s.unique.data(), compact[i], count,
                   widths[i], stochastic, seeds.typed_data()[i], 0);
  }
  if (s.summed.capacity() * sizeof(float) > kKeptScratchBytes) s = Scratch();
  if (t.rows.capacity() * sizeof(float) > kKeptScratchBytes) t = Scratch16();
  return ffi::Error::Success();
}

// rows[p] = table[ids[p]] where valid[p], else zeros, prefetching the row
// KS_AHEAD positions on (ks_gather_rows_f32): XLA's gather takes the cache
// misses of a large table one after another.
ffi::Error GatherRows(Rows table, Ids ids, Flags valid,
                      ffi::Result<Rows> out) {
  const int64_t n = ids.element_count();
  const int64_t rows = table.dimensions()[0];
  const int64_t dim = table.dimensions()[1];
  if (int64_t(valid.element_count()) != n || out->dimensions()[0] != n ||
      out->dimensions()[1] != dim) {
    return ffi::Error::InvalidArgument(
        "keras_sparse gather: ids [n], valid [n] and rows [n, dim] do not fit");
  }
  const int32_t* id = ids.typed_data();
  const uint8_t* ok = reinterpret_cast<const uint8_t*>(valid.typed_data());
  const int64_t bad = ks_first_outside(id, ok, n, rows);
  if (bad >= 0) {
    return ffi::Error::InvalidArgument(
        "keras_sparse gather: id " + std::to_string(id[bad]) + " at position " +
        std::to_string(bad) + " is outside the table's rows [0, " +
        std::to_string(rows) + ")");
  }
  ks_gather_rows_f32(table.typed_data(), id, ok, 0, n, dim, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasSparseRowUpdate, RowUpdate,
                              ffi::Ffi::Bind()
                                  .Arg<Ids>()
                                  .Arg<Flags>()
                                  .Arg<Rows>()
                                  .Arg<Scalars>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("rule"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasSparseGatherRows, GatherRows,
                              ffi::Ffi::Bind()
                                  .Arg<Rows>()
                                  .Arg<Ids>()
                                  .Arg<Flags>()
                                  .Ret<Rows>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasSparseRowUpdate16, RowUpdate16,
                              ffi::Ffi::Bind()
                                  .Arg<Ids>()
                                  .Arg<Flags>()
                                  .Arg<Rows>()
                                  .Arg<Scalars>()
                                  .Arg<Seeds>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("rule")
                                  .Attr<int32_t>("stochastic"));
