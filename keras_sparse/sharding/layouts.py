"""Variable layouts of sharded tables: rows per device, padding, and the
unsharded values checkpoints hold.

Row padding: a row-sharded table with ``num_rows % D != 0`` is built with
``ceil(num_rows / D) * D`` rows (`variable_rows`), the same for its slots,
so each device holds an equal block; the extra rows are zeros that no id
reaches. ``layer.num_rows`` is unchanged; ``layer.embeddings``, the slots and
``model.get_weights()`` / ``set_weights()`` have the padded shape; the
layer's saved state (``.keras`` files) is unpadded (`unpadded_value`,
`padded_value`), so checkpoints load under any device count.
"""

import keras

from keras_sparse.layers.hash.serving_state import serving_maps_hidden
from keras_sparse.sharding.routing import padded_rows
from keras_sparse.sharding.routing import route


def _axes(strategy, axis):
    return {
        "row": (axis, None),
        "key": (axis, None),
        "table": (axis, None),
        "column": (None, axis),
        "data": (None, None),
    }[strategy]


def _variable_names(layer):
    names = ["embeddings"]
    opt = getattr(layer, "sparse_optimizer", None)
    if opt is not None:
        names += [spec.name for spec in opt.slot_specs()]
    return names


def _relayout(layer, axes, mesh):
    variables = [layer.embeddings] + list(getattr(layer, "slots", {}).values())
    d = mesh.shape[0]
    if axes[0] is not None and layer.embeddings.shape[0] % d:
        raise ValueError(
            f"Layer '{layer.name}' is already built with {layer.num_rows} rows, "
            f"not a multiple of the {d} devices of its row sharding; its "
            "variables cannot be padded in place. Build the model after "
            "keras.distribution.set_distribution(...), or save it and reload "
            "it with keras_sparse.sharding.load_model(...)."
        )
    for variable in variables:
        variable._layout = keras.distribution.TensorLayout(axes, mesh)
        variable._direct_assign(variable.value)


def _replicate_other_variables(layer, mesh):
    """Replicates a layer's variables created before the mesh existed.

    A jitted step needs every variable on the mesh; a variable that predates
    the distribution (the hash layer's seed-generator state, created in its
    constructor; ``sparse_iterations`` of a built layer) would stay on one
    device.
    """
    placed = [layer.embeddings] if layer.built else []
    placed += list(getattr(layer, "slots", {}).values())
    with serving_maps_hidden(False):  # also when built by a training call
        variables = layer.variables
    for variable in variables:
        if any(variable is p for p in placed) or variable._layout is not None:
            continue
        axes = (None,) * len(variable.shape)
        variable._layout = keras.distribution.TensorLayout(axes, mesh)
        variable._direct_assign(variable.value)


def variable_rows(layer):
    """Rows of ``layer``'s table and slot variables when built now.

    ``layer.num_rows`` unless the active distribution row-shards the layer
    over ``D`` devices with ``num_rows % D != 0``: then the variables get
    `padded_rows` rows, so every device holds an equal block. Ids are always
    ``< num_rows``, so the padding rows are never read or updated.
    """
    routing = route(layer)
    if routing is not None and hasattr(routing, "variable_rows"):
        return routing.variable_rows(layer.num_rows)
    if routing is None or routing.strategy not in ("row", "key"):
        return layer.num_rows
    return padded_rows(layer.num_rows, routing.devices)


def variable_dim(layer):
    """Columns of ``layer``'s table and slot variables when built now:
    ``output_dim``, or this process's part of a table whose placement
    splits the columns (PyTorch; on TensorFlow the placement cuts whole
    shapes itself, JAX lays out whole ones)."""
    routing = route(layer)
    if routing is not None and hasattr(routing, "variable_dim"):
        return routing.variable_dim(layer.output_dim)
    return layer.output_dim


class PaddedInitializer:
    """Draws ``num_rows`` rows with ``initializer`` and appends zero rows.

    The real rows get exactly the values of an unpadded build (same shape
    drawn), so a seeded model starts alike on any device count.
    """

    def __init__(self, initializer, num_rows):
        self.initializer = initializer
        self.num_rows = int(num_rows)

    def __call__(self, shape, dtype=None):
        from keras import ops

        values = self.initializer((self.num_rows,) + tuple(shape[1:]), dtype=dtype)
        pad = [(0, shape[0] - self.num_rows)] + [(0, 0)] * (len(shape) - 1)
        return ops.pad(values, pad)


def table_initializer(layer, rows):
    """The initializer of a table variable built with ``rows`` rows."""
    routing = route(layer)
    if routing is not None and hasattr(routing, "table_initializer"):
        return routing.table_initializer(layer.embeddings_initializer, layer.num_rows)
    if rows == layer.num_rows:
        return layer.embeddings_initializer
    return PaddedInitializer(layer.embeddings_initializer, layer.num_rows)


def variable_options(layer):
    """Extra ``add_weight`` arguments of the table and slot variables."""
    routing = route(layer)
    if routing is not None and hasattr(routing, "variable_options"):
        return routing.variable_options()
    return {}


def add_state_weight(layer, table, **kwargs):
    """Creates a table (``table=True``) or slot variable of ``layer`` from
    ``add_weight`` arguments (whole-table shape). A placement that holds a
    part of the table per replica creates its own variable (Keras's
    ``add_weight`` cannot make per-replica variables on TensorFlow)."""
    routing = route(layer)
    if routing is not None and hasattr(routing, "add_state_weight"):
        return routing.add_state_weight(layer, table, **kwargs)
    return layer.add_weight(**kwargs, **variable_options(layer))


def loaded_shape(layer, variable):
    """The shape `padded_value` gives a loadable value of ``variable``: the
    variable's own, or the whole table's where a placement holds a part."""
    routing = route(layer)
    if _is_row_state(layer, variable) and hasattr(routing, "saved_shape"):
        return routing.saved_shape(variable, layer.num_rows)
    return tuple(variable.shape)


def assign_value(layer, variable, value):
    """Assigns a value checked against `loaded_shape` (a placement that
    holds a part of the table keeps its own part)."""
    routing = route(layer)
    if _is_row_state(layer, variable) and hasattr(routing, "assign_saved"):
        routing.assign_saved(variable, layer.num_rows, value)
    else:
        variable.assign(value)


def _is_row_state(layer, variable):
    """True for the table and slot variables (the ones that can be padded)."""
    candidates = [layer.embeddings] + list(getattr(layer, "slots", {}).values())
    return any(variable is c for c in candidates)


def unpadded_value(layer, variable):
    """The variable's value as NumPy without padding rows (for saving): the
    whole table's rows even where this device holds only a part."""
    routing = route(layer)
    if _is_row_state(layer, variable) and hasattr(routing, "saved_value"):
        return routing.saved_value(variable, layer.num_rows)
    value = variable.numpy()
    if _is_row_state(layer, variable) and value.shape[0] > layer.num_rows:
        value = value[: layer.num_rows]
    return value


def padded_value(layer, variable, value):
    """``value`` (saved with ``num_rows`` rows) padded to the variable's rows.

    Checkpoints hold unpadded arrays, so they load under any device count;
    the padding rows are zeros.
    """
    import numpy as np

    if not _is_row_state(layer, variable):
        return value
    if hasattr(route(layer), "assign_saved"):
        return value  # the placement cuts it (`assign_value`)
    extra = int(variable.shape[0]) - layer.num_rows
    if extra <= 0:
        return value
    value = np.asarray(value)
    if value.shape[0] != layer.num_rows:
        return value  # let assign report the shape mismatch
    pad = [(0, extra)] + [(0, 0)] * (value.ndim - 1)
    return np.pad(value, pad)
