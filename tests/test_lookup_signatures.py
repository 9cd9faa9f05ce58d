"""Every backend's lookup primitive, and every sharded placement's lookup,
takes the same two arguments (`keras_sparse.ops.lookup_batch`): the layers
never build arguments per backend. Each Keras backend's run checks its own
modules against one reference, so the three are checked against each other
without importing another framework."""

import dataclasses
import importlib
import inspect

import keras
import pytest

from keras_sparse import ops
from keras_sparse.layers.placement import TablePlacement
from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState

BACKEND = keras.backend.backend()

#: The placements of each backend (module, class).
PLACEMENTS = {
    "jax": [("jax_placement", "JaxMeshPlacement")],
    "tensorflow": [
        ("tf_placement", "TfShardedPlacement"),
        ("tf_stacks", "TfStackPlacement"),
        ("tf_key_placement", "TfKeyPlacement"),
    ],
    "torch": [
        ("torch_placement", "TorchShardedPlacement"),
        ("torch_stacks", "TorchStackPlacement"),
        ("torch_key_placement", "TorchKeyPlacement"),
    ],
}


def _reference(state: TableState, batch: LookupBatch): ...


def _own(backend):
    if backend != BACKEND:
        pytest.skip(f"checked in the KERAS_BACKEND={backend} run")


@pytest.mark.parametrize("backend", sorted(PLACEMENTS))
def test_backend_lookup_has_the_one_signature(backend):
    _own(backend)
    module = importlib.import_module(f"keras_sparse.ops.{backend}.lookup")
    assert ops.backend_module() is module
    assert inspect.signature(module.lookup) == inspect.signature(_reference)


@pytest.mark.parametrize("backend", sorted(PLACEMENTS))
def test_placement_lookups_have_the_one_signature(backend):
    _own(backend)
    protocol = inspect.signature(TablePlacement.lookup)
    gather = inspect.signature(TablePlacement.gather)
    assert list(protocol.parameters)[1:] == ["state", "batch"]
    for module, name in PLACEMENTS[backend]:
        cls = getattr(importlib.import_module(f"keras_sparse.sharding.{module}"), name)
        assert inspect.signature(cls.lookup) == protocol, name
        assert inspect.signature(cls.gather) == gather, name


def test_batch_and_state_are_frozen():
    batch = LookupBatch([1], [True], 3)
    assert (batch.apply_update, batch.reset, batch.blocks) == (True, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.ids = [2]
    with pytest.raises(dataclasses.FrozenInstanceError):
        TableState(None, {}, None, None).constraint = 1
