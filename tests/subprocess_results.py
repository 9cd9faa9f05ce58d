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


def launch_ranks(file, world, port, out, backend="torch"):
    """Runs ``file``'s ``__main__`` once per rank (``rank port out``
    arguments) with the repository on the path; the processes, in rank
    order, for `wait_ranks`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=path)
    return [
        subprocess.Popen(
            [sys.executable, os.path.abspath(file), str(r), str(port), str(out)],
            env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]  # fmt: skip


def wait_ranks(procs, timeout=300, check=True):
    """Waits for every process (killing those left at a failure); with
    ``check``, asserts each ended well, showing the end of a failed one's
    output. Returns their outputs."""
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert not check or p.returncode == 0, log[-4000:]
    return logs
