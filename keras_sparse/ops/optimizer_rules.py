"""Which built-in optimizers the compiled row updates run, and their scalars.

The compiled updates (`keras_sparse/kernels/cpu_rows.c`: SGD, Adagrad, Adam,
RowWiseAdagrad, Ftrl) take an optimizer as a rule name, its slots in order
and a few float scalars per step. Only these exact classes qualify: a subclass
may change the update.
"""

from keras_sparse.optimizers import SGD
from keras_sparse.optimizers import Adagrad
from keras_sparse.optimizers import Adam
from keras_sparse.optimizers import Ftrl
from keras_sparse.optimizers import RowWiseAdagrad

_RULES = {SGD: ("sgd", ()), Adagrad: ("adagrad", ("accumulator",)),
          Adam: ("adam", ("momentum", "velocity")),
          RowWiseAdagrad: ("rowwise_adagrad", ("accumulator",)),
          Ftrl: ("ftrl", ("accumulator", "linear"))}  # fmt: skip
#: The rules' codes in the compiled kernels (cpu_rows.c's ks_rule_rows_f32).
RULE_CODES = {"sgd": 0, "adagrad": 1, "adam": 2, "rowwise_adagrad": 3, "ftrl": 4}
#: Rules whose slots hold one value per row (``[rows, 1]``), not per element.
ROW_WISE_RULES = frozenset({"rowwise_adagrad"})
#: Rules whose compiled update also serves bfloat16 and float16 tables and
#: slots (rows widened to float32, updated, written back rounded). The one
#: list the three compiled routes and `ks.compiled_cpu_helpers` read (as
#: this module's attribute, at each update).
SIXTEEN_BIT_RULES = frozenset(rule for rule, _ in _RULES.values())


def rule_of(optimizer):
    """``(rule, slot names in the rule's order)``, or None."""
    return _RULES.get(type(optimizer))


def compiled_optimizers():
    """The names of the optimizer classes the compiled updates run."""
    return [cls.__name__ for cls in _RULES]


def sixteen_bit_optimizers():
    """The names of the optimizer classes whose compiled update serves
    16-bit tables and slots (`SIXTEEN_BIT_RULES`)."""
    served = SIXTEEN_BIT_RULES  # read now: tests narrow it
    return [cls.__name__ for cls, (rule, _) in _RULES.items() if rule in served]


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
    if type(optimizer) is Ftrl:
        return _ftrl_scalars(optimizer, lr)
    alpha = optimizer.step_size(lr, iterations, dtype)
    return [1 - optimizer.beta_1, 1 - optimizer.beta_2, alpha, optimizer.epsilon]


def _ftrl_scalars(optimizer, lr):
    """lr, 2 * l2_shrinkage, the accumulator's power (-learning_rate_power),
    l1 and l2_reg: the scalars of `Ftrl`'s update, each as it computes them
    (l2_reg from lr in its dtype)."""
    l2_reg = optimizer.l2_regularization_strength + optimizer.beta / (2.0 * lr)
    return [
        lr, 2 * optimizer.l2_shrinkage_regularization_strength,
        -optimizer.learning_rate_power, optimizer.l1_regularization_strength, l2_reg,
    ]  # fmt: skip
