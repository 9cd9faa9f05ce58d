"""The PyTorch CPU update of SGD, Adagrad and Adam rows in one compiled pass.

After the compiled dedup (`keras_sparse.ops.native_rows`), the torch route
gathers the touched rows of the table and of each slot, runs the optimizer
as a dozen eager operations and scatters every array back: each row of a
large table is fetched from memory twice, and the eager operations cost
more than the arithmetic. For the built-in optimizers without a constraint
one C loop reads each row, updates it and writes it back instead
(`kernels/cpu_rows.c`), with the torch route's operations in its order, so
the two give the same bits (tests/test_native_rows.py).

Subclasses of these optimizers take the torch route: they may change the
update. ``FUSED_OPTIMIZERS = False`` turns the compiled pass off (the
benchmarks compare the two).
"""

import numpy as np

from keras_sparse.optimizers import SGD
from keras_sparse.optimizers import Adagrad
from keras_sparse.optimizers import Adam

#: Read at every update: False sends every optimizer down the torch route.
FUSED_OPTIMIZERS = True


def _scalars(optimizer, iterations, dtype):
    """``(rule, slot names, float scalars)`` of ``optimizer``'s compiled
    update at ``iterations``, or None where it has none."""
    kind = type(optimizer)
    if kind not in (SGD, Adagrad, Adam):
        return None
    # The torch route's learning rate: a float32 scalar tensor, read here
    # (a free read on a CPU) and passed on as that same float32.
    lr = optimizer.current_learning_rate(iterations, dtype)
    if kind is SGD:
        return "sgd", (), (float(lr),)
    if kind is Adagrad:
        return "adagrad", ("accumulator",), (float(lr), optimizer.epsilon)
    alpha = optimizer.step_size(lr, iterations, dtype)
    keep_1, keep_2 = 1 - optimizer.beta_1, 1 - optimizer.beta_2
    return (
        "adam",
        ("momentum", "velocity"),
        (keep_1, keep_2, float(alpha), optimizer.epsilon),
    )


def fused_update(native, optimizer, state, unique, summed, iterations, constraint):
    """Updates rows ``unique`` (int64 NumPy, distinct, in range) of
    ``state`` (``{"table": tensor, slot: tensor}``, CPU float32) in place
    from ``summed`` (their float32 NumPy gradients) in one compiled pass.

    Returns False, changing nothing, where the optimizer, the constraint
    or the arrays do not suit it; the caller then runs the torch route.
    """
    if not FUSED_OPTIMIZERS or constraint is not None:
        return False
    table = state["table"]
    found = _scalars(optimizer, iterations, table.dtype)
    if found is None:
        return False
    rule, slot_names, scalars = found
    if set(state) != {"table", *slot_names}:
        return False
    tensors = [table, *(state[name] for name in slot_names)]
    if (
        any(
            t.device.type != "cpu"
            or t.dtype != table.dtype
            or t.shape != table.shape
            or t.dim() != 2
            or not t.is_contiguous()
            for t in tensors
        )
        or str(table.dtype) != "torch.float32"
    ):
        return False
    arrays = [t.detach().numpy() for t in tensors]
    native.optimizer_rows(rule, arrays, unique, np.asarray(summed), scalars)
    for tensor in tensors:
        # Writes through NumPy bypass autograd's version counter; a graph
        # that saved the table must still see it changed.
        tensor[:0].zero_()
    return True
