"""Model parallelism for keras_sparse embedding tables.

JAX (one program over a device mesh):

plan(model_or_layers, devices, memory_per_device, pinned, ...) -> Plan
propose_cache_rows(layer_or_spec, device_bytes_budget, ...) -> the largest
    device cache of a table with a row store that fits a budget
distribution(model_or_layers, devices=None, plan=None) -> ModelParallel
load_model(filepath, devices=None, plan=None) -> (model, distribution)
exchange_bytes(strategy, rows, dim, num_ids, devices) -> bytes per device

Every backend (TensorFlow and PyTorch place a table from its layer's
``sharding`` at build):

apply_plan(plan) -> sets each planned, unbuilt layer's ``sharding``
runnable_strategies(backend=None) -> what ``plan(strategies=...)`` may pick

PyTorch (torch.distributed processes; a layer's ``sharding`` decides at
build, see `keras_sparse.sharding.torch_placement`):

set_torch_process_group(group) -> the group of the tables' exchanges
torch_sharded_parameter_names(module) -> what DDP must not broadcast
"""

from keras_sparse.layers import placement as _placement
from keras_sparse.sharding import keras_integration as _keras_integration
from keras_sparse.sharding.keras_integration import RUNNABLE
from keras_sparse.sharding.keras_integration import distribution
from keras_sparse.sharding.keras_integration import load_model
from keras_sparse.sharding.plan_apply import apply_plan
from keras_sparse.sharding.plan_apply import runnable_strategies
from keras_sparse.sharding.plan_cost import STRATEGIES
from keras_sparse.sharding.plan_cost import propose_cache_rows
from keras_sparse.sharding.plan_result import Plan
from keras_sparse.sharding.plan_result import TablePlan
from keras_sparse.sharding.plan_spec import TableSpec
from keras_sparse.sharding.planner import plan

# The layers reach the sharding hooks through this seam (see
# `keras_sparse.layers.placement`), never by importing this package.
_placement.install(_keras_integration)


def exchange_bytes(*args, **kwargs):
    """See `keras_sparse.sharding.jax_exchange_bytes.exchange_bytes`."""
    from keras_sparse.sharding.jax_exchange_bytes import exchange_bytes as fn

    return fn(*args, **kwargs)


def set_torch_process_group(group):
    """See `keras_sparse.sharding.torch_placement.set_process_group`."""
    from keras_sparse.sharding.torch_placement import set_process_group

    set_process_group(group)


def torch_sharded_parameter_names(module):
    """See `keras_sparse.sharding.torch_placement.sharded_parameter_names`."""
    from keras_sparse.sharding.torch_placement import sharded_parameter_names

    return sharded_parameter_names(module)


__all__ = [
    "RUNNABLE",
    "STRATEGIES",
    "Plan",
    "TablePlan",
    "TableSpec",
    "apply_plan",
    "distribution",
    "exchange_bytes",
    "load_model",
    "plan",
    "propose_cache_rows",
    "runnable_strategies",
    "set_torch_process_group",
    "torch_sharded_parameter_names",
]
