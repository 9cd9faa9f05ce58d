"""One subprocess per test module: a test file that runs its cases in a
fresh interpreter (logical TensorFlow devices must be set before TensorFlow
starts) prints ``RESULTS {json}``; its tests read them through
`module_results`, which runs the file once per pytest session. Launches
of several processes take their ports from `free_ports`."""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CACHE = {}


def free_ports(n):
    """``n`` distinct ports free on localhost now (all bound at once, so
    none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def module_results(file, backend="tensorflow", timeout=400):
    """The ``RESULTS`` dict ``file`` prints when run as a script under
    ``backend``; a failed run fails every test that asks, with its output,
    without running the cases again."""
    if file not in _CACHE:
        path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=path)
        proc = subprocess.run(
            [sys.executable, os.path.abspath(file)],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=timeout,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
        if proc.returncode == 0 and lines:
            _CACHE[file] = json.loads(lines[-1][len("RESULTS ") :])
        else:
            _CACHE[file] = {"failure": proc.stdout[-3000:] + proc.stderr[-3000:]}
    results = _CACHE[file]
    if "failure" in results:
        pytest.fail(results["failure"])
    return results
