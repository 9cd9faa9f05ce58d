"""Keeps hash layers' serving maps current for compiled inference and exports.

The serving map (`keras_sparse.layers.hash.serving_map`) is a copy of a hash
table's key->row map in model variables; a compiled ``predict``/``evaluate``
step or an exported artifact reads only that copy. This module wraps, once,
the entry points that start such reads so each first calls
`serving_map.refresh` on the model's hash layers (a scalar read when nothing
changed):

- the Keras trainer's ``evaluate``, ``predict``, ``test_on_batch`` and
  ``predict_on_batch`` (JAX and TensorFlow; ``fit``'s validation goes
  through ``evaluate``);
- ``ExportArchive.track`` (``model.export`` tracks the model first), which
  also adds the artifact's table update functions
  (`keras_sparse.layers.hash.serving_export`).

On JAX it also wraps ``fit`` and ``train_on_batch``, which leave the maps
out of the training steps' state (`keras_sparse.layers.hash.serving_state`).

On JAX ``model.export`` of a model with keras-sparse layers runs without
the active distribution, so a sharded model exports as one unsharded
artifact; with hash layers also with ``jax_enable_x64``, so the artifact
takes the int64 keys of its input signature whole (without x64 jax2tf would
wrap them to 32 bits).

Code that compiles inference itself (a ``jax.jit`` of
``model.stateless_call``, a ``tf.function`` of ``model(x)``) calls
`keras_sparse.refresh_serving_maps` after training changed the tables.
"""

import contextlib
import functools
import threading

from keras_sparse.layers.hash import serving_export
from keras_sparse.layers.hash import serving_map
from keras_sparse.layers.hash import serving_state

_lock = threading.Lock()
_installed = False


def _refreshing(original):
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        serving_map.refresh_all(self, show_progress=False)
        # Shown again, also in fit's validation (`serving_state`).
        with serving_state.serving_maps_hidden(False):
            return original(self, *args, **kwargs)

    wrapper._ks_refreshes = True
    return wrapper


def _wrap(cls, name):
    original = getattr(cls, name, None)
    if original is None or getattr(original, "_ks_refreshes", False):
        return
    setattr(cls, name, _refreshing(original))


def _exporting_with_x64(original):
    @functools.wraps(original)
    def export(self, *args, **kwargs):
        hashed = serving_map.hash_layers(self)
        if not hashed and not _has_tables(self):
            return original(self, *args, **kwargs)
        import jax
        import keras

        # One unsharded artifact: trace without the model's distribution
        # (variables are saved whole either way).
        distribution = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            # The artifact serves from the maps, also when exported in fit.
            with (
                jax.enable_x64(True) if hashed else contextlib.nullcontext(),
                serving_state.serving_maps_hidden(False),
            ):
                return original(self, *args, **kwargs)
        finally:
            keras.distribution.set_distribution(distribution)

    export._ks_refreshes = True
    return export


def _has_tables(model):
    """Whether ``model`` holds a keras-sparse layer (a table to export)."""
    from keras_sparse.layers import dense_serving_export

    return any(
        getattr(x, "keras_sparse_kind", None)
        for x in dense_serving_export.all_layers(model)
    )


def _wrap_track(cls):
    original = cls.track
    if getattr(original, "_ks_refreshes", False):
        return

    @functools.wraps(original)
    def track(self, resource):
        serving_map.refresh_all(resource)
        with serving_state.serving_maps_hidden(False):  # tracked with the maps
            result = original(self, resource)
            serving_export.attach(self, resource)
        return result

    track._ks_refreshes = True
    cls.track = track


def _trainer_class(backend):
    if backend == "jax":
        from keras.src.backend.jax.trainer import JAXTrainer

        return JAXTrainer
    if backend == "tensorflow":
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        return TensorFlowTrainer
    return None


def install():
    """Wraps the trainer and the export archive once (idempotent)."""
    global _installed
    import keras

    with _lock:
        if _installed:
            return
        backend = keras.backend.backend()
        trainer = _trainer_class(backend)
        if trainer is not None:
            for name in ("evaluate", "predict", "test_on_batch", "predict_on_batch"):
                _wrap(trainer, name)
        if backend == "jax":  # the steps' state: serving maps left out
            serving_state.install(trainer)
        try:
            from keras.src.export.saved_model_export_archive import (
                SavedModelExportArchive,
            )
        except ImportError:  # TensorFlow missing: nothing exports
            pass
        else:
            _wrap_track(SavedModelExportArchive)
        if backend == "jax" and not getattr(keras.Model.export, "_ks_refreshes", 0):
            keras.Model.export = _exporting_with_x64(keras.Model.export)
        _installed = True
