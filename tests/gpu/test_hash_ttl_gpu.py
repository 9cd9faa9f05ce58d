"""The time-to-live conformance suite re-run against the CuPy table."""

import pathlib
import sys

import pytest

from tests.gpu.gpu_layers import require_cuda

cp = require_cuda()

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from test_hash_ttl import *  # noqa: E402,F401,F403  (same tests, GPU fixture below)


@pytest.fixture
def device():
    return "gpu"


del test_sharded_expiry_matches_one_shard  # noqa: F821  (CPU shards: run once)
