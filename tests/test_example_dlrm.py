"""Smoke test of the main job: examples/dlrm.py in --quick mode learns.

Runs in-process on the active Keras backend (KERAS_BACKEND), so the backend
matrix of the test run covers it.
"""

import importlib.util
import pathlib

DLRM_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dlrm.py"


def load_example():
    spec = importlib.util.spec_from_file_location("dlrm_example", DLRM_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_dlrm_learns():
    result = load_example().main(["--quick"])
    assert result["auc"] > 0.6, result
    assert result["loss"] < result["initial_loss"], result
    assert result["train_loss"][-1] < result["train_loss"][0], result
    assert result["samples_per_s"] > 0
