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
    keras.backend.clear_session()


def backend():
    return keras.backend.backend()
