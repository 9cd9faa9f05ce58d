"""Which replicas of a tf.distribute strategy this process holds.

Under `tf.distribute.MultiWorkerMirroredStrategy` each worker process holds
the components of its own replicas only (``experimental_local_results``):
replica ``r`` of the ``D`` in sync lives on worker ``r // L`` (``L`` local
replicas per worker) as its local component ``r % L``. A per-replica
variable's whole value then needs the other workers' parts: a collective
(``strategy.gather``) that every worker must call, in the same order. Under
`tf.distribute.MirroredStrategy` every replica is local.
"""

import tensorflow as tf

# Strategies whose replicas run the same step on every part of a sharded
# table (or copy of a replicated one); tested in tests/test_tf_sharded.py,
# tests/test_tf_mirrored.py and tests/test_tf_multiworker.py.
STRATEGIES = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
NAMES = "tf.distribute.MirroredStrategy or MultiWorkerMirroredStrategy"


def several_replicas():
    """``(strategy, replicas, where)`` of the active tf.distribute strategy
    when it runs more than one replica (``where`` names it for errors),
    else None."""
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    if replicas == 1:
        return None
    return strategy, replicas, f"{type(strategy).__name__} ({replicas} replicas)"


def check_built_outside_step(head):
    """Raises when a sharded layer is built inside a replica's step (its
    per-replica variables are made in the strategy's cross-replica scope)."""
    if not tf.distribute.in_cross_replica_context():
        raise ValueError(
            f"{head}: the layer is built inside a replica's step; build the "
            "model under strategy.scope() before training it."
        )


def first_local_replica(strategy):
    """The replica id (in sync) of this process's first local replica."""
    # MirroredExtended (MultiWorker's base) numbers local replicas from
    # this worker's place in the cluster (a chief task included).
    return int(strategy.extended._get_replica_id_in_sync_group(0))


def local_parts(strategy, parts):
    """This process's entries of ``parts`` (one per replica in sync)."""
    first = first_local_replica(strategy)
    return parts[first : first + len(strategy.extended.worker_devices)]


def is_multi_worker(strategy, components):
    """Whether ``components`` (a variable's local ones) miss other
    workers' replicas."""
    return len(components) < strategy.num_replicas_in_sync


def gather_whole(strategy, value, axis):
    """Every replica's component of the per-replica ``value`` concatenated
    along ``axis`` in replica order (a collective over the workers)."""
    return strategy.gather(value, axis=axis)
