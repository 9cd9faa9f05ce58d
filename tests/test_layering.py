"""The package's layers point one way (table <- ops <- layers <- sharding
<- data): the import-linter contract in pyproject.toml, checked on the
import graph of the installed source."""

import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.backend_independent

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_lower_layers_never_import_higher_ones():
    exe = shutil.which("lint-imports") or str(
        pathlib.Path(sys.executable).with_name("lint-imports")
    )
    done = subprocess.run(
        [exe, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout, done.stdout
