"""Compile-check every keras_sparse/kernels/*.cu with nvcc for the GPUs we target."""

import pathlib
import shutil
import subprocess

import pytest

KERNELS = sorted(
    (pathlib.Path(__file__).resolve().parents[1] / "keras_sparse" / "kernels").glob(
        "*.cu"
    )
)
NVCC = shutil.which("nvcc")


# nvcc sees no Keras backend: one run compiles them all.
pytestmark = pytest.mark.backend_independent


@pytest.mark.skipif(
    NVCC is None, reason="nvcc not found on PATH; CUDA compile check skipped"
)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", KERNELS, ids=lambda p: p.name)
def test_kernel_compiles(source, arch, tmp_path):
    # --std=c++17 matches the CuPy RawModule options used at run time.
    cmd = [
        NVCC,
        f"-arch={arch}",
        "--std=c++17",
        "-c",
        str(source),
        "-o",
        str(tmp_path / "k.o"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_kernels_present():
    assert KERNELS, "no keras_sparse/kernels/*.cu found"
