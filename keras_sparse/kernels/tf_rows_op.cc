/* TensorFlow CPU ops (keras_sparse.ops.tensorflow.native_rows): the sparse row
 * update of a table and its optimizer slots, in place, in one pass; and the
 * forward's gather of a table's rows, prefetched.
 *
 * The graph route runs a dozen TensorFlow operations per table (unique,
 * segment sum, two gathers, the optimizer, two scatters), each a pass over
 * the batch and, for the gathers and scatters, a random access to every
 * touched row. This op dedups with the compiled helpers of cpu_rows.c and
 * updates each distinct row with one read and one write of each array.
 * Built on first use against the installed TensorFlow's headers.
 */
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/util/work_sharder.h"

extern "C" {
#include "cpu_rows.c"
}

namespace {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using CPUDevice = Eigen::ThreadPoolDevice;

// The distinct valid ids of a batch into ``unique`` (their count in
// ``*count``) and their summed gradient rows into ``summed``
// (ks_distinct_sum_f32; scratch sized by the batch, whatever the table's
// rows: see cpu_rows.c). Position p takes gradient row p / bag (a bag's
// pooled gradient, with no copy per position). An id outside [0, rows) is
// an error, returned before any row changes.
absl::Status DistinctSum(OpKernelContext* ctx, const std::string& op,
                         const Tensor& ids, const Tensor& valid,
                         const Tensor& grads, int64_t bag, int64_t rows,
                         int64_t dim, Tensor* unique, Tensor* summed,
                         int64_t* count) {
  const int64_t n = ids.NumElements();
  Tensor scratch, wide_ids;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(
      tensorflow::DT_INT32, TensorShape({ks_dedup_scratch_entries(n)}),
      &scratch));
  TF_RETURN_IF_ERROR(
      ctx->allocate_temp(tensorflow::DT_INT64, TensorShape({n}), &wide_ids));
  TF_RETURN_IF_ERROR(
      ctx->allocate_temp(tensorflow::DT_INT64, TensorShape({n}), unique));
  TF_RETURN_IF_ERROR(
      ctx->allocate_temp(tensorflow::DT_FLOAT, TensorShape({n, dim}), summed));
  const int32_t* narrow = ids.flat<int32_t>().data();
  int64_t* wide = wide_ids.flat<int64_t>().data();
  for (int64_t p = 0; p < n; ++p) wide[p] = narrow[p];
  *count = ks_distinct_sum_f32(
      wide, reinterpret_cast<const uint8_t*>(valid.flat<bool>().data()), n,
      rows, grads.flat<float>().data(), bag, dim, scratch.flat<int32_t>().data(),
      unique->flat<int64_t>().data(), summed->flat<float>().data());
  if (*count < 0) {
    return absl::InvalidArgumentError(
        op + ": id " + std::to_string(wide[-1 - *count]) + " at position " +
        std::to_string(-1 - *count) + " is outside the table's rows [0, " +
        std::to_string(rows) + ")");
  }
  return absl::OkStatus();
}

// cpu_rows.c's code of a rule attribute (the op's attribute list names
// the same rules, in the same order).
int RuleCode(const std::string& rule) {
  static const char* const names[KS_RULES] = {"sgd", "adagrad", "adam",
                                              "rowwise_adagrad", "ftrl"};
  for (int i = 0; i < KS_RULES; ++i)
    if (rule == names[i]) return i;
  return -1;
}

REGISTER_OP("KerasSparseRowUpdate")
    .Input("variables: N * resource")
    .Input("ids: int32")
    .Input("valid: bool")
    .Input("grads: float")
    .Input("scalars: float")
    .Attr("N: int >= 1")
    .Attr("rule: {'sgd', 'adagrad', 'adam', 'rowwise_adagrad', 'ftrl'}")
    .Attr("first: int >= 0")
    .Attr("rows: int >= 1")
    .Attr("bag: int >= 1 = 1")
    .Output("updated: int64")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

class KerasSparseRowUpdateOp : public OpKernel {
 public:
  explicit KerasSparseRowUpdateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_vars_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rule", &rule_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("first", &first_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rows", &rows_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bag", &bag_));
    code_ = RuleCode(rule_);
    const int wanted = ks_rule_arrays(code_);
    OP_REQUIRES(ctx, n_vars_ == wanted,
                absl::InvalidArgumentError("KerasSparseRowUpdate: rule " +
                                           rule_ + " takes " +
                                           std::to_string(wanted) +
                                           " variables"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(n_vars_);
    const Tensor& valid = ctx->input(n_vars_ + 1);
    const Tensor& grads = ctx->input(n_vars_ + 2);
    const Tensor& scalars = ctx->input(n_vars_ + 3);
    const int64_t n = ids.NumElements();
    OP_REQUIRES(
        ctx,
        ids.dims() == 1 && valid.shape() == ids.shape() && grads.dims() == 2 &&
            grads.dim_size(0) * bag_ == n && n <= (int64_t{1} << 30),
        absl::InvalidArgumentError(
            "KerasSparseRowUpdate: ids [n] (n <= 2**30), valid [n] and grads "
            "[n / bag, dim] do not fit: " + ids.shape().DebugString() + ", " +
            valid.shape().DebugString() + ", " + grads.shape().DebugString()));
    const int64_t dim = grads.dim_size(1);
    OP_REQUIRES(ctx, scalars.NumElements() == ks_rule_scalars(code_),
                absl::InvalidArgumentError("KerasSparseRowUpdate: scalars"));

    // The number of distinct rows updated: an output, so that callers see
    // the op ran in eager mode too (an op without outputs returns None).
    Tensor* updated = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &updated));
    updated->scalar<int64_t>()() = 0;

    std::vector<int> inputs(n_vars_);
    std::iota(inputs.begin(), inputs.end(), 0);
    // Exclusive locks in address order; sparse access copies a variable
    // first only where a dense read still holds its buffer.
    auto locks = tensorflow::MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
        ctx, /*do_lock=*/true, /*sparse=*/true, inputs);
    std::vector<float*> arrays;
    for (int i = 0; i < n_vars_; ++i) {
      Tensor var;
      OP_REQUIRES_OK(ctx, tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
                              ctx, i, /*lock_held=*/true, /*sparse=*/true, &var));
      // A row-wise rule's slots hold one value per row.
      const int64_t width = rule_ == "rowwise_adagrad" && i > 0 ? 1 : dim;
      OP_REQUIRES(
          ctx,
          var.dtype() == tensorflow::DT_FLOAT && var.dims() == 2 &&
              var.dim_size(1) == width && var.dim_size(0) >= first_ + rows_,
          absl::InvalidArgumentError(
              "KerasSparseRowUpdate: variable " + std::to_string(i) + " " +
              var.shape().DebugString() + " does not hold rows [" +
              std::to_string(first_) + ", " + std::to_string(first_ + rows_) +
              ") of width " + std::to_string(width)));
      arrays.push_back(var.flat<float>().data() + first_ * width);
    }
    if (n == 0) return;

    Tensor unique, summed;
    int64_t count = 0;
    OP_REQUIRES_OK(ctx, DistinctSum(ctx, "KerasSparseRowUpdate", ids, valid,
                                    grads, bag_, rows_, dim, &unique, &summed,
                                    &count));
    updated->scalar<int64_t>()() = count;
    ks_rule_rows_f32(code_, arrays.data(), unique.flat<int64_t>().data(),
                     summed.flat<float>().data(), count, dim,
                     scalars.flat<float>().data());
  }

 private:
  int n_vars_;
  std::string rule_;
  int code_;
  int64_t first_;
  int64_t rows_;
  int64_t bag_;
};

REGISTER_KERNEL_BUILDER(Name("KerasSparseRowUpdate").Device(DEVICE_CPU),
                        KerasSparseRowUpdateOp);

// KerasSparseRowUpdate where the table or a slot is bfloat16 or float16:
// the touched rows of every variable are widened into float32 scratch, the
// rule's float32 pass of cpu_rows.c runs on the scratch, and the rows are
// written back rounded (ks_narrow_rows: stochastically with seeds[i], the
// int32 seed of variable i, where `stochastic`, else to nearest; the random
// words of row first + id, as the graph route draws them), to the bit.
REGISTER_OP("KerasSparseRowUpdate16")
    .Input("variables: N * resource")
    .Input("ids: int32")
    .Input("valid: bool")
    .Input("grads: float")
    .Input("scalars: float")
    .Input("seeds: int32")
    .Attr("N: int >= 1")
    .Attr("rule: {'sgd', 'adagrad', 'adam', 'rowwise_adagrad', 'ftrl'}")
    .Attr("first: int >= 0")
    .Attr("rows: int >= 1")
    .Attr("bag: int >= 1 = 1")
    .Attr("stochastic: bool")
    .Output("updated: int64")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

// A variable's switch to sparse access (copy-on-read), by its own dtype.
absl::Status SparseAccess(OpKernelContext* ctx, tensorflow::Var* var) {
  switch (var->tensor()->dtype()) {
    case tensorflow::DT_FLOAT:
      return tensorflow::EnsureSparseVariableAccess<CPUDevice, float>(ctx, var);
    case tensorflow::DT_BFLOAT16:
      return tensorflow::EnsureSparseVariableAccess<CPUDevice,
                                                    Eigen::bfloat16>(ctx, var);
    case tensorflow::DT_HALF:
      return tensorflow::EnsureSparseVariableAccess<CPUDevice, Eigen::half>(
          ctx, var);
    default:
      return absl::InvalidArgumentError(
          "KerasSparseRowUpdate16: variables must be float32, bfloat16 or "
          "float16");
  }
}

class KerasSparseRowUpdate16Op : public OpKernel {
 public:
  explicit KerasSparseRowUpdate16Op(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_vars_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rule", &rule_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("first", &first_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rows", &rows_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bag", &bag_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stochastic", &stochastic_));
    code_ = RuleCode(rule_);
    const int wanted = ks_rule_arrays(code_);
    OP_REQUIRES(ctx, n_vars_ == wanted,
                absl::InvalidArgumentError("KerasSparseRowUpdate16: rule " +
                                           rule_ + " takes " +
                                           std::to_string(wanted) +
                                           " variables"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(n_vars_);
    const Tensor& valid = ctx->input(n_vars_ + 1);
    const Tensor& grads = ctx->input(n_vars_ + 2);
    const Tensor& scalars = ctx->input(n_vars_ + 3);
    const Tensor& seeds = ctx->input(n_vars_ + 4);
    const int64_t n = ids.NumElements();
    OP_REQUIRES(
        ctx,
        ids.dims() == 1 && valid.shape() == ids.shape() && grads.dims() == 2 &&
            grads.dim_size(0) * bag_ == n && n <= (int64_t{1} << 30) &&
            seeds.NumElements() == n_vars_,
        absl::InvalidArgumentError(
            "KerasSparseRowUpdate16: ids [n] (n <= 2**30), valid [n], grads "
            "[n / bag, dim] and seeds [N] do not fit"));
    const int64_t dim = grads.dim_size(1);
    OP_REQUIRES(ctx, scalars.NumElements() == ks_rule_scalars(code_),
                absl::InvalidArgumentError("KerasSparseRowUpdate16: scalars"));
    Tensor* updated = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &updated));
    updated->scalar<int64_t>()() = 0;

    // Exclusive locks in address order, each variable switched to sparse
    // access by its own dtype first (TensorFlow's helper takes one dtype).
    std::vector<tensorflow::core::RefCountPtr<tensorflow::Var>> vars(n_vars_);
    std::vector<tsl::mutex*> mutexes;
    for (int i = 0; i < n_vars_; ++i) {
      OP_REQUIRES_OK(ctx, tensorflow::LookupResource(
                              ctx, tensorflow::HandleFromInput(ctx, i), &vars[i]));
      OP_REQUIRES_OK(ctx, SparseAccess(ctx, vars[i].get()));
      if (std::find(mutexes.begin(), mutexes.end(), vars[i]->mu()) ==
          mutexes.end())
        mutexes.push_back(vars[i]->mu());
    }
    std::sort(mutexes.begin(), mutexes.end());
    std::vector<std::unique_ptr<tsl::mutex_lock>> locks;
    for (tsl::mutex* mu : mutexes)
      locks.push_back(std::make_unique<tsl::mutex_lock>(*mu));
    std::vector<void*> arrays;
    std::vector<int> kinds;
    std::vector<int64_t> widths;
    for (int i = 0; i < n_vars_; ++i) {
      Tensor var = *vars[i]->tensor();
      const int64_t width = rule_ == "rowwise_adagrad" && i > 0 ? 1 : dim;
      const auto type = var.dtype();
      const int kind = type == tensorflow::DT_FLOAT      ? KS_FLOAT32
                       : type == tensorflow::DT_BFLOAT16 ? KS_BFLOAT16
                       : type == tensorflow::DT_HALF     ? KS_FLOAT16
                                                         : -1;
      OP_REQUIRES(
          ctx,
          kind >= 0 && var.dims() == 2 && var.dim_size(1) == width &&
              var.dim_size(0) >= first_ + rows_,
          absl::InvalidArgumentError(
              "KerasSparseRowUpdate16: variable " + std::to_string(i) + " " +
              var.shape().DebugString() + " does not hold rows [" +
              std::to_string(first_) + ", " + std::to_string(first_ + rows_) +
              ") of width " + std::to_string(width) +
              " as float32, bfloat16 or float16"));
      const size_t element = kind == KS_FLOAT32 ? 4 : 2;
      arrays.push_back(static_cast<char*>(var.data()) +
                       first_ * width * element);
      kinds.push_back(kind);
      widths.push_back(width);
    }
    if (n == 0) return;

    Tensor unique, summed, compact, order;
    int64_t count = 0;
    OP_REQUIRES_OK(ctx, DistinctSum(ctx, "KerasSparseRowUpdate16", ids, valid,
                                    grads, bag_, rows_, dim, &unique, &summed,
                                    &count));
    updated->scalar<int64_t>()() = count;
    int64_t total = 0;
    for (int64_t w : widths) total += count * w;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_FLOAT,
                                           TensorShape({total}), &compact));
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_INT64,
                                           TensorShape({count}), &order));
    int64_t* o = order.flat<int64_t>().data();
    for (int64_t i = 0; i < count; ++i) o[i] = i;
    const int64_t* rows = unique.flat<int64_t>().data();
    std::vector<float*> c;
    float* next = compact.flat<float>().data();
    for (int i = 0; i < n_vars_; ++i) {
      c.push_back(next);
      ks_widen_rows(arrays[i], kinds[i], rows, count, widths[i], next);
      next += count * widths[i];
    }
    ks_rule_rows_f32(code_, c.data(), o, summed.flat<float>().data(), count,
                     dim, scalars.flat<float>().data());
    const int32_t* seed = seeds.flat<int32_t>().data();
    for (int i = 0; i < n_vars_; ++i) {
      ks_narrow_rows(arrays[i], kinds[i], rows, c[i], count, widths[i],
                     stochastic_, seed[i], first_);
    }
  }

 private:
  int n_vars_;
  std::string rule_;
  int code_;
  int64_t first_;
  int64_t rows_;
  int64_t bag_;
  bool stochastic_;
};

REGISTER_KERNEL_BUILDER(Name("KerasSparseRowUpdate16").Device(DEVICE_CPU),
                        KerasSparseRowUpdate16Op);

// Runs body(table, id, ok) with the float32 [rows, dim] table of resource
// input 0 under a shared lock (a sparse read, as TensorFlow's own
// ResourceGather), after checking the table's dtype and width and that
// every valid id is one of its rows; errors name ``op``.
template <typename Body>
void ks_read_table(OpKernelContext* ctx, const std::string& op, int64_t dim,
                   const Tensor& ids, const Tensor& valid, Body body) {
  const int64_t n = ids.NumElements();
  tensorflow::core::RefCountPtr<tensorflow::Var> var;
  OP_REQUIRES_OK(ctx, tensorflow::LookupResource(
                          ctx, tensorflow::HandleFromInput(ctx, 0), &var));
  {
    // Checked before EnsureSparseVariableAccess, which copies as float.
    tensorflow::tf_shared_lock lock(*var->mu());
    const Tensor& table = *var->tensor();
    OP_REQUIRES(ctx,
                table.dtype() == tensorflow::DT_FLOAT && table.dims() == 2 &&
                    table.dim_size(1) == dim,
                absl::InvalidArgumentError(
                    op + ": the table " + table.shape().DebugString() +
                    " is not float32 of width " + std::to_string(dim)));
  }
  OP_REQUIRES_OK(ctx, tensorflow::EnsureSparseVariableAccess<CPUDevice, float>(
                          ctx, var.get()));
  tensorflow::tf_shared_lock lock(*var->mu());
  const Tensor& table = *var->tensor();
  OP_REQUIRES(ctx, table.dims() == 2 && table.dim_size(1) == dim,
              absl::InvalidArgumentError(op + ": the table changed shape"));
  const int64_t num_rows = table.dim_size(0);
  const int32_t* id = ids.flat<int32_t>().data();
  const uint8_t* ok = reinterpret_cast<const uint8_t*>(valid.flat<bool>().data());
  const int64_t bad = ks_first_outside(id, ok, n, num_rows);
  OP_REQUIRES(ctx, bad < 0,
              absl::InvalidArgumentError(
                  op + ": id " + std::to_string(id[bad]) + " at position " +
                  std::to_string(bad) + " is outside the table's rows [0, " +
                  std::to_string(num_rows) + ")"));
  body(table, id, ok);
}

// rows[p] = table[ids[p]] where valid[p], else zeros. A lookup's rows are
// random accesses into a table far larger than the caches; TensorFlow's
// gather copies them one after another, each waiting for its miss. Here the
// row KS_AHEAD positions on is prefetched while the current one is copied,
// so the misses overlap (ks_gather_rows_f32).
REGISTER_OP("KerasSparseGatherRows")
    .Input("table: resource")
    .Input("ids: int32")
    .Input("valid: bool")
    .Attr("dim: int >= 1")
    .Output("rows: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      tensorflow::shape_inference::ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      TF_RETURN_IF_ERROR(c->Merge(ids, c->input(2), &ids));
      c->set_output(0, c->Matrix(c->Dim(ids, 0), dim));
      return absl::OkStatus();
    });

class KerasSparseGatherRowsOp : public OpKernel {
 public:
  explicit KerasSparseGatherRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(1);
    const Tensor& valid = ctx->input(2);
    OP_REQUIRES(ctx, ids.dims() == 1 && valid.shape() == ids.shape(),
                absl::InvalidArgumentError(
                    "KerasSparseGatherRows: ids [n] and valid [n] do not fit: " +
                    ids.shape().DebugString() + ", " +
                    valid.shape().DebugString()));
    const int64_t n = ids.NumElements();
    ks_read_table(ctx, "KerasSparseGatherRows", dim_, ids, valid,
                  [&](const Tensor& table, const int32_t* id,
                      const uint8_t* ok) {
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim_}), &out));
      const float* src = table.flat<float>().data();
      float* dst = out->flat<float>().data();
      const auto& workers = *ctx->device()->tensorflow_cpu_worker_threads();
      // A row costs a cache miss (~100 ns) more than its copy.
      tensorflow::Shard(workers.num_threads, workers.workers, n, 300 + dim_,
                        [&](int64_t lo, int64_t hi) {
                          ks_gather_rows_f32(src, id, ok, lo, hi, dim_, dst);
                        });
                  });
  }

 private:
  int64_t dim_;
};

REGISTER_KERNEL_BUILDER(Name("KerasSparseGatherRows").Device(DEVICE_CPU),
                        KerasSparseGatherRowsOp);

// out[b] = the sum of the valid rows of bag b (positions b * bag ..
// b * bag + bag - 1): the gather and the sum of a pooled bag in one pass
// (ks_gather_sums_f32), writing [n / bag, dim] where a gather writes
// [n, dim] for reduce_sum to read again.
REGISTER_OP("KerasSparseGatherSums")
    .Input("table: resource")
    .Input("ids: int32")
    .Input("valid: bool")
    .Attr("dim: int >= 1")
    .Attr("bag: int >= 1")
    .Output("sums: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t dim, bag;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      TF_RETURN_IF_ERROR(c->GetAttr("bag", &bag));
      tensorflow::shape_inference::ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      TF_RETURN_IF_ERROR(c->Merge(ids, c->input(2), &ids));
      tensorflow::shape_inference::DimensionHandle bags;
      TF_RETURN_IF_ERROR(c->Divide(c->Dim(ids, 0), bag, true, &bags));
      c->set_output(0, c->Matrix(bags, dim));
      return absl::OkStatus();
    });

class KerasSparseGatherSumsOp : public OpKernel {
 public:
  explicit KerasSparseGatherSumsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bag", &bag_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(1);
    const Tensor& valid = ctx->input(2);
    OP_REQUIRES(ctx,
                ids.dims() == 1 && valid.shape() == ids.shape() &&
                    ids.NumElements() % bag_ == 0,
                absl::InvalidArgumentError(
                    "KerasSparseGatherSums: ids [n] and valid [n], n a "
                    "multiple of bag " + std::to_string(bag_) + ", do not "
                    "fit: " + ids.shape().DebugString() + ", " +
                    valid.shape().DebugString()));
    const int64_t n = ids.NumElements();
    ks_read_table(ctx, "KerasSparseGatherSums", dim_, ids, valid,
                  [&](const Tensor& table, const int32_t* id,
                      const uint8_t* ok) {
      const int64_t bags = n / bag_;
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx,
                     ctx->allocate_output(0, TensorShape({bags, dim_}), &out));
      const float* src = table.flat<float>().data();
      float* dst = out->flat<float>().data();
      const auto& workers = *ctx->device()->tensorflow_cpu_worker_threads();
      // A row costs a cache miss (~100 ns) more than its sum.
      tensorflow::Shard(workers.num_threads, workers.workers, bags,
                        bag_ * (300 + dim_), [&](int64_t lo, int64_t hi) {
                          ks_gather_sums_f32(src, id, ok, bag_, lo, hi, dim_,
                                             dst);
                        });
                  });
  }

 private:
  int64_t dim_;
  int64_t bag_;
};

REGISTER_KERNEL_BUILDER(Name("KerasSparseGatherSums").Device(DEVICE_CPU),
                        KerasSparseGatherSumsOp);

}  // namespace
