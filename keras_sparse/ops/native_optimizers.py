"""The PyTorch CPU update of SGD, Adagrad, Adam, RowWiseAdagrad and Ftrl rows
in one compiled pass.

After the compiled dedup (`keras_sparse.ops.native_rows`), the torch route
gathers the touched rows of the table and of each slot, runs the optimizer
as a dozen eager operations and scatters every array back: each row of a
large table is fetched from memory twice, and the eager operations cost
more than the arithmetic. For the built-in optimizers without a constraint
one C loop reads each row, updates it and writes it back instead
(`keras_sparse/kernels/cpu_rows.c`), with the torch route's operations in its order and
a correctly rounded square root: it equals a NumPy float32 model of the
optimizer to the bit, and the torch route, whose vectorized square root may
round an ulp away, to within an ulp (tests/test_native_optimizers.py);
RowWiseAdagrad's mean of squares is summed in column order, which torch's
vectorized mean need not follow, so there the two agree to float32
rounding of that sum. Ftrl's power of the accumulator is that square root
at the default ``learning_rate_power=-0.5`` and the C library's powf
otherwise (the NumPy model calls the same powf); its row, a difference of
near values, inherits an ulp of a root as ~1e-7 absolute. The
input stage's segments replace the dedup only, so a batch takes this pass
with or without the stage. Under DistributedDataParallel every process
must take the same route (the same compiler available, or
``KERAS_SPARSE_NATIVE=0`` everywhere), or the replicas' tables drift apart
by ulps.

Subclasses of these optimizers take the torch route: they may change the
update. ``FUSED_OPTIMIZERS = False`` turns the compiled pass off (the
benchmarks compare the two).
"""

import numpy as np

from keras_sparse.ops import optimizer_rules
from keras_sparse.ops.native_rows import KINDS
from keras_sparse.ops.optimizer_rules import rule_of
from keras_sparse.ops.optimizer_rules import rule_scalars
from keras_sparse.ops.optimizer_rules import slot_width
from keras_sparse.ops.row_rounding import int_seed

#: Read at every update: False sends every optimizer down the torch route.
FUSED_OPTIMIZERS = True


def fused_update(
    native, optimizer, state, unique, summed, iterations, constraint, stochastic=True
):
    """Updates rows ``unique`` (int64 NumPy, distinct, in range) of
    ``state`` (``{"table": tensor, slot: tensor}``, CPU float32, bfloat16
    or float16) in place from ``summed`` (their float32 NumPy gradients)
    in one compiled pass. 16-bit arrays are widened to float32 rows, updated
    and written back rounded as `keras_sparse.ops.row_rounding` rounds them
    (stochastically, or to nearest with ``stochastic=False``), to the bit.

    Returns False, changing nothing, where the optimizer, the constraint
    or the arrays do not suit it; the caller then runs the torch route.
    """
    if not FUSED_OPTIMIZERS or constraint is not None:
        return False
    table = state["table"]
    found = rule_of(optimizer)
    if found is None:
        return False
    rule, slot_names = found
    if set(state) != {"table", *slot_names}:
        return False
    names = ["table", *slot_names]
    tensors = [state[name] for name in names]
    if table.dim() != 2:
        return False
    slot_shape = (table.shape[0], slot_width(rule, table.shape[1]))
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
    if any(
        t.device.type != "cpu"
        or tuple(t.shape) != (tuple(table.shape) if i == 0 else slot_shape)
        or not t.is_contiguous()
        or dtypes[i] not in KINDS
        for i, t in enumerate(tensors)
    ):
        return False
    sixteen_bit = any(d != "float32" for d in dtypes)
    if sixteen_bit and rule not in optimizer_rules.SIXTEEN_BIT_RULES:
        return False
    # The torch route's float32 scalars, read here (free on a CPU) and
    # passed on as the same float32 values.
    scalars = [float(x) for x in rule_scalars(optimizer, iterations, "float32")]
    if sixteen_bit:
        arrays = [(_bits(t), KINDS[d]) for t, d in zip(tensors, dtypes)]
        step = int(iterations)
        compact = [native.widen_rows(a, unique) for a in arrays]
        native.optimizer_rows(
            rule, compact, np.arange(len(unique)), np.asarray(summed), scalars
        )
        for name, array, rows in zip(names, arrays, compact):
            seed = int_seed(step, name) if stochastic else None
            native.narrow_rows(array, unique, rows, seed)
    else:
        arrays = [t.detach().numpy() for t in tensors]
        native.optimizer_rows(rule, arrays, unique, np.asarray(summed), scalars)
    for tensor in tensors:
        # Writes through NumPy bypass autograd's version counter; a graph
        # that saved the table must still see it changed.
        tensor[:0].zero_()
    return True


def _bits(tensor):
    """A CPU tensor's memory as NumPy: float32, or uint16 for 16 bits."""
    import torch

    if tensor.dtype == torch.float32:
        return tensor.detach().numpy()
    return tensor.detach().view(torch.int16).numpy().view(np.uint16)
