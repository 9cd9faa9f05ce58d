"""Imports Keras first, turning "backend not installed" into one clear line.

Keras imports its backend's framework when it is first imported; with
``KERAS_BACKEND`` unset that is TensorFlow, and a missing TensorFlow ends
in a long traceback about ``tensorflow`` that never mentions the variable.
"""

import importlib.util
import json
import os

# A Keras backend -> the module it imports, and the pip package giving it.
_FRAMEWORKS = {
    "tensorflow": ("tensorflow", "tensorflow"),
    "jax": ("jax", "jax"),
    "torch": ("torch", "torch"),
}


def _installed():
    return [b for b, (module, _) in _FRAMEWORKS.items() if _has(module)]


def _has(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def picked_backend():
    """``(backend, where from)``: the backend Keras picks at import, found as
    Keras finds it: ``KERAS_BACKEND``, else ``keras.json`` in the Keras home
    folder, else TensorFlow (``None``). Keras's own record of it is gone
    when its import failed."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"], "KERAS_BACKEND"
    home = os.environ.get("KERAS_HOME")
    if home is None:
        base = os.path.expanduser("~")
        home = os.path.join(base if os.access(base, os.W_OK) else "/tmp", ".keras")
    path = os.path.join(os.path.expanduser(home), "keras.json")
    try:
        with open(path) as f:
            return json.load(f)["backend"], path
    except (OSError, ValueError, KeyError, TypeError):
        return "tensorflow", None


def missing_backend_message(backend, source):
    """The error for a Keras backend whose framework is not installed;
    ``source`` as `picked_backend` gives it."""
    module, package = _FRAMEWORKS[backend]
    installed = _installed()
    if source == "KERAS_BACKEND":
        why = f"KERAS_BACKEND={backend}"
    elif source is None:
        why = f"Keras picked its default {backend!r} backend (KERAS_BACKEND is unset)"
    else:
        why = (
            f"Keras picked the {backend!r} backend named in {source} "
            "(KERAS_BACKEND is unset; Keras writes its default, TensorFlow, "
            "there when it is first imported)"
        )
    found = f"installed: {', '.join(installed)}" if installed else "none installed"
    return (
        f"{why}, but {module!r} is not installed ({found}). Set "
        f"KERAS_BACKEND={'|'.join(installed or _FRAMEWORKS)} before importing "
        f"keras or keras_sparse, or install {package!r}."
    )


def import_keras():
    """``import keras``; a missing backend framework raises ImportError with
    `missing_backend_message` (without Keras's long traceback)."""
    # Read before the import: a first import of Keras writes keras.json.
    backend, source = picked_backend()
    try:
        import keras  # noqa: F401
    except ModuleNotFoundError as error:
        module = _FRAMEWORKS.get(backend, (None,))[0]
        name = error.name or ""
        if module is None or name.partition(".")[0] != module or _has(module):
            raise
        raise ImportError(missing_backend_message(backend, source)) from None


import_keras()
