"""The docs' blocks for several devices or processes run as written.

A block marked ``<!-- runs on: BACKEND, devices: N -->`` or ``<!-- runs on:
BACKEND, processes: N -->`` (tests/docs_blocks.py) is a whole program: it
runs alone in a fresh interpreter (TensorFlow's logical devices must be set
before TensorFlow starts), only in the test run of its backend, on CPUs:

- ``devices: N``: one process; the block must end with a
  ``tf.distribute`` strategy of N replicas in its scope (it splits the CPU
  itself, as a reader without GPUs does).
- ``processes: N``: N processes launched as a launcher would: for torch
  torchrun's variables (``MASTER_ADDR``, ``MASTER_PORT`` a free port,
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), for TensorFlow a ``TF_CONFIG``
  naming N local workers on free ports.

Each block's own assertions check that sharding took effect; every process
must exit 0 within the timeout.
"""

import json
import os
import subprocess
import sys

import keras
import pytest

from tests import docs_blocks
from tests.subprocess_results import free_ports

TIMEOUT = 240  # seconds, for a block's processes together

LAUNCHED = [
    pytest.param(page, block, id=f"{page}:{block.line}")
    for page in docs_blocks.pages()
    for block in docs_blocks.launched(page)
]

# After a block on N devices: the strategy it built has N replicas.
_REPLICAS = """
import tensorflow as __tf
__found = [
    v.num_replicas_in_sync
    for v in __scope.values()
    if isinstance(v, __tf.distribute.Strategy)
]
assert __found and set(__found) == {{{count}}}, f"replicas: {{__found}}"
"""
# Every process: its output out, then exit without C++ teardown, which can
# abort ("terminate called without an active exception") while a gloo or
# collective thread winds down after the block's work is done.
_EXIT = """
import sys as __sys, os as __os
__sys.stdout.flush()
__sys.stderr.flush()
__os._exit(0)
"""


def _environments(launch):
    """One environment per process of ``launch``."""
    path = os.pathsep.join(
        filter(None, [str(docs_blocks.ROOT), os.environ.get("PYTHONPATH")])
    )
    base = dict(os.environ, KERAS_BACKEND=launch.backend, PYTHONPATH=path)
    base["CUDA_VISIBLE_DEVICES"] = ""  # CPU devices, as in CI, on any machine
    base.pop("TF_CONFIG", None)
    n = launch.count
    if launch.kind == "devices":
        return [base]
    ports = free_ports(n)
    if launch.backend == "torch":
        common = dict(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(ports[0]),
            WORLD_SIZE=str(n),
            LOCAL_WORLD_SIZE=str(n),
        )
        return [dict(base, **common, RANK=str(r), LOCAL_RANK=str(r)) for r in range(n)]
    workers = [f"localhost:{p}" for p in ports]
    return [
        dict(
            base,
            TF_CONFIG=json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": r}}
            ),
        )
        for r in range(n)
    ]


def _epilogue(launch):
    if launch.backend == "tensorflow":
        return _REPLICAS.format(count=launch.count) + _EXIT
    return _EXIT


@pytest.mark.parametrize(("page", "block"), LAUNCHED)
def test_block_runs_on_its_devices_or_processes(page, block, tmp_path):
    launch = block.launch
    if keras.config.backend() != launch.backend:
        pytest.skip(f"{page}:{block.line} runs on {launch.backend}")
    program = docs_blocks.program(page, block, _epilogue(launch))
    procs = []
    for rank, env in enumerate(_environments(launch)):
        log = open(tmp_path / f"process{rank}.log", "w+")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, "-c", program],
                    cwd=tmp_path,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
                log,
            )
        )
    failed = []
    try:
        for rank, (proc, log) in enumerate(procs):
            try:
                rc = proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                log.seek(0)
                failed.append(f"process {rank} ({rc}):\n{log.read()[-4000:]}")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    assert not failed, f"{page}:{block.line} on {launch}:\n" + "\n".join(failed)


@pytest.mark.backend_independent
def test_markers_parse(tmp_path, monkeypatch):
    """A devices/processes marker makes the block a program of its own (not
    part of the page's session); a misspelled one is refused."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n"
        "<!-- runs on: torch, processes: 3 -->\n```python\ny = 2\n```\n"
        "<!-- runs on: tensorflow, devices: 2 -->\n```python\nz = 3\n```\n"
    )
    monkeypatch.setattr(docs_blocks, "ROOT", tmp_path)
    found = docs_blocks.blocks("page.md")
    assert [b.launch for b in found] == [
        None,
        docs_blocks.Launch("torch", "processes", 3),
        docs_blocks.Launch("tensorflow", "devices", 2),
    ]
    assert [b.line for b in docs_blocks.launched("page.md")] == [6, 10]
    script, count = docs_blocks.script("page.md")
    assert count == 1 and "y = 2" not in script and "x = 1" in script
    assert docs_blocks.backends("page.md") is None  # not a page-wide marker
    page.write_text("<!-- runs on: tf, devices: 2 -->\n```python\nz = 3\n```\n")
    with pytest.raises(ValueError, match="page.md:1: write <!-- runs on"):
        docs_blocks.blocks("page.md")


@pytest.mark.backend_independent
def test_the_guide_runs_tensorflow_and_torch_blocks():
    """The multi-device guide's TensorFlow and PyTorch sections are run."""
    launches = {
        (b.launch.backend, b.launch.kind)
        for b in docs_blocks.launched("docs/guides/multi-device.md")
    }
    assert ("tensorflow", "devices") in launches
    assert ("torch", "processes") in launches
