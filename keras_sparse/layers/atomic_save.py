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

``saving_lib.save_model`` and ``load_model`` also run under
`keras_sparse.layers.store_assets.assets_follow`: their layers' row-store
rows go through the file's assets, not the weights.
"""

import functools
import inspect
import os
import threading

from keras_sparse import atomic_files
from keras_sparse.layers import store_assets

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


def _atomic(original, extension, keras_only, temporary):
    """``original`` (a Keras file writer taking ``(model, filepath, ...)``)
    writing through ``temporary(path)`` (a context manager giving what Keras
    writes instead of ``filepath``) for local ``extension`` paths of models
    holding our layers; ``keras_only(arguments)``: calls left to Keras."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save(model, filepath, *args, **kwargs):
        bound = signature.bind(model, filepath, *args, **kwargs)
        bound.apply_defaults()
        path = _local_path(filepath, extension)
        if (
            path is None
            or keras_only(bound.arguments)
            or not holds_keras_sparse_layers(model)
        ):
            return original(*bound.args, **bound.kwargs)
        with temporary(path) as target:
            bound.arguments["filepath"] = target
            return original(*bound.args, **bound.kwargs)

    save._ks_atomic = True
    return save


def _with_assets(original):
    """``original`` run under `store_assets.assets_follow` (its saves and
    loads carry asset files)."""

    @functools.wraps(original)
    def call(*args, **kwargs):
        with store_assets.assets_follow():
            return original(*args, **kwargs)

    return call


def _atomic_model_save(original):
    """``.keras`` archives: Keras writes the zip into an open temporary file
    (unzipped folders are left to Keras)."""
    save = _with_assets(
        _atomic(
            original,
            ".keras",
            lambda arguments: not arguments.get("zipped", True),
            atomic_files.atomic_write,
        )
    )
    save._ks_atomic = True
    return save


def _model_load(original):
    load = _with_assets(original)
    load._ks_atomic = True
    return load


def _atomic_weights_save(original):
    """``.weights.h5`` files, written under a temporary ``.weights.h5`` name
    (sharded weights are left to Keras)."""
    return _atomic(
        original,
        ".weights.h5",
        lambda arguments: arguments.get("max_shard_size") is not None,
        lambda path: atomic_files.atomic_path(path, suffix=".weights.h5"),
    )


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
            ("load_model", _model_load),
        ):
            original = getattr(saving_lib, name)
            if not getattr(original, "_ks_atomic", False):
                setattr(saving_lib, name, wrap(original))
        _installed = True
