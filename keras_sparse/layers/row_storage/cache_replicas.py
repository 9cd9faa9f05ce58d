"""A table with ``cache_rows`` under a TensorFlow `MirroredStrategy` of one
process: one cache, mirrored on every replica, over one id map and store.

Each replica's step sees its slice of the batch and its own copy of the
cache variables. So that the copies hold the same ids in the same rows,
every replica all-gathers the batch's ids (in replica order, as the sparse
update gathers its gradients: `keras_sparse.ops.tensorflow.replicas`) and
asks the host to map the whole batch; the first replica to ask maps it and
carries out its moves (write-backs, store reads), the others get the same
answer (`Rounds`). Each replica then writes the same filled rows into
its copy, looks up its own positions and applies the whole batch's sparse
update: the copies stay identical and equal one device's cache. Under a
MultiWorkerMirroredStrategy the all-gathers span the workers and each
worker maps the whole batch once for its own replicas (`cache_workers`).
"""

import threading

import numpy as np


def replica_context():
    """The TensorFlow replica context of a step of several replicas, or
    None (other backends, one replica, cross-replica context)."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return None
    from keras_sparse.ops.tensorflow.replicas import multi_replica_context

    return multi_replica_context()


def gather(context, flat, use, words=None):
    """``(ids, use, start, words)``: every replica's flat ``ids`` and
    ``use``, in replica order, where this replica's positions start in
    them, and every replica's ``words`` (an int32 vector as long on each,
    carried by the same all-gather as the sizes; None without)."""
    import tensorflow as tf

    head = tf.shape(flat)[:1]
    if words is not None:
        head = tf.concat([head, words], 0)
    heads = tf.reshape(context.all_gather(head, axis=0), [-1, head.shape[0]])
    sizes, words = heads[:, 0], None if words is None else heads[:, 1:]
    replica = context.replica_id_in_sync_group
    start = tf.reduce_sum(sizes[:replica])
    ids, used = context.all_gather([flat, tf.cast(use, tf.int32)], axis=0)
    return ids, tf.cast(used, tf.bool), start, words


def local_replicas():
    """The replicas of the active strategy this process runs (every one
    under a MirroredStrategy; a worker's under MultiWorkerMirroredStrategy,
    whose all-gathers span the workers)."""
    import tensorflow as tf

    return len(tf.distribute.get_strategy().extended.worker_devices)


def replica_id(context):
    """This replica's number, an int32 tensor (for the host calls)."""
    import tensorflow as tf

    return tf.cast(context.replica_id_in_sync_group, tf.int32)


class Rounds:
    """Host work that every replica asks for and that must run once: the
    ``k``-th call of each kind by every replica in one training step (the
    layer's step counter, which every replica reads alike) is one round,
    computed by the first replica to ask and handed to the others. An error
    is handed on too, and later rounds refuse to run (the step's state is
    lost, as for a step that fails on one device); so do rounds after a
    step that some replica left unasked (a step aborted midway: the copies
    of the cache may differ). Setting or loading the table starts afresh."""

    def __init__(self, label, replicas):
        self.label = label
        self.replicas = int(replicas)
        self.lock = threading.Lock()
        self.calls = {}  # (kind, replica) -> (step, rounds asked in it - 1)
        self.pending = {}  # (kind, step, round) -> [result, replicas left]
        self.failed = None

    def run(self, kind, replica, step, compute):
        """``compute()``'s result for this replica's next round of
        ``kind`` in training step ``step`` (computed once per round)."""
        with self.lock:
            replica, step = int(np.asarray(replica)), int(np.asarray(step))
            stale = sorted({s for _, s, _ in self.pending if s != step})
            if stale and self.failed is None:
                self.failed = (
                    f"step {stale[0]} ended before every replica asked for its "
                    "cache rows (an aborted step): the replicas' copies may differ"
                )
            if self.failed is not None:
                raise RuntimeError(
                    f"Layer '{self.label}': an earlier step failed in its cache "
                    "mapping under the strategy; the cache was left as the last "
                    "good step had it. Restore the model from a checkpoint. "
                    f"First error: {self.failed}"
                )
            last, k = self.calls.get((kind, replica), (None, -1))
            k = k + 1 if last == step else 0
            self.calls[(kind, replica)] = (step, k)
            entry = self.pending.get((kind, step, k))
            if entry is None:
                try:
                    result = (True, compute())
                except Exception as e:  # handed to every replica of the round
                    self.failed = f"{type(e).__name__}: {e}"
                    result = (False, e)
                entry = self.pending[(kind, step, k)] = [result, self.replicas]
            entry[1] -= 1
            if not entry[1]:
                del self.pending[(kind, step, k)]
            ok, value = entry[0]
        if not ok:
            raise value
        return value
