"""A table with ``cache_rows`` under a TensorFlow
`MultiWorkerMirroredStrategy`: a copy of the cache in every worker, all
equal.

Each worker process holds its own id map, store and cache variables
(mirrored on its replicas), started from identical contents: the store's
initial rows are drawn per id from the initializer's seed (`shared_seed`
gives an unseeded initializer the chief's seed) and `check` compares the
workers' copies in their steps. In each step every replica all-gathers
the batch's ids across the workers (`cache_replicas.gather`, the same
collective as on one worker) and each worker maps the whole batch with
its own map, once for its replicas (`cache_replicas.Rounds`): every copy
makes the same mapping, fills and write-backs, and the sparse update's
all-gather (`keras_sparse.ops.tensorflow.replicas`) applies the whole
batch's update to every copy.
"""

import hashlib

import numpy as np

from keras_sparse.layers.row_storage import cache_copies

# int32 words of a worker's fingerprint: its store's folder (2), its
# copy's digest (4). Collectives carry int32 on every device.
WORDS = 6


def spans_workers():
    """Whether the active TensorFlow strategy runs replicas in several
    worker processes."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        return False
    strategy = tf.distribute.get_strategy()
    local = len(getattr(strategy.extended, "worker_devices", ()))
    multi = tf.distribute.MultiWorkerMirroredStrategy
    return isinstance(strategy, multi) and local < strategy.num_replicas_in_sync


def shared_seed(seed):
    """``seed`` (drawn for an unseeded initializer) or, across the workers
    of a MultiWorkerMirroredStrategy, the chief's: every worker's store
    then starts from the same rows. A collective, as the strategy's own
    creation of variables is (every worker builds the table in the same
    order), so only in the strategy's scope outside a step; elsewhere the
    seed stays and `check` tells."""
    import tensorflow as tf

    if not (
        spans_workers()
        and tf.executing_eagerly()
        and tf.distribute.in_cross_replica_context()
    ):
        return seed
    from keras_sparse.ops.tensorflow import workers as tf_workers

    return int(tf_workers.gather_objects(tf.distribute.get_strategy(), seed)[0])


def fingerprint(cache):
    """This worker's int32 ``[WORDS]`` fingerprint of ``cache``, for a
    step's all-gather: its copy as it was at its first training step since
    the table was last set. Taken once (the first call of a step to ask;
    no mapping of this worker can precede it, as each waits for the
    gather) and sent by every later call, so the workers compare the same
    states whatever order a step's calls run in."""
    import tensorflow as tf
    from keras import ops

    def taken(*values):
        words = cache.__dict__.get("_worker_words")
        if words is None:
            identity = cache_copies.identity(cache, values)
            words = cache.__dict__["_worker_words"] = _words(*identity)
        return words

    def take():  # the cache variables read only on the first step
        values = [ops.convert_to_tensor(cache.embeddings)]
        values += [ops.convert_to_tensor(v) for v in cache.slots.values()]
        return tf.numpy_function(taken, values, tf.int32, stateful=True)

    def memo():
        return tf.numpy_function(taken, [], tf.int32, stateful=True)

    pending = tf.numpy_function(
        lambda: "_worker_words" not in cache.__dict__, [], tf.bool, stateful=True
    )
    words = tf.cond(pending, take, memo)
    words.set_shape((WORDS,))
    return words


def check(cache, words, local):
    """Raises ValueError naming the table when the workers' fingerprints
    (``words``: every replica's, gathered in replica order; ``local``
    replicas per worker) differ or name one disk folder (`cache_copies`):
    every worker sees the same words and raises alike."""
    rows = np.asarray(words).reshape(-1, WORDS)[::local]
    found = [(_folder_key(row), tuple(row[2:])) for row in rows]
    mine = cache.__dict__.get("_worker_words")
    cache_copies.refuse_differing(
        found,
        (None if mine is None else _folder_key(mine), cache_copies.folder(cache)),
        f"Layer '{cache.owner_name}': `cache_rows` under "
        f"MultiWorkerMirroredStrategy with {len(rows)} workers",
        "ks.store.Disk(f'{path}/worker{index}')",
        "Build the layer under the strategy's scope in every worker (an "
        "unseeded initializer then gets the chief's seed)",
    )


def _words(folder, digest):
    key = bytes(8) if folder is None else hashlib.sha1(repr(folder).encode()).digest()
    return np.frombuffer(key[:8] + bytes.fromhex(digest)[:16], np.int32).copy()


def _folder_key(row):
    key = tuple(int(w) for w in row[:2])
    return None if key == (0, 0) else key
