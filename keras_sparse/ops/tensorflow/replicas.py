"""The sparse update under tf.distribute: every replica applies the same one.

Under `tf.distribute.MirroredStrategy` (and MultiWorkerMirroredStrategy,
whose all-gathers span the workers) the table and slots are mirrored
variables, one copy per replica, and each replica's backward pass sees only
its own slice of the batch. Updating each copy from its own slice would let
the copies drift apart and train differently from one device. So the
gradient function all-gathers the ids and row gradients of every replica
and each replica applies the update of the whole global batch to its own
copy: the copies stay identical and equal one device's table. Keras scales
each replica's loss by ``1 / replicas``, so the gathered gradients already
sum to the one-device gradient (as tf.distribute sums dense gradients).
"""

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from keras_sparse.ops import hash_layer_refusal
from keras_sparse.ops import variable_layer_name
from keras_sparse.ops.tensorflow import workers as tf_workers

# Strategies whose variables are plain mirrors updated per replica and whose
# training this module is tested under (MultiWorkerMirroredStrategy: the
# all-gather spans the workers); others (TPUStrategy,
# ParameterServerStrategy, CentralStorageStrategy) raise rather than train
# unverified.
_SUPPORTED = tf_workers.STRATEGIES


def replica_count():
    """Replicas whose batches one sparse update combines (1 on one device).

    A layer's row regularizer scales its penalty by it: Keras divides each
    replica's added losses by the replica count, but the penalty covers only
    that replica's rows.
    """
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return 1
    return tf.distribute.get_replica_context().num_replicas_in_sync


def multi_replica_context():
    """The replica context when there is more than one replica, else None."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def check_replicated_training(name, maps_keys):
    """Raises a clear error for what cannot train exactly on several
    replicas: a strategy other than (MultiWorker)MirroredStrategy, an
    XLA-compiled step, and a layer that maps keys to rows on the host
    (``maps_keys``: each replica would map its own keys, so the replicas'
    tables would differ)."""
    context = multi_replica_context()
    if context is None:
        return
    strategy = tf.distribute.get_strategy()
    where = f"{type(strategy).__name__} ({context.num_replicas_in_sync} replicas)"
    if not isinstance(strategy, _SUPPORTED):
        raise NotImplementedError(
            f"Layer '{name}': a sparse `optimizer` cannot train under {where}; "
            f"use {tf_workers.NAMES}, or `optimizer=None` for dense "
            "gradients."
        )
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        # Seen on CPU devices: ReplicaContext.all_gather inside an XLA
        # function returns the local value alone, which would train silently
        # wrong; on GPUs it is unverified.
        raise NotImplementedError(
            f"Layer '{name}': a sparse `optimizer` cannot train in an "
            f"XLA-compiled step under {where}: its all-gather of the "
            "replicas' ids and gradients needs a step without XLA. Compile "
            "the model with jit_compile=False."
        )
    if maps_keys:
        raise hash_layer_refusal(
            name,
            where,
            "with sharding='key' (or 'auto'; each replica then owns its "
            f"keys' table shard) under {tf_workers.NAMES}, or on one device",
        )


def replica_context(table_var, reset):
    """The replica context to gather over, or None when there is one replica
    (raising as `check_replicated_training` does)."""
    context = multi_replica_context()
    if context is not None:
        check_replicated_training(variable_layer_name(table_var), reset is not None)
    return context


def gather_batch(context, ids, valid, grads):
    """``(ids, valid, grads)`` of all replicas, concatenated in replica order.

    ``valid`` travels inside the ids (-1 where invalid), so one all-gather
    carries ids and gradients; replicas may hold different batch sizes.
    """
    marked = tf.where(valid, ids, -tf.ones_like(ids))
    all_ids, all_grads = context.all_gather([marked, grads], axis=0)
    return all_ids, all_ids >= 0, all_grads
