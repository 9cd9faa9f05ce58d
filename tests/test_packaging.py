"""A wheel carries what the package reads at run time: the kernel sources
(package data, found through importlib.resources) and the LICENSE."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from keras_sparse.kernel_sources import kernel_source
from tests import docs_blocks

ROOT = docs_blocks.ROOT
# What setuptools reads to build the wheel (copied, so that the build leaves
# nothing in the checkout).
FILES = ["setup.cfg", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
CHECK = """
import pathlib
import keras_sparse
from keras_sparse.kernel_sources import kernel_source
print(pathlib.Path(keras_sparse.__file__).parent)
for name in ("cpu_rows.c", "tf_rows_op.cc", "jax_rows_ffi.cc", "hash_table.cu"):
    print(name, len(kernel_source(name)))
"""


def _run(args, **kwargs):
    done = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _wheel(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "keras_sparse", src / "keras_sparse", ignore=ignore)
    for name in FILES:
        shutil.copy(ROOT / name, src / name)
    # An absolute path: a bare "src" would be a requirement name for pip.
    _run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
         + ["-w", str(tmp_path / "dist"), str(src)])  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("keras_sparse-*.whl")
    return wheel


@pytest.mark.backend_independent
def test_wheel_installed_with_target_finds_kernels_and_has_license(tmp_path):
    wheel = _wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        (license_file,) = [
            n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE")
        ]
        text = archive.read(license_file).decode()
    assert text == (ROOT / "LICENSE").read_text()
    assert "Apache License\n" in text and "Version 2.0, January 2004" in text

    target = tmp_path / "target"
    _run([*PIP, "install", "--no-deps", "--no-index", "--target", str(target)]
         + [str(wheel)])  # fmt: skip
    # cwd and PYTHONPATH away from the checkout: the installed copy runs.
    env = dict(os.environ, PYTHONPATH=str(target), KERAS_BACKEND="jax")
    out = _run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env).split("\n")
    assert out[0] == str(target / "keras_sparse")
    sizes = dict(line.split() for line in out[1:] if line)
    assert sizes == {name: str(len(kernel_source(name))) for name in sizes}
    assert len(sizes) == 4
    # hash_table.cu includes ks_hash.cuh: found beside it and expanded.
    raw = (ROOT / "keras_sparse" / "kernels" / "hash_table.cu").read_text()
    assert int(sizes["hash_table.cu"]) > len(raw)


@pytest.mark.backend_independent
def test_no_merge_conflict_markers_in_tracked_files():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for name in tracked:
        path = os.path.join(ROOT, name)
        if not name.endswith(
            (".py", ".md", ".cfg", ".toml", ".cu", ".cc", ".c", ".sh")
        ):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if line.startswith(("<<<<<<< ", ">>>>>>> ")) or line == "=======\n":
                    found.append(f"{name}:{number}")
    assert not found, found
