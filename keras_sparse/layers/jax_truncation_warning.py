"""Hides JAX's int64 truncation warning for inputs that only keras_sparse
layers read: those get their full keys (`keras_sparse.layers.jax_full_keys`)
or refuse ids beyond int32 (`keras_sparse.layers.jax_key_checks`), so the
warning would only alarm. Inputs any other layer reads keep it."""

import contextlib
import warnings
import weakref

_ours_cache = weakref.WeakKeyDictionary()
_TRUNCATION_WARNING = "Explicitly requested dtype int64 requested in asarray"


def _wide_inputs_all_ours(model):
    """True when each int64/uint64 input of a functional ``model`` is read
    only by keras_sparse layers (which get its full keys, or refuse ids
    beyond int32): JAX's truncation warning about them is then moot."""
    from keras import tree

    cached = _ours_cache.get(model)
    if cached is not None:
        return cached
    wide = {
        id(t)
        for t in tree.flatten(getattr(model, "inputs", None) or [])
        if str(getattr(t, "dtype", "")) in ("int64", "uint64")
    }
    ours = bool(wide)
    for layer in model._flatten_layers(include_self=False, recursive=True):
        for node in getattr(layer, "_inbound_nodes", []):
            args = tree.flatten((node.arguments.args, node.arguments.kwargs))
            if any(id(t) in wide for t in args) and not hasattr(
                layer, "keras_sparse_kind"
            ):
                ours = False
    _ours_cache[model] = ours
    return ours


@contextlib.contextmanager
def truncation_warning_moot(model):
    """Hides JAX's int64 truncation warning while ``model`` runs, when every
    wide input goes to keras_sparse layers (see `_wide_inputs_all_ours`)."""
    try:
        moot = _wide_inputs_all_ours(model)
    except (AttributeError, TypeError, ValueError):
        moot = False  # not a functional model: keep JAX's warning
    if not moot:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRUNCATION_WARNING)
        yield
