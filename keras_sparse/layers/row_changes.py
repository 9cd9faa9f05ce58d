"""Change steps of a fixed-vocabulary table (``track_changes=True``).

A table of `AllToAllDenseEmbedding` or of an `EmbeddingCollection` built
with ``track_changes=True`` keeps one int32 per row: the step after which
the row last changed (its *change step*). Each training step writes its
step number (the layer's ``sparse_iterations`` after the step) at the ids
it looked up, inside the step: one scatter of the batch's ids, O(batch),
in place on every backend (the sparse optimizer changes exactly those rows;
ids a bag pads out are skipped). Rows written between steps (`set_weights`,
a load) get at least the next step (`after_write`), so a delta since the
current step holds them. Marks only err on the side of "changed".

The steps are layer state, not a weight (tracked as
`keras_sparse.layers.dedup_scratch` tracks its scratch): they travel
through the compiled step but not through ``get_weights``, so weight
files still move both ways between layers with and without tracking.
Saves carry them under their own entry (`SAVED`).
"""

import keras
import numpy as np
from keras import ops

#: The entry of a save holding a table's change steps.
SAVED = "change_steps"


class ChangeSteps(keras.random.SeedGenerator):
    """Holds the ``[rows + 1]`` int32 change steps as its ``state`` (the
    last entry takes the writes of padded-out ids).

    A SeedGenerator subclass only so that Keras tracks it as step state
    that is not a weight; it draws no random numbers.
    """

    def __init__(self, rows, name):
        self.name = name
        self.rows = int(rows)
        self.state = keras.Variable(
            initializer="zeros",
            shape=(self.rows + 1,),
            dtype="int32",
            trainable=False,
            name=name,
        )

    def next(self, ordered=True):
        raise TypeError(f"{self.name} holds change steps, not a seed generator.")

    def get_config(self):
        raise TypeError(f"{self.name} is rebuilt by its layer, not serialized.")


def add(layer, rows, name="change_steps"):
    """Gives ``layer`` a `ChangeSteps` of ``rows`` rows (an attribute, so
    Keras tracks it: once, hence `of` to reach it) and returns it."""
    steps = ChangeSteps(rows, name)
    setattr(layer, f"_change_steps_{name}", steps)
    return steps


def of(layer, name="change_steps"):
    """``layer``'s `ChangeSteps` named ``name``, or None."""
    return getattr(layer, f"_change_steps_{name}", None)


def check_flag(layer_name, value):
    """``track_changes`` as a bool; raises ValueError naming the layer."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(
            f"Layer '{layer_name}': `track_changes` must be True or False. "
            f"Received: track_changes={value!r}."
        )
    return bool(value)


def check_sparse(layer_name, track_changes, optimizer):
    """Tracking needs a sparse optimizer: it knows the rows each step
    changes; a Keras optimizer updates the whole table."""
    if track_changes and optimizer is None:
        raise ValueError(
            f"Layer '{layer_name}': `track_changes=True` needs a sparse "
            "`optimizer` (e.g. optimizer='adagrad'): the model's optimizer "
            "updates the whole table through dense gradients, so no step "
            "knows which rows changed. Received: optimizer=None."
        )


def check_placement(layer_name):
    """Refuses tracking where the table's rows are split across
    tf.distribute replicas or torch processes (each would hold a part)."""
    from keras_sparse.ops import backend_module

    backend = keras.backend.backend()
    if backend == "jax":
        return
    spread = backend_module().replica_count() > 1
    if backend == "tensorflow":
        import tensorflow as tf

        spread = spread or tf.distribute.has_strategy()
    if backend == "torch":  # processes, before DDP wraps the model
        import torch.distributed as dist

        spread = spread or (
            dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        )
    if spread:
        raise ValueError(
            f"Layer '{layer_name}': `track_changes=True` is not available "
            f"under several {backend} replicas or processes yet; build the "
            "layer on one device (or on JAX, under any distribution)."
        )


def mark(steps, ids, valid, step):
    """Writes ``step`` (a scalar tensor) at the flat ``ids`` where ``valid``
    (the rest at the spare last entry), in place."""
    spare = steps.rows
    keys = ops.where(
        ops.reshape(valid, (-1,)), ops.cast(ops.reshape(ids, (-1,)), "int32"), spare
    )
    variable = steps.state
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        value = variable.value
        tf_var = value if isinstance(value, tf.Variable) else variable._value
        written = tf.fill(tf.shape(keys), tf.cast(step, tf.int32))
        tf_var.scatter_nd_update(keys[:, None], written)
        return
    if backend == "torch":
        import torch

        with torch.no_grad():
            variable.value[keys.long()] = ops.cast(step, "int32")
        return
    # JAX: functional, written in place where the trainer donates the state.
    written = ops.full(ops.shape(keys), ops.cast(step, "int32"), dtype="int32")
    variable.assign(ops.scatter_update(variable.value, keys[:, None], written))


def host_steps(steps):
    """The change steps of the rows (NumPy int64, without the spare)."""
    value = ops.convert_to_numpy(steps.state.value)
    return np.asarray(value, np.int64)[: steps.rows]


def changed_rows(before, after):
    """Rows whose bits differ between two lists of ``[rows, ...]`` arrays."""
    rows = before[0].shape[0]
    changed = np.zeros(rows, bool)
    for old, new in zip(before, after):
        old = np.ascontiguousarray(old).reshape(rows, -1).view(np.uint8)
        new = np.ascontiguousarray(new).reshape(rows, -1).view(np.uint8)
        changed |= (old != new).any(axis=1)
    return changed


def after_write(steps, changed, step, saved=None):
    """Sets the change steps after rows were written between training steps.

    ``changed``: rows whose values or slots changed; ``step``: the layer's
    step before the write; ``saved``: change steps that came with the
    written state (a load), else the current ones are kept. A changed row
    gets at least ``step + 1``: a delta since ``step`` or later then holds
    it, whatever step the written state carried.
    """
    current = host_steps(steps) if saved is None else np.asarray(saved, np.int64)
    if current.shape != (steps.rows,):
        raise ValueError(
            f"`{SAVED}` must hold one step per row ({steps.rows}); received "
            f"shape {current.shape}."
        )
    out = current.copy()
    out[changed] = np.maximum(out[changed], int(step) + 1)
    full = np.zeros(steps.rows + 1, np.int32)
    full[: steps.rows] = out
    steps.state.assign(full)
