"""Shared test setup: 8 virtual CPU devices for JAX, quiet logs, seeds."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.utils.set_random_seed(1234)
    yield
    # Without Keras's full garbage collection: late in a run the process
    # holds millions of objects and a full collection after every test cost
    # about as much as the tests themselves. One per file (below) bounds
    # what cycles can hold.
    keras.backend.clear_session(free_memory=False)


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage_per_file():
    yield
    import gc

    gc.collect()


def backend():
    return keras.backend.backend()


@pytest.fixture
def xla_route(monkeypatch):
    """JAX updates and gathers rows with XLA, not the compiled custom calls
    (`keras_sparse.ops.jax.native_rows`): for tests of the XLA route's own
    parts (the dedup scratch, sizes, reused forward rows)."""
    if backend() == "jax":
        from keras_sparse.ops.jax import native_rows as jax_native_rows

        monkeypatch.setattr(jax_native_rows, "FUSED_OPTIMIZERS", False)
        monkeypatch.setattr(jax_native_rows, "PREFETCH_GATHER", False)


# --- Progress: one line per finished test file (tests/run.sh sets
# KS_PROGRESS_FD to the terminal and KS_PROGRESS_LANE to the run's name), so
# both lanes show where they are while their full output goes to logs.
_PROGRESS_FD = os.environ.get("KS_PROGRESS_FD")
_progress = {"file": None, "counts": {}, "start": 0.0}


def _flush_progress():
    import time

    name = _progress["file"]
    if name is None or _PROGRESS_FD is None:
        return
    counts = ", ".join(f"{n} {k}" for k, n in sorted(_progress["counts"].items()))
    seconds = time.monotonic() - _progress["start"]
    lane = os.environ.get("KS_PROGRESS_LANE", "")
    line = f"[{lane}] {name}: {counts or 'nothing run'} ({seconds:.0f} s)\n"
    try:
        os.write(int(_PROGRESS_FD), line.encode())
    except (OSError, ValueError):
        pass  # no terminal to tell: the log has everything


def pytest_runtest_logstart(nodeid, location):
    # A file's time starts when its first test starts (its first report
    # comes after its module fixtures ran, which belong to it).
    import time

    if _PROGRESS_FD is None:
        return
    name = nodeid.split("::")[0]
    if name != _progress["file"]:
        _flush_progress()
        _progress.update(file=name, counts={}, start=time.monotonic())


def pytest_runtest_logreport(report):
    if _PROGRESS_FD is None:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        _progress["counts"][outcome] = _progress["counts"].get(outcome, 0) + 1


def pytest_sessionfinish(session, exitstatus):
    _flush_progress()
