"""The sharding hooks the layers consult (`keras_sparse.layers.placement`).

One module per concept, gathered here as the provider the layers see:

* `entry_points`: `distribution` and `load_model` (JAX's ``ModelParallel``);
* `routing`: a layer's `TablePlacement` (`route`, `build_placement`) and
  where a hash layer's keys are mapped (`place_hash_table`,
  `map_keys_in_step`, `exchange_buckets`);
* `layouts`: rows per device, padding and the unsharded values checkpoints
  hold (`variable_rows`, `table_initializer`, `unpadded_value`, ...);
* `stacks`: the stacked variables of an `EmbeddingCollection`;
  `process_stacks`: their parts on TensorFlow replicas and PyTorch
  processes (`place_stacks`, `add_stack_weight`, `stack_value`, ...).
"""

from keras_sparse.sharding.entry_points import RUNNABLE
from keras_sparse.sharding.entry_points import distribution
from keras_sparse.sharding.entry_points import load_model
from keras_sparse.sharding.layouts import add_state_weight
from keras_sparse.sharding.layouts import assign_value
from keras_sparse.sharding.layouts import loaded_shape
from keras_sparse.sharding.layouts import padded_value
from keras_sparse.sharding.layouts import table_initializer
from keras_sparse.sharding.layouts import unpadded_value
from keras_sparse.sharding.layouts import variable_dim
from keras_sparse.sharding.layouts import variable_options
from keras_sparse.sharding.layouts import variable_rows
from keras_sparse.sharding.process_stacks import add_stack_weight
from keras_sparse.sharding.process_stacks import assign_stack_value
from keras_sparse.sharding.process_stacks import place_stacks
from keras_sparse.sharding.process_stacks import stack_value
from keras_sparse.sharding.routing import ExchangeBuckets
from keras_sparse.sharding.routing import build_placement
from keras_sparse.sharding.routing import check_hash_layer_processes
from keras_sparse.sharding.routing import exchange_buckets
from keras_sparse.sharding.routing import map_keys_in_step
from keras_sparse.sharding.routing import padded_rows
from keras_sparse.sharding.routing import place_hash_table
from keras_sparse.sharding.routing import route
from keras_sparse.sharding.stacks import StackLayout
from keras_sparse.sharding.stacks import collection_placement
from keras_sparse.sharding.stacks import collection_stacks
from keras_sparse.sharding.stacks import per_table_stacks
from keras_sparse.sharding.stacks import route_stack

__all__ = [
    "RUNNABLE",
    "ExchangeBuckets",
    "StackLayout",
    "add_stack_weight",
    "add_state_weight",
    "assign_stack_value",
    "assign_value",
    "build_placement",
    "check_hash_layer_processes",
    "collection_placement",
    "collection_stacks",
    "distribution",
    "exchange_buckets",
    "load_model",
    "loaded_shape",
    "map_keys_in_step",
    "padded_rows",
    "padded_value",
    "per_table_stacks",
    "place_stacks",
    "place_hash_table",
    "route",
    "route_stack",
    "stack_value",
    "table_initializer",
    "unpadded_value",
    "variable_dim",
    "variable_options",
    "variable_rows",
]
