"""`EmbeddingCollection` stacks sharded over a (MultiWorker)MirroredStrategy's
replicas (across workers each worker holds its own replicas' parts).

See `keras_sparse.sharding.process_stacks` for what is decided and
`keras_sparse.sharding.tf_placement` for the variables (one
`ReplicaPartVariable` component per replica) and the lookups
(`tf_sharded_lookup`'s all-gathers). Replica ``d`` of a "table" or "row"
stack holds rows ``[d * B, (d + 1) * B)`` of the stack, of a "column" stack
columns ``[d * dim / D, (d + 1) * dim / D)``.
"""

from keras_sparse.ops.tensorflow import workers as tf_workers
from keras_sparse.sharding.tf_placement import TfShardedPlacement


class Site:
    """The replicas a collection's sharded stacks are split over."""

    def __init__(self, strategy, devices, where):
        self.strategy, self.devices, self.where = strategy, devices, where

    def placement(self, layer, stack, strategy):
        # Its all-gathers need a step without XLA ("auto" then picks one).
        layer.supports_jit = False
        return TfStackPlacement(strategy, self.devices, self.strategy, layer.name)


def site(layer):
    """A `Site` when ``layer`` is built under a (MultiWorker)MirroredStrategy
    of several replicas, else None."""
    active = tf_workers.several_replicas()
    if active is None:
        return None
    strategy, replicas, where = active
    head = f"Layer '{layer.name}' (EmbeddingCollection) under {where}"
    if not isinstance(strategy, tf_workers.STRATEGIES):
        raise NotImplementedError(
            f"{head}: TensorFlow shards a collection's tables under "
            f"{tf_workers.NAMES} only. Use one of them, or give the tables "
            "sharding='data'."
        )
    tf_workers.check_built_outside_step(head)
    return Site(strategy, replicas, where)


class TfStackPlacement(TfShardedPlacement):
    """`TfShardedPlacement` of one stack ("row" also for a "table" stack;
    its lookup ignores ``batch.blocks``: each replica updates its own part)."""

    def stack_weight(self, layer, table, shape, initializer, name, **kwargs):
        """This replica's parts of a ``shape`` (whole stack) variable."""
        return self.add_state_weight(
            layer, table, shape=shape, initializer=initializer, name=name, **kwargs
        )
