"""`import keras_sparse` where the backend Keras picks is not installed: one
ImportError naming KERAS_BACKEND, not Keras's long traceback."""

import os
import subprocess
import sys

import pytest

from tests import docs_blocks

# Makes a framework look uninstalled, as pip leaves it when it was never
# installed: its import raises ModuleNotFoundError.
BLOCK = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
import keras_sparse
"""


def _import_without(module, tmp_path, backend=None):
    env = dict(os.environ, PYTHONPATH=str(docs_blocks.ROOT))
    env["KERAS_HOME"] = str(tmp_path / "keras_home")  # no keras.json yet
    env.pop("KERAS_BACKEND", None)
    if backend:
        env["KERAS_BACKEND"] = backend
    done = subprocess.run(
        [sys.executable, "-c", BLOCK.format(module=module)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    return done.stderr.strip().split("\n")


@pytest.mark.backend_independent
def test_unset_backend_without_tensorflow_says_to_set_keras_backend(tmp_path):
    lines = _import_without("tensorflow", tmp_path)
    last = lines[-1]
    assert last.startswith("ImportError: Keras picked its default 'tensorflow'")
    assert "KERAS_BACKEND is unset" in last
    assert "'tensorflow' is not installed" in last
    assert "Set KERAS_BACKEND=jax|torch before importing keras" in last
    assert len(lines) < 20, "\n".join(lines)  # not Keras's 40 frames
    # Keras wrote its default to keras.json: the second import says so.
    last = _import_without("tensorflow", tmp_path)[-1]
    assert str(tmp_path / "keras_home" / "keras.json") in last, last


@pytest.mark.backend_independent
def test_backend_set_to_a_missing_framework_names_it(tmp_path):
    last = _import_without("torch", tmp_path, backend="torch")[-1]
    assert last.startswith("ImportError: KERAS_BACKEND=torch, but 'torch' is not")
    assert "Set KERAS_BACKEND=tensorflow|jax before" in last, last
