"""A per-table scratch that finds duplicate ids without a sort (JAX, TF).

The sparse update sums the gradients of duplicate ids. Sorting the ids is
the dearest part of that on a CPU (XLA:CPU sorts with a comparator call per
comparison); `keras_sparse.ops.row_updates.scratch_segments` does it in two
O(n) passes over one int32 per table row instead.

The scratch is layer state, not a weight: it is tracked the way Keras
tracks a `keras.random.SeedGenerator`'s state, so it travels through the
compiled step (JAX's trainer donates it and XLA writes it in place) and
appears in ``layer.variables`` but not in ``layer.weights``,
``get_weights``/``set_weights`` or saved files. Each step reads only
entries it wrote itself, so its contents between steps do not matter (a
trained layer's differs from a fresh one's; neither is saved). Sharded
tables (a JAX distribution) and replicas (tf.distribute) keep the sort:
their ids and rows live on several devices. PyTorch keeps its own scratch
(`keras_sparse.ops.torch.row_updates`). Tables that JAX updates by its
compiled call on a CPU (`keras_sparse.ops.jax.native_rows`) get none: the
call finds duplicates in a hash sized by the batch.
"""

import keras

from keras_sparse.ops import backend_module


class DedupScratch(keras.random.SeedGenerator):
    """Holds the ``[rows + 1]`` int32 scratch as its ``state``.

    A SeedGenerator subclass only so that Keras tracks it as step state
    that is not a weight; it draws no random numbers.
    """

    def __init__(self, rows, name):
        # SeedGenerator.__init__ would make a seed variable; only the
        # tracked `state` is wanted.
        self.name = name
        self.state = keras.Variable(
            initializer="zeros",
            shape=(rows + 1,),
            dtype="int32",
            trainable=False,
            name=name,
        )

    def next(self, ordered=True):
        raise TypeError(f"{self.name} is a dedup scratch, not a seed generator.")

    def get_config(self):
        raise TypeError(f"{self.name} is rebuilt by its layer, not serialized.")


# False: tables built from now on find duplicates by sorting, as sharded
# tables do (tests compare both routes).
ENABLED = True


def uses_scratch():
    """Whether tables built now get a scratch (see the module docstring)."""
    if not ENABLED:
        return False
    backend = keras.backend.backend()
    if backend == "jax":
        return keras.distribution.distribution() is None
    if backend == "tensorflow":
        import tensorflow as tf

        return not tf.distribute.has_strategy()
    return False


def add_dedup_scratch(layer, table, rows, name, slots=()):
    """Gives ``table`` (a variable of ``layer``, ``rows`` rows) a scratch,
    unless its update is a compiled call that finds duplicates itself (JAX
    on a CPU, `keras_sparse.ops.jax.native_rows`). Were that route off when
    a step is traced, the update sorts instead."""
    if not uses_scratch():
        return
    fused = getattr(backend_module(), "fused_update_applies", None)
    if fused is not None and fused(
        layer.sparse_optimizer, layer.embeddings_constraint, table, tuple(slots)
    ):
        return
    scratch = DedupScratch(rows, name)
    # An attribute per scratch: Keras tracks SeedGenerator attributes.
    setattr(layer, f"_dedup_scratch_{name}", scratch)
    if not hasattr(layer, "_dedup_scratch_by_table"):
        layer._dedup_scratch_by_table = {}
    layer._dedup_scratch_by_table[table.path] = name


def scratch_segments(layer, table, flat_ids, flat_valid):
    """Segments of this call's ids by ``table``'s scratch, or None."""
    name = getattr(layer, "_dedup_scratch_by_table", {}).get(table.path)
    if name is None:
        return None
    scratch = getattr(layer, f"_dedup_scratch_{name}").state
    return backend_module().scratch_segments(
        scratch, flat_ids, flat_valid, int(table.shape[0])
    )
