"""Which built-in optimizers the compiled row updates run, and their scalars.

The compiled updates (`keras_sparse/kernels/cpu_rows.c`: SGD, Adagrad, Adam) take an
optimizer as a rule name, its slots in order and a few float scalars per
step. Only these exact classes qualify: a subclass may change the update.
"""

from keras_sparse.optimizers import SGD
from keras_sparse.optimizers import Adagrad
from keras_sparse.optimizers import Adam

_RULES = {SGD: ("sgd", ()), Adagrad: ("adagrad", ("accumulator",)),
          Adam: ("adam", ("momentum", "velocity"))}  # fmt: skip


def rule_of(optimizer):
    """``(rule, slot names in the rule's order)``, or None."""
    return _RULES.get(type(optimizer))


def rule_scalars(optimizer, iterations, dtype):
    """The rule's scalars at ``iterations`` completed updates, as the
    optimizer computes them (backend scalars, or Python floats)."""
    lr = optimizer.current_learning_rate(iterations, dtype)
    if type(optimizer) is SGD:
        return [lr]
    if type(optimizer) is Adagrad:
        return [lr, optimizer.epsilon]
    alpha = optimizer.step_size(lr, iterations, dtype)
    return [1 - optimizer.beta_1, 1 - optimizer.beta_2, alpha, optimizer.epsilon]
