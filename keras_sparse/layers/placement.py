"""Where a layer's table lives: the seam between the layers and sharding.

Two parts:

* `TablePlacement`: the typed object a sharded table's lookups go through
  (one implementation per strategy family and backend, in
  `keras_sparse.sharding`). The layers call its methods and never look at
  how it moves ids and vectors. None stands for the local default: the
  whole table on this device, the per-backend primitive of
  `keras_sparse.ops`.
* `provider()`: the module of build-time hooks. Layers never import
  `keras_sparse.sharding` (it sits above them); it installs itself here when
  imported, which ``import keras_sparse`` always does. Its hooks decide, for
  the active distribution (JAX) or strategy / process group (TensorFlow,
  PyTorch), a layer's placement (``route``, ``build_placement``), its
  variables' rows, columns and initializer (``variable_rows``,
  ``variable_dim``, ``table_initializer``, ``variable_options``,
  ``add_state_weight``), how its state is saved unsharded
  (``unpadded_value`` / ``padded_value`` / ``assign_saved``), the
  tables of a collection (``collection_placement`` / ``collection_stacks``
  / ``route_stack``), compact exchange buffers (``exchange_buckets``) and
  where a hash layer's keys are mapped (``place_hash_table``,
  ``map_keys_in_step``).

A key-sharded hash layer's placement is also its `KeyMapper`
(`keras_sparse.layers.hash.key_mapper`, the one interface of every route
that maps a hash layer's keys to rows).
"""

from typing import Protocol
from typing import runtime_checkable

from keras_sparse.layers.hash.key_mapper import KeyMapper  # noqa: F401  (re-export)
from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState

_provider = None


@runtime_checkable
class TablePlacement(Protocol):
    """How one table's rows are spread over devices and reached by ids.

    ``strategy``: "row", "column" or "key" (a key-sharded hash layer's rows
    are looked up as a row-sharded table's). ``devices``: how many devices
    (or processes) hold a part of the table.

    ``lookup(state, batch)`` has the signature of every backend's
    ``keras_sparse.ops.<backend>.lookup.lookup`` (`TableState`,
    `LookupBatch` of `keras_sparse.ops.lookup_batch`; ``batch.ids`` are
    this device's flat batch positions, global row numbers of the unsharded
    table; the backward pass applies ``state.optimizer`` on each row's
    owner). ``gather(table_var, batch)`` reads rows with no update
    (inference, dense gradients). A placement ignores the fields of the
    batch it has no use for.
    """

    strategy: str
    devices: int

    def lookup(self, state: TableState, batch: LookupBatch): ...

    def gather(self, table_var, batch: LookupBatch): ...


def install(provider):
    """Makes ``provider`` (a module or object with the hooks above) the one
    the layers consult."""
    global _provider
    _provider = provider


def provider():
    if _provider is None:
        raise RuntimeError(
            "keras_sparse.layers need keras_sparse.sharding's placement hooks; "
            "import keras_sparse (or keras_sparse.sharding) first."
        )
    return _provider
