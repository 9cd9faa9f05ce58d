"""What every lookup primitive takes: the table's state and one batch.

Each backend's ``lookup(state, batch)`` (`keras_sparse.ops.jax.lookup`,
`keras_sparse.ops.tensorflow.lookup`, `keras_sparse.ops.torch.lookup`) and
each sharded placement's (`keras_sparse.layers.placement.TablePlacement`)
has this one signature; a backend or placement ignores the fields it has
no use for.
"""

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, eq=False)
class TableState:
    """A table and what its sparse update needs.

    ``table_var``: the ``[rows, dim]`` variable; ``slot_vars``: the
    optimizer's slot variables by name; ``anchor_var``: the scalar trainable
    variable whose gradient runs the update (TensorFlow, PyTorch);
    ``optimizer``: the `keras_sparse.optimizers.SparseOptimizer`;
    ``constraint``: applied to updated rows, or None;
    ``stochastic_rounding``: whether rows written into 16-bit tables and
    slots round stochastically (`keras_sparse.ops.row_rounding`).
    """

    table_var: Any
    slot_vars: dict
    anchor_var: Any
    optimizer: Any
    constraint: Any = None
    stochastic_rounding: bool = True


@dataclasses.dataclass(frozen=True, eq=False)
class LookupBatch:
    """One call's flat ids and how to look them up.

    ``ids``, ``valid``: ``[N]`` rows and whether each position counts;
    ``iterations``: the optimizer step, or None (a gather with no update).
    ``apply_update``: False for an inference call that goes through the
    primitive (JAX, where the table takes its "gradient" as it is).
    ``reset``: ``(mask, values)`` rows to re-initialize before the gather.
    ``segments``: ``[N]`` segment per position, computed ahead of the step
    (`keras_sparse.ops.row_updates.segments_from_positions`; unsharded
    tables). ``exchange_slot``: compact exchange positions (sharded JAX
    tables). ``blocks``: ``(batch_major, extents, row_ranges)`` of a stack
    of tables, updated table by table (`keras_sparse.ops.row_updates.
    TableBlocks`; TensorFlow without XLA, PyTorch).
    """

    ids: Any
    valid: Any
    iterations: Any = None
    apply_update: bool = True
    reset: Any = None
    segments: Any = None
    exchange_slot: Any = None
    blocks: Any = None
