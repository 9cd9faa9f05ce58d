"""Checkpoints across backends and device counts: a model with a row- and a
column-sharded table and a key-sharded hash layer, trained sharded on one
backend and saved with ``model.save``, loads sharded on the others (and on
one device) with equal predictions, equal unsharded table state (values and
slots) and the hash layer's records key by key (vectors, slots, scores,
admission counts, clock).

Each cell is a subprocess of tests/checkpoint_matrix_worker.py (a backend is
fixed per process; torch cells start one gloo process per device).
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.backend_independent

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "checkpoint_matrix_worker.py"
TIMEOUT = 300


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cell(backend, devices, mode, path):
    """The RESULT of one cell (rank 0's, for torch)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    ranks = devices if backend == "torch" else 1
    port = str(_free_port())
    procs = []
    for rank in range(ranks):
        env_rank = dict(env, RANK=str(rank), WORLD_SIZE=str(ranks))
        env_rank.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), backend, str(devices), mode, str(path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env_rank,
                cwd=str(ROOT),
            )
        )
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{backend} x{devices} {mode} did not finish")
        assert proc.returncode == 0, f"{backend} x{devices} {mode}:\n{out[-4000:]}"
        outs.append(out)
    lines = [ln for ln in outs[0].splitlines() if ln.startswith("RESULT ")]
    assert lines, outs[0][-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _assert_same(got, want, where):
    np.testing.assert_allclose(
        got["predictions"], want["predictions"], atol=1e-5, err_msg=where
    )
    for table, state in want["state"].items():
        assert sorted(got["state"][table]) == sorted(state), where
        for name, value in state.items():
            mine = got["state"][table][name]
            if np.asarray(value).dtype.kind in "iu":  # keys, counts: exact
                assert mine == value, f"{where}: {table}/{name}"
                continue
            np.testing.assert_allclose(
                mine, value, atol=1e-6, err_msg=f"{where}: {table}/{name}"
            )


@pytest.mark.parametrize(
    "trainer, loaders",
    [
        (("tensorflow", 4), [("jax", 8), ("torch", 2), ("jax", 1)]),
        (("jax", 8), [("tensorflow", 4), ("torch", 2)]),
        (("torch", 2), [("tensorflow", 2), ("jax", 8)]),
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v[0], str) else None,
)
def test_sharded_checkpoint_loads_on_every_backend(tmp_path, trainer, loaders):
    path = tmp_path / "model.keras"
    trained = _cell(*trainer, "--train", path)
    for loader in loaders:
        got = _cell(*loader, "--load", path)
        _assert_same(got, trained, f"trained on {trainer}, loaded on {loader}")
