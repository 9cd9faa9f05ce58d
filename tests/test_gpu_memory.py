"""share_gpu_memory: argument checks and what it sets on this machine."""

import os
import subprocess
import sys
import textwrap

import pytest

import keras_sparse as ks
from tests.conftest import backend


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, True, "0.5", None])
def test_fraction_must_be_strictly_between_zero_and_one(bad):
    with pytest.raises(ValueError, match="table_fraction"):
        ks.share_gpu_memory(bad)


def test_sets_the_backend_share_before_first_use():
    # A fresh interpreter: the backend must not have touched a device yet.
    code = textwrap.dedent(
        """
        import os
        import keras_sparse as ks
        lines = ks.share_gpu_memory(table_fraction=0.3)
        print(lines)
        print("FRACTION", os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))
        """
    )
    env = dict(os.environ, KERAS_BACKEND=backend())
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    if backend() == "jax":
        assert "FRACTION 0.700" in out.stdout
    else:
        assert "FRACTION None" in out.stdout
    assert "cupy:" in out.stdout


@pytest.mark.skipif(backend() != "jax", reason="JAX preallocation only")
def test_warns_when_jax_is_already_initialized():
    import jax

    jax.devices()
    with pytest.warns(UserWarning, match="already initialized"):
        lines = ks.share_gpu_memory(0.25)
    assert lines[0].startswith("jax: already initialized")
