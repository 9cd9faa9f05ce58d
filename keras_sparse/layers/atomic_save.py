"""Makes Keras saves of models holding keras_sparse layers atomic.

Keras opens the target file for writing (emptying it) before any layer's
state is written, so a crash mid-save would lose the previous good file.
This module wraps, once, Keras's two file writers that every save goes
through (``Model.save``, ``Model.save_weights``, ``keras.saving.save_model``
and ``save_weights``, ``keras.callbacks.ModelCheckpoint``):

- ``saving_lib.save_model``: a ``.keras`` file is written into an open
  temporary file (Keras writes a file object as it writes a path);
- ``saving_lib.save_weights_only``: a ``.weights.h5`` file is written
  under a temporary ``.weights.h5`` name;

and publishes the result with `keras_sparse.atomic_files` (fsync, then
rename over the target), so a crash at any point leaves the old file
loadable. Only models that hold a keras_sparse layer are affected; other
models, file objects, remote paths, unzipped folders and sharded weights
(``max_shard_size``) go to Keras untouched.
"""

import functools
import inspect
import os
import threading

from keras_sparse import atomic_files

_lock = threading.Lock()
_installed = False


def holds_keras_sparse_layers(model):
    """True when ``model`` (or a layer nested in it) is a keras_sparse layer."""
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        return False
    return any(
        type(layer).__module__.startswith("keras_sparse.")
        for layer in flatten(include_self=True, recursive=True)
    )


def _local_path(filepath, extension):
    """``filepath`` as a str when it is a local path ending in
    ``extension``; else None (Keras handles it as it is)."""
    if not isinstance(filepath, (str, os.PathLike)):
        return None
    from keras.src.utils import file_utils

    path = os.fspath(filepath)
    if not isinstance(path, str) or not path.endswith(extension):
        return None
    if path.startswith("hf://") or file_utils.is_remote_path(path):
        return None
    return path


def _atomic_model_save(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_model(model, filepath, *args, **kwargs):
        bound = signature.bind(model, filepath, *args, **kwargs)
        bound.apply_defaults()
        path = _local_path(filepath, ".keras")
        if not bound.arguments.get("zipped", True) or path is None:
            return original(*bound.args, **bound.kwargs)
        if not holds_keras_sparse_layers(model):
            return original(*bound.args, **bound.kwargs)
        with atomic_files.atomic_write(path) as f:
            bound.arguments["filepath"] = f
            return original(*bound.args, **bound.kwargs)

    save_model._ks_atomic = True
    return save_model


def _atomic_weights_save(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_weights_only(model, filepath, *args, **kwargs):
        bound = signature.bind(model, filepath, *args, **kwargs)
        bound.apply_defaults()
        path = _local_path(filepath, ".weights.h5")
        sharded = bound.arguments.get("max_shard_size") is not None
        if sharded or path is None or not holds_keras_sparse_layers(model):
            return original(*bound.args, **bound.kwargs)
        with atomic_files.atomic_path(path, suffix=".weights.h5") as temp:
            bound.arguments["filepath"] = temp
            return original(*bound.args, **bound.kwargs)

    save_weights_only._ks_atomic = True
    return save_weights_only


def install():
    """Wraps Keras's model and weights writers once (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        from keras.src.saving import saving_lib

        for name, wrap in (
            ("save_model", _atomic_model_save),
            ("save_weights_only", _atomic_weights_save),
        ):
            original = getattr(saving_lib, name)
            if not getattr(original, "_ks_atomic", False):
                setattr(saving_lib, name, wrap(original))
        _installed = True
