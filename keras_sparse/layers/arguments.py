"""Constructor arguments in the user's terms: unknown names get the close
valid ones, missing required ones say what they mean, sizes must be
positive integers."""

import difflib

import numpy as np

#: Keyword arguments every Keras layer takes (`keras.layers.Layer`).
KERAS_LAYER_ARGS = (
    "activity_regularizer",
    "trainable",
    "dtype",
    "autocast",
    "name",
    "input_dim",
    "input_shape",
)


class ArgumentError(TypeError, ValueError):
    """A wrong constructor argument (a TypeError, as Python raises for
    unexpected keywords, and a ValueError, as Keras raises for them)."""


def _close(name, valid):
    near = [v for v in valid if name in v or v in name]
    near += difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    return list(dict.fromkeys(near))[:3]


def _unknown(kwargs, valid):
    """``(count, text)`` of the keys of ``kwargs`` not in ``valid``, each
    with the close valid names."""
    unknown = [k for k in kwargs if k not in valid]
    parts = []
    for name in unknown:
        near = _close(name, valid)
        hint = f" (did you mean {', '.join(f'`{n}`' for n in near)}?)" if near else ""
        parts.append(f"`{name}`{hint}")
    return len(unknown), ", ".join(parts)


def check_known(layer_name, cls_name, kwargs, own):
    """Raises `ArgumentError` for keys of ``kwargs`` that neither the layer
    (``own``: its argument names) nor `keras.layers.Layer` accepts."""
    count, text = _unknown(kwargs, tuple(own) + KERAS_LAYER_ARGS)
    if not count:
        return
    raise ArgumentError(
        f"Layer '{layer_name}' ({cls_name}): unknown argument"
        f"{'s' if count > 1 else ''} {text}. Valid "
        f"arguments: {', '.join(own)}, and Keras layer arguments "
        f"({', '.join(KERAS_LAYER_ARGS[:5])})."
    )


def check_fields(where, given, valid):
    """Raises `ArgumentError` for keys of the dict ``given`` not in ``valid``
    (e.g. a table's settings given as a dict), naming the close ones."""
    count, text = _unknown(given, tuple(valid))
    if count:
        raise ArgumentError(
            f"{where}: unknown setting{'s' if count > 1 else ''} {text}. "
            f"Valid settings: {', '.join(valid)}."
        )


def check_given(layer_name, cls_name, name, value, meaning, kwargs):
    """Raises `ArgumentError` when the required ``name`` is missing (None),
    naming a misspelt keyword in ``kwargs`` that was probably meant."""
    if value is not None:
        return
    near = [k for k in kwargs if name in _close(k, (name,))]
    hint = f"; `{near[0]}` is not an argument of this layer" if near else ""
    raise ArgumentError(
        f"Layer '{layer_name}' ({cls_name}): missing `{name}` ({meaning}){hint}."
    )


def check_choice(layer_name, name, value, choices):
    """Raises `ArgumentError` when ``value`` is not one of ``choices``,
    naming a choice that differs only in case."""
    if any(value is c or (isinstance(value, str) and value == c) for c in choices):
        return
    same = [c for c in choices if isinstance(c, str) and isinstance(value, str)]
    same = [c for c in same if c.lower() == value.lower()]
    hint = f" (did you mean {same[0]!r}?)" if same else ""
    raise ArgumentError(
        f"Layer '{layer_name}': unknown `{name}`={value!r}{hint}. Valid choices "
        f"are {', '.join(repr(c) for c in choices)}."
    )


def check_positive_int(where, name, value):
    """Raises ValueError unless ``value`` is a positive integer (a bool is
    not); ``where`` opens the message (e.g. ``"Layer 'name'"``)."""
    if (
        not isinstance(value, (int, np.integer))
        or isinstance(value, bool)
        or value <= 0
    ):
        raise ValueError(
            f"{where}: `{name}` must be a positive integer. Received: "
            f"{name}={value!r} (of type {type(value).__name__})."
        )
