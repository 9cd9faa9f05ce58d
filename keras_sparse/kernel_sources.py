"""Finds the CUDA sources of ``kernels/`` in a checkout or an installed wheel."""

import pathlib
import sys

_REPO_KERNELS = pathlib.Path(__file__).resolve().parents[1] / "kernels"
# setup.cfg installs kernels/*.cu here as data files.
_INSTALLED_KERNELS = pathlib.Path(sys.prefix) / "share" / "keras_sparse" / "kernels"


def kernel_source(name):
    """Text of ``kernels/<name>``; raises FileNotFoundError naming the places."""
    places = (_REPO_KERNELS / name, _INSTALLED_KERNELS / name)
    for path in places:
        if path.is_file():
            return path.read_text()
    raise FileNotFoundError(
        f"CUDA source {name!r} not found in {', '.join(str(p) for p in places)}; "
        "reinstall keras-sparse."
    )
