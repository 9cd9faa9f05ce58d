"""``bash tests/run.sh --help`` explains the script instead of running
pytest's help once per backend."""

import subprocess

import pytest

from tests import docs_blocks


@pytest.mark.backend_independent
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage_and_exits_zero(flag, tmp_path):
    done = subprocess.run(
        ["bash", str(docs_blocks.ROOT / "tests" / "run.sh"), "-x", flag],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: bash tests/run.sh [PYTEST ARGS...]")
    for part in ("KS_TEST_LANES=1", "jax", "tensorflow", "torch", "pytest run"):
        assert part in done.stdout, part
    assert "pytest [options]" not in done.stdout  # pytest's own help
    assert done.stderr == ""
