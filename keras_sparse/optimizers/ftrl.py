"""FTRL-Proximal on touched rows, matching keras.optimizers.Ftrl."""

import keras
from keras import ops

from keras_sparse.optimizers.base import SlotSpec
from keras_sparse.optimizers.base import SparseOptimizer


@keras.saving.register_keras_serializable(package="keras_sparse")
class Ftrl(SparseOptimizer):
    """Follow-the-regularized-leader, applied to the rows a batch touched.

    Example:

    >>> import keras_sparse as ks
    >>> opt = ks.optimizers.Ftrl(0.05, l1_regularization_strength=1e-4)
    >>> layer = ks.AllToAllDenseEmbedding(100, 8, optimizer=opt)
    """

    identifier = "ftrl"

    def __init__(
        self,
        learning_rate=0.001,
        learning_rate_power=-0.5,
        initial_accumulator_value=0.1,
        l1_regularization_strength=0.0,
        l2_regularization_strength=0.0,
        l2_shrinkage_regularization_strength=0.0,
        beta=0.0,
    ):
        super().__init__(learning_rate)
        checks = {
            "initial_accumulator_value": initial_accumulator_value,
            "l1_regularization_strength": l1_regularization_strength,
            "l2_regularization_strength": l2_regularization_strength,
            "l2_shrinkage_regularization_strength": (
                l2_shrinkage_regularization_strength
            ),
        }
        for name, value in checks.items():
            if value < 0:
                raise ValueError(f"Ftrl: `{name}` must be >= 0. Received: {value}")
        if learning_rate_power > 0:
            raise ValueError(
                "Ftrl: `learning_rate_power` must be <= 0. "
                f"Received: {learning_rate_power}"
            )
        self.learning_rate_power = float(learning_rate_power)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.l1_regularization_strength = float(l1_regularization_strength)
        self.l2_regularization_strength = float(l2_regularization_strength)
        self.l2_shrinkage_regularization_strength = float(
            l2_shrinkage_regularization_strength
        )
        self.beta = float(beta)

    def slot_specs(self):
        return [
            SlotSpec("accumulator", self.initial_accumulator_value),
            SlotSpec("linear"),
        ]

    def new_slots(self, rows, slots, grads, lr, iterations):
        lr_power = self.learning_rate_power
        grad_to_use = grads + 2 * self.l2_shrinkage_regularization_strength * rows
        accum = slots["accumulator"]
        new_accum = accum + ops.square(grads)
        power_new = ops.power(new_accum, -lr_power)
        linear = (
            slots["linear"]
            + grad_to_use
            - ((power_new - ops.power(accum, -lr_power)) / lr) * rows
        )
        return {"accumulator": new_accum, "linear": linear}

    def rows_from_slots(self, rows, new_slots, grads, lr, iterations):
        l2_reg = self.l2_regularization_strength + self.beta / (2.0 * lr)
        power_new = ops.power(new_slots["accumulator"], -self.learning_rate_power)
        quadratic = power_new / lr + 2 * l2_reg
        l1 = self.l1_regularization_strength
        linear = new_slots["linear"]
        return (ops.clip(linear, -l1, l1) - linear) / quadratic

    def get_config(self):
        return {
            **super().get_config(),
            "learning_rate_power": self.learning_rate_power,
            "initial_accumulator_value": self.initial_accumulator_value,
            "l1_regularization_strength": self.l1_regularization_strength,
            "l2_regularization_strength": self.l2_regularization_strength,
            "l2_shrinkage_regularization_strength": (
                self.l2_shrinkage_regularization_strength
            ),
            "beta": self.beta,
        }
