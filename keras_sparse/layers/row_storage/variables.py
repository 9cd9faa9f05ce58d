"""A table's device variables: values, optimizer slots, step counter.

One builder for every layer kind (see `keras_sparse.layers.row_storage`):
`add_table` makes a table variable and, with the layer's sparse optimizer,
its slots and dedup scratch; `add_step_counter` the layer's
``sparse_iterations`` (and off JAX its anchor), shared by its tables.
"""

import keras

from keras_sparse.cpu_allocator import back_with_huge_pages
from keras_sparse.layers.dedup_scratch import add_dedup_scratch


def add_table(
    layer,
    add,
    rows,
    dim,
    initializer,
    *,
    name,
    slot_prefix="",
    scratch_name="dedup_scratch",
    slot_options=None,
    **table_options,
):
    """``(table, slots)``: a ``[rows, dim]`` table variable of ``layer``
    and, when the layer has a sparse optimizer, its slot variables
    (``{slot name: variable}``) and dedup scratch.

    ``add(is_table, **kwargs)`` makes one variable (`layer.add_weight`, or
    a sharding hook making this device's part). Slots are named
    ``slot_prefix + slot name``. ``table_options`` go to the table's
    ``add`` only (a dense layer's regularizer and constraint, which the
    model's optimizer applies when there is no sparse optimizer; a storage
    dtype), ``slot_options`` to each slot's (a slot storage dtype).
    """
    sparse = layer.uses_sparse_update
    # On JAX the updated table travels back as the table's "gradient" and
    # the Keras optimizer assigns it (overwrite_with_gradient); elsewhere
    # the backward pass writes the variables itself.
    on_jax = keras.backend.backend() == "jax"
    table = add(
        True,
        shape=(rows, dim),
        initializer=initializer,
        trainable=(not sparse) or on_jax,
        autocast=False,
        name=name,
        **table_options,
    )
    slots = {}
    if not sparse:
        return table, slots
    table.overwrite_with_gradient = on_jax
    for spec in layer.sparse_optimizer.slot_specs():
        slot = add(
            False,
            shape=spec.shape(rows, dim),
            initializer=spec.initializer(),
            trainable=on_jax,
            autocast=False,
            name=slot_prefix + spec.name,
            **(slot_options or {}),
        )
        slot.overwrite_with_gradient = on_jax
        slots[spec.name] = slot
    add_dedup_scratch(layer, table, rows, scratch_name, slots.values())
    back_with_huge_pages([table, *slots.values()])
    return table, slots


def add_step_counter(layer):
    """The layer's ``sparse_iterations`` (one per layer, whatever its
    tables) and, off JAX, ``sparse_anchor``: a scalar the loss reaches, so
    each lookup's backward pass runs (TensorFlow and PyTorch call every
    custom gradient of an input)."""
    layer.sparse_iterations = layer.add_weight(
        shape=(),
        initializer="zeros",
        dtype="int32",
        trainable=False,
        name="sparse_iterations",
    )
    layer.sparse_anchor = None
    if keras.backend.backend() != "jax":
        layer.sparse_anchor = layer.add_weight(
            shape=(),
            initializer="zeros",
            trainable=True,
            name="sparse_update_anchor",
        )
