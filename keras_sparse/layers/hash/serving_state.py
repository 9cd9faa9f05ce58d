"""Hash layers' serving maps stay out of JAX training steps' state.

Keras's JAX trainer hands every variable of the model into each compiled
training step and back out (``fit``, ``train_on_batch``), and
``train_on_batch`` assigns each one back afterwards. A training step never
reads a hash layer's serving map (`keras_sparse.layers.hash.serving_map`, four
variables per layer: its keys are mapped by the table), so while one of
those entry points runs, the layers leave the map out of ``variables``:
with a hundred hash fields that is four hundred arrays fewer through every
step and every sync. Inference entry points (``evaluate``, ``predict``, the
``*_on_batch`` forms, ``fit``'s validation) show it again, and a layer
called with ``training=False`` inside a training step maps its keys
through the table instead of the hidden map. ``model.weights``, saves and
exports always hold it.
"""

import contextlib
import contextvars

_HIDDEN = contextvars.ContextVar("keras_sparse_serving_maps_hidden", default=False)


def hidden():
    """True while a JAX training entry point runs (the maps are hidden)."""
    return _HIDDEN.get()


@contextlib.contextmanager
def serving_maps_hidden(hide=True):
    """Hides (``hide``) or shows the serving maps for the block."""
    token = _HIDDEN.set(hide)
    try:
        yield
    finally:
        _HIDDEN.reset(token)


def visible(layer, variables):
    """``variables`` of ``layer`` without its serving map while hidden."""
    if not _HIDDEN.get():
        return variables
    serving = layer.__dict__.get("_serving_ids")
    if not serving:
        return variables
    return [v for v in variables if id(v) not in serving]
