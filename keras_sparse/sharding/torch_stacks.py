"""`EmbeddingCollection` stacks sharded over torch.distributed processes.

See `keras_sparse.sharding.process_stacks` for what is decided and
`keras_sparse.sharding.torch_placement` for the process group, the
lookups (`torch_sharded_lookup`'s ``all_to_all_single``) and
DistributedDataParallel (the sharded stacks' parameters are among the
names it is told to ignore). Process ``d`` of a "table" or "row" stack
holds rows ``[d * B, (d + 1) * B)`` of the stack, of a "column" stack
columns ``[d * dim / D, (d + 1) * dim / D)``.
"""

from keras_sparse.sharding import torch_placement
from keras_sparse.sharding.torch_placement import TorchShardedPlacement


class Site:
    """The processes a collection's sharded stacks are split over."""

    def __init__(self, group, devices, rank):
        self.group, self.devices, self.rank = group, devices, rank
        self.where = f"{devices} torch.distributed processes"

    def placement(self, layer, stack, strategy):
        torch_placement._install_ddp_ignore()
        return TorchStackPlacement(
            strategy, self.group, self.devices, self.rank, layer.name,
            stack.rows, stack.dim,
        )  # fmt: skip


def site(layer):
    """A `Site` when several processes run (`torch_placement.process_group`),
    else None."""
    del layer
    where = torch_placement.process_group()
    return None if where is None else Site(*where)


class TorchStackPlacement(TorchShardedPlacement):
    """`TorchShardedPlacement` of one stack ("row" also for a "table"
    stack; ``num_rows`` the stack's rows; its lookup ignores
    ``batch.blocks``: each process updates its own part)."""

    def stack_weight(self, layer, table, shape, initializer, name, **kwargs):
        """This process's part of a ``shape`` (whole stack) variable."""
        rows, dim = shape
        if table:
            initializer = self.table_initializer(initializer, rows)
        part = (self.variable_rows(rows), self.variable_dim(dim))
        return layer.add_weight(
            shape=part, initializer=initializer, name=name, **kwargs
        )
