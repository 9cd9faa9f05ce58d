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


def local_replicas(strategy):
    """Replica ids (in sync) of this process's replicas, in order."""
    first = first_local_replica(strategy)
    return tuple(range(first, first + len(strategy.extended.worker_devices)))


def _on_first_local(strategy, value, empty):
    """A per-replica value: ``value`` on this worker's first local replica,
    ``empty`` on its others (so each worker counts once)."""
    first = first_local_replica(strategy)

    def fn(context):
        return value if context.replica_id_in_sync_group == first else empty

    return strategy.experimental_distribute_values_from_function(fn)


def sum_over_workers(strategy, value):
    """The sum of every worker's ``value`` (a tensor of the same shape on
    each; a collective)."""
    per = _on_first_local(strategy, value, tf.zeros_like(value))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per, axis=None)


def gather_objects(strategy, obj):
    """Every worker's picklable ``obj``, in worker order (a collective, as
    torch.distributed's ``all_gather_object``)."""
    import pickle

    import numpy as np

    data = pickle.dumps(obj)
    # Collectives carry int32 on every device: the bytes padded to words.
    words = np.frombuffer(data + bytes(-len(data) % 4), np.int32)
    sizes = _on_first_local(
        strategy, tf.constant([len(data), len(words)]), tf.zeros([2], tf.int32)
    )
    payload = _on_first_local(strategy, tf.constant(words), tf.zeros([0], tf.int32))
    sizes = gather_whole(strategy, sizes, 0).numpy().reshape(-1, 2)
    whole = gather_whole(strategy, payload, 0).numpy()
    out, at = [], 0
    for size, count in sizes:
        if size:  # a worker's first local replica
            chunk = whole[at : at + count].tobytes()[:size]
            out.append(pickle.loads(chunk))  # noqa: S301 - the workers' own bytes
        at += count
    return out


def concat_over_workers(strategy, value):
    """``(whole, start)``: every worker's ``value`` (sizes may differ along
    axis 0) concatenated in worker order, and where this worker's starts
    (a collective)."""
    count = tf.shape(value)[:1]
    sizes = _on_first_local(strategy, count, tf.zeros_like(count))
    whole = _on_first_local(strategy, value, value[:0])
    sizes = gather_whole(strategy, sizes, 0)
    start = tf.reduce_sum(sizes[: first_local_replica(strategy)])
    return gather_whole(strategy, whole, 0), start
