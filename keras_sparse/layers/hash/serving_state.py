"""Hash layers' serving maps stay out of JAX training steps' state.

Keras's JAX trainer hands every variable of the model into each compiled
training step and back out (``fit``, ``train_on_batch``), and
``train_on_batch`` assigns each one back afterwards. A training step never
reads a hash layer's serving map (`keras_sparse.layers.hash.serving_map`, four
variables per layer: its keys are mapped by the table), so while one of
those entry points runs, the layers leave the map out of ``variables``:
with a hundred hash fields that is four hundred arrays fewer through every
step and every sync. Inference entry points (``evaluate``, ``predict``, the
``*_on_batch`` forms, ``fit``'s validation, exports) show it again, and a
layer called with ``training=False`` inside a training step maps its keys
through the table instead of the hidden map. ``model.weights``, saves and
exports always hold it. A state is assigned back through the list it was
taken from, whichever is shown where the sync runs (a validation that
failed inside ``fit``, a callback on another thread), and Keras's purge of
a step's variables never drops a map.
"""

import contextlib
import contextvars
import functools

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


def install(trainer):
    """Wraps Keras's JAX trainer class once: ``fit`` and ``train_on_batch``
    hide the maps; a state sync assigns a state back through the list it
    was taken from, and a purge never drops a map (see `_syncing`)."""
    for name, how in (
        ("fit", _hiding),
        ("train_on_batch", _hiding),
        ("_purge_model_variables", _hiding),
        ("jax_state_sync", _syncing),
    ):
        original = getattr(trainer, name, None)
        if original is None or getattr(original, "_ks_serving_state", False):
            continue
        wrapped = how(original)
        wrapped._ks_serving_state = True
        setattr(trainer, name, wrapped)


def _hiding(original):
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        with serving_maps_hidden():
            return original(self, *args, **kwargs)

    return wrapper


def _syncing(original):
    """Keras assigns a step's state back by zipping it with the model's
    variables, listed now: a state taken with the maps shown (``fit``'s
    validation, which failed, say) or hidden (a callback on another
    thread, where the context is not set) goes back through the list of its
    own length, whatever this thread's context."""

    @functools.wraps(original)
    def jax_state_sync(self):
        state = getattr(self, "_jax_state", None)
        if not state or getattr(self, "_jax_state_synced", False):
            return original(self)
        values = state.get("non_trainable_variables")
        hide = None if not values else _taken_hidden(self, len(values))
        if hide is None:
            return original(self)
        with serving_maps_hidden(hide):
            return original(self)

    return jax_state_sync


def _taken_hidden(model, n):
    """Whether a state of ``n`` non-trainable values was taken with the
    maps hidden (None: either way, or neither list has that length)."""
    lengths = model.__dict__.get("_ks_state_lengths")
    if lengths is None or n not in lengths:
        with serving_maps_hidden(True):
            hid = len(model.non_trainable_variables)
        with serving_maps_hidden(False):
            shown = len(model.non_trainable_variables)
        lengths = model.__dict__["_ks_state_lengths"] = (hid, shown)
    if lengths[0] == lengths[1] or n not in lengths:
        return None
    return n == lengths[0]
