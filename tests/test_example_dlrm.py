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


def test_quick_dlrm_learns(capsys):
    result = load_example().main(["--quick"])
    out = capsys.readouterr().out
    # Progress in order: the untrained evaluation is reported before any
    # training epoch, the final line last.
    order = [out.find(s) for s in ("held-out before", "Epoch 1/", "final: auc")]
    assert -1 not in order and order == sorted(order), out
    assert result["auc"] > 0.6, result
    assert result["loss"] < result["initial_loss"], result
    assert result["train_loss"][-1] < result["train_loss"][0], result
    assert result["samples_per_s"] > 0
