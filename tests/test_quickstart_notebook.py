"""examples/quickstart.ipynb runs end to end; it is committed without outputs.

The notebook is executed with nbclient in a temporary working directory, in
a kernel started from this interpreter (``sys.executable``: the "python3"
kernelspec's ``python`` is replaced by it), and its outputs are checked for
what a new user should see: progress bars, losses that fall, equal
predictions after ``load_model``, the printed plan, 8 devices.

The notebook sets its own backend (JAX) and its 8 virtual CPU devices, so it
runs once, in the JAX lane (``backend_independent``); the kernel's
environment has no ``KERAS_BACKEND`` or ``XLA_FLAGS`` of this run, so the
notebook's own settings are the ones in effect.
"""

import importlib.util
import os
import pathlib
import re
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.backend_independent

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"

# Prepended to the notebook before it runs (not saved): the kernel must be
# this interpreter and import this checkout's keras_sparse (found without
# importing it: importing it would import keras before the notebook sets the
# backend).
KERNEL_CHECK = f"""
import importlib.util, os, sys
assert sys.executable == {sys.executable!r}, sys.executable
origin = importlib.util.find_spec("keras_sparse").origin
assert origin.startswith({str(ROOT) + os.sep!r}), origin
print("inherited:", [k for k in ("KERAS_BACKEND", "XLA_FLAGS") if k in os.environ])
"""


def _kernel_env():
    env = {
        k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")
    }
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    return env


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after running it, and its wall time in seconds."""
    assert importlib.util.find_spec("ipykernel"), "pip install -r requirements-test.txt"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(KERNEL_CHECK, id="kernel-check"))
    workdir = tmp_path_factory.mktemp("quickstart")
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    start = time.monotonic()
    client.execute(env=_kernel_env())  # raises CellExecutionError on any error
    seconds = time.monotonic() - start
    print(f"\nquickstart.ipynb executed in {seconds:.0f} s")
    return nb, seconds


def _cell(nb, cell_id):
    (cell,) = [c for c in nb.cells if c.get("id") == cell_id]
    return cell


def _stdout(nb, cell_id):
    text = []
    for out in _cell(nb, cell_id).outputs:
        if out.output_type == "stream" and out.name == "stdout":
            text.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            text.append(out.data.get("text/plain", ""))
    return "".join(text)


def _losses(nb, cell_id):
    match = re.search(r"loss by epoch: \[([^\]]*)\]", _stdout(nb, cell_id))
    assert match, _stdout(nb, cell_id)[-2000:]
    return [float(v) for v in match.group(1).split()]


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=nbformat.NO_CONVERT)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    for cell in code:
        assert cell.outputs == [], f"cell {cell.id}: strip its outputs"
        assert cell.execution_count is None, f"cell {cell.id}: execution_count"
        assert "execution" not in cell.metadata, f"cell {cell.id}: timing metadata"
        # CI must not install anything: pip appears only in comments.
        for line in cell.source.splitlines():
            if not line.lstrip().startswith("#"):
                assert "pip" not in line, f"cell {cell.id}: {line}"


def test_runs_in_this_interpreter_with_its_own_settings(executed):
    nb, _ = executed
    assert "inherited: []" in _stdout(nb, "kernel-check")
    out = _stdout(nb, "backend")
    assert "backend: jax" in out, out
    assert "8 devices: ['cpu:0'" in out, out


def test_every_model_trains_with_progress_shown(executed):
    nb, _ = executed
    for cell_id in ("keras-model", "drop-in", "hash", "distributed"):
        out = _stdout(nb, cell_id)
        # verbose=1: Keras's progress bar, per epoch
        assert "Epoch 1/3" in out and "Epoch 3/3" in out, (cell_id, out[-2000:])
        assert "32/32" in out, (cell_id, out[-2000:])
        losses = _losses(nb, cell_id)
        assert losses[-1] < losses[0] - 0.03, (cell_id, losses)
    assert "a keras.layers.Embedding: True" in _stdout(nb, "drop-in")
    assert "first item ids: [1000000000006" in _stdout(nb, "hash")
    stats = _stdout(nb, "stats")
    assert re.search(r"'size': 100\b", stats) and "'capacity': 1024" in stats, stats


def test_loaded_model_predicts_the_same(executed):
    nb, _ = executed
    out = _stdout(nb, "save")
    assert "predictions equal after load_model: True" in out, out


def test_plan_is_printed_and_the_model_trains_on_8_devices(executed):
    nb, _ = executed
    plan = _stdout(nb, "plan")
    assert re.search(r"table\s+rows\s+dim\s+strategy", plan), plan
    assert re.search(r"^users\s+300\s+16\s+row\s+all 8", plan, re.M), plan
    assert re.search(r"^items\s+1024\s+16\s+key\s+all 8", plan, re.M), plan
    # the "why" lines
    assert "users: lowest cost that fits" in plan, plan
    assert "data: 56.2 KiB/device > 24.0 KiB free" in plan, plan
    assert "items: pinned to key" in plan, plan
    assert "max bytes/device 47.1 KiB of 64.0 KiB" in plan, plan
    out = _stdout(nb, "distributed")
    assert (
        "users table (304, 16) on 8 devices, one block per device: (38, 16)" in out
    ), out


def test_nothing_alarming_on_stderr(executed):
    """What a new user would take for a failure: tracebacks, XLA's warnings."""
    nb, seconds = executed
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", (cell.id, out)
            if out.output_type == "stream" and out.name == "stderr":
                assert "Traceback" not in out.text, (cell.id, out.text)
                assert "rematerialization" not in out.text, (cell.id, out.text)
    # about a minute on a 2-core CPU; far more means something got slow
    assert seconds < 300, seconds
