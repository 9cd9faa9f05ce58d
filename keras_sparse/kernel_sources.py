"""Finds the sources of ``keras_sparse/kernels/`` (CUDA, and C for CPUs).

They are package data, read through ``importlib.resources``: found the same
way in a checkout, an editable install, a wheel and ``pip install --target``.
"""

import importlib.resources
import re

# A local include of another file of the kernels (NVRTC compiles one string,
# so such includes are expanded here; nvcc resolves them itself).
_LOCAL_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"[ \t]*$', re.MULTILINE)


def _kernels():
    return importlib.resources.files("keras_sparse") / "kernels"


def _read(name):
    path = _kernels() / name
    if path.is_file():
        return path.read_text()
    raise FileNotFoundError(
        f"Kernel source {name!r} not found in {path}; reinstall keras-sparse."
    )


def kernel_source(name):
    """Text of ``keras_sparse/kernels/<name>`` with its local includes expanded
    in place.

    Raises FileNotFoundError naming the place searched.
    """
    return _LOCAL_INCLUDE.sub(lambda m: kernel_source(m.group(1)), _read(name))
