"""Turns the layer's ``optimizer=`` argument into a sparse optimizer."""

import keras

from keras_sparse.optimizers.adagrad import Adagrad
from keras_sparse.optimizers.adam import Adam
from keras_sparse.optimizers.base import SparseOptimizer
from keras_sparse.optimizers.ftrl import Ftrl
from keras_sparse.optimizers.rowwise_adagrad import RowWiseAdagrad
from keras_sparse.optimizers.sgd import SGD

_BY_NAME = {cls.identifier: cls for cls in (SGD, Adagrad, RowWiseAdagrad, Adam, Ftrl)}
_ALIASES = {"row_wise_adagrad": "rowwise_adagrad", "rowwiseadagrad": "rowwise_adagrad"}

# Keras optimizer class -> (sparse class, hyperparameters to carry over).
_KERAS_MIRRORS = {
    keras.optimizers.SGD: (SGD, ()),
    keras.optimizers.Adagrad: (Adagrad, ("initial_accumulator_value", "epsilon")),
    keras.optimizers.Adam: (Adam, ("beta_1", "beta_2", "epsilon")),
    keras.optimizers.Ftrl: (
        Ftrl,
        (
            "learning_rate_power",
            "initial_accumulator_value",
            "l1_regularization_strength",
            "l2_regularization_strength",
            "l2_shrinkage_regularization_strength",
            "beta",
        ),
    ),
}

# Keras optimizer options that have no row-wise meaning, with their neutral value.
_NEUTRAL_OPTIONS = {
    "weight_decay": None,
    "clipnorm": None,
    "clipvalue": None,
    "global_clipnorm": None,
    "use_ema": False,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
    "momentum": 0.0,
    "nesterov": False,
    "amsgrad": False,
}


def choices():
    """Names accepted by `get`, for error messages and docs."""
    return sorted(_BY_NAME)


def get(identifier, layer_name="layer"):
    """Returns a `SparseOptimizer` for ``identifier`` (or None for None).

    Accepts a sparse optimizer instance, one of the names in `choices()`, a
    serialized config dict, or an instance of keras.optimizers.SGD, Adagrad,
    Adam or Ftrl whose class and hyperparameters are mirrored.
    """
    if identifier is None or isinstance(identifier, SparseOptimizer):
        return identifier
    if isinstance(identifier, str):
        key = identifier.lower()
        key = _ALIASES.get(key, key)
        if key not in _BY_NAME:
            raise ValueError(
                f"{layer_name}: unknown `optimizer`={identifier!r}. Valid choices "
                f"are None, {', '.join(repr(c) for c in choices())}, a "
                "keras_sparse.optimizers instance, or a keras SGD/Adagrad/Adam/"
                "Ftrl instance."
            )
        return _BY_NAME[key]()
    if isinstance(identifier, dict):
        return keras.saving.deserialize_keras_object(identifier)
    if isinstance(identifier, keras.optimizers.Optimizer):
        return _mirror_keras_optimizer(identifier, layer_name)
    raise ValueError(
        f"{layer_name}: `optimizer` must be None, a string in {choices()}, a "
        "keras_sparse.optimizers instance or a keras optimizer instance. "
        f"Received: {identifier!r}"
    )


def _mirror_keras_optimizer(optimizer, layer_name):
    # Backends swap in subclasses (e.g. torch's parallel Adam); the public
    # Keras class is the first one defined in keras' optimizers package.
    public = next(
        (
            c
            for c in type(optimizer).__mro__
            if c.__module__.startswith("keras.src.optimizers.")
        ),
        type(optimizer),
    )
    mirror = _KERAS_MIRRORS.get(public)
    if mirror is None:
        raise ValueError(
            f"{layer_name}: keras optimizer {public.__name__} has no "
            "sparse counterpart. Supported: "
            f"{', '.join(c.__name__ for c in _KERAS_MIRRORS)}."
        )
    sparse_cls, carried = mirror
    config = optimizer.get_config()
    for option, neutral in _NEUTRAL_OPTIONS.items():
        if option in config and config[option] not in (neutral, None, False, 0.0):
            raise ValueError(
                f"{layer_name}: {type(optimizer).__name__}({option}="
                f"{config[option]!r}) cannot be applied row by row; leave it at "
                f"{neutral!r} for the embedding optimizer."
            )
    kwargs = {name: config[name] for name in carried}
    return sparse_cls(learning_rate=config["learning_rate"], **kwargs)


def serialize(optimizer):
    return keras.saving.serialize_keras_object(optimizer)


def deserialize(config):
    return keras.saving.deserialize_keras_object(config)
