"""Finds the sources of ``kernels/`` (CUDA, and C for CPUs) in a checkout or an
installed wheel."""

import pathlib
import re
import sys

_REPO_KERNELS = pathlib.Path(__file__).resolve().parents[1] / "kernels"
# setup.cfg installs the files of kernels/ here as data files.
_INSTALLED_KERNELS = pathlib.Path(sys.prefix) / "share" / "keras_sparse" / "kernels"
# A local include of another file of kernels/ (NVRTC compiles one string, so
# such includes are expanded here; nvcc resolves them itself).
_LOCAL_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"[ \t]*$', re.MULTILINE)


def _read(name):
    places = (_REPO_KERNELS / name, _INSTALLED_KERNELS / name)
    for path in places:
        if path.is_file():
            return path.read_text()
    raise FileNotFoundError(
        f"Kernel source {name!r} not found in {', '.join(str(p) for p in places)}; "
        "reinstall keras-sparse."
    )


def kernel_source(name):
    """Text of ``kernels/<name>`` with its local includes expanded in place.

    Raises FileNotFoundError naming the places searched.
    """
    return _LOCAL_INCLUDE.sub(lambda m: kernel_source(m.group(1)), _read(name))
