"""Which built-in optimizers the compiled row updates run, and their scalars.

The compiled updates (`keras_sparse/kernels/cpu_rows.c`: SGD, Adagrad, Adam,
RowWiseAdagrad) take an optimizer as a rule name, its slots in order and a
few float scalars per step. Only these exact classes qualify: a subclass
may change the update.
"""

from keras_sparse.optimizers import SGD
from keras_sparse.optimizers import Adagrad
from keras_sparse.optimizers import Adam
from keras_sparse.optimizers import RowWiseAdagrad

_RULES = {SGD: ("sgd", ()), Adagrad: ("adagrad", ("accumulator",)),
          Adam: ("adam", ("momentum", "velocity")),
          RowWiseAdagrad: ("rowwise_adagrad", ("accumulator",))}  # fmt: skip
#: Rules whose slots hold one value per row (``[rows, 1]``), not per element.
ROW_WISE_RULES = frozenset({"rowwise_adagrad"})


def rule_of(optimizer):
    """``(rule, slot names in the rule's order)``, or None."""
    return _RULES.get(type(optimizer))


def slot_width(rule, dim):
    """The width of each of ``rule``'s slots for a table of ``dim`` columns."""
    return 1 if rule in ROW_WISE_RULES else dim


def rule_scalars(optimizer, iterations, dtype):
    """The rule's scalars at ``iterations`` completed updates, as the
    optimizer computes them (backend scalars, or Python floats)."""
    lr = optimizer.current_learning_rate(iterations, dtype)
    if type(optimizer) is SGD:
        return [lr]
    if type(optimizer) in (Adagrad, RowWiseAdagrad):
        return [lr, optimizer.epsilon]
    alpha = optimizer.step_size(lr, iterations, dtype)
    return [1 - optimizer.beta_1, 1 - optimizer.beta_2, alpha, optimizer.epsilon]
