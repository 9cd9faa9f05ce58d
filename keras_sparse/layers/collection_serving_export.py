"""`EmbeddingCollection` tables inside exported SavedModels, updatable while
they serve.

``model.export(path)`` saves a collection's stacks as plain variables of the
artifact. Each table of a built collection gets an entry of the artifact's
``keras_sparse_tables`` dict, named by the table's name, with the functions
of a fixed-vocabulary layer's entry
(`keras_sparse.layers.dense_serving_export`): ``apply_delta(keys, values,
removed_keys)`` writes a table delta (``collection.export(since_step=s)[
table]``) into the table's rows of its stack, ``update(keys, values)`` a
full export's records; ids outside ``[0, input_dim)`` are refused before
anything is written. A table with ``cache_rows`` (its rows are not in the
artifact's variables) and the tables of a quantized collection (int8/int4
rows) get an entry whose functions refuse every call, saying why.
"""

from keras_sparse.layers import dense_serving_export


def collections(resource):
    """The built `EmbeddingCollection` layers of a model or layer (a
    fixed-vocabulary layer with ``tables``; no import of the class, which
    installs the export hook that calls this)."""
    return [
        x
        for x in dense_serving_export.all_layers(resource)
        if getattr(x, "keras_sparse_kind", None) == "fixed"
        and isinstance(getattr(x, "tables", None), dict)
        and x.built
    ]


def served_tables(layer, tf_variable):
    """``{table name: tf.Module}`` of ``layer``'s tables."""
    out = {}
    for name, config in layer.tables.items():
        label = f"Layer '{layer.name}' table '{name}'"
        module_name = f"{layer.name}_{name}_table"
        if layer._stack_quantized:
            out[name] = _refused(
                module_name, label, config.output_dim, "the collection is quantized"
            )
        elif name in layer.table_caches:
            out[name] = _refused(
                module_name,
                label,
                config.output_dim,
                "a table with `cache_rows` is not in the artifact's variables",
            )
        else:
            stack = layer._stack_of(name)
            out[name] = dense_serving_export.rows_module(
                module_name,
                label,
                tf_variable(layer._stack_tables[stack.name]),
                config.input_dim,
                config.output_dim,
                offset=stack.offsets[name],
            )
    return out


def _refused(module_name, label, dim, reason):
    """An entry whose ``apply_delta`` and ``update`` raise
    ``InvalidArgumentError`` naming the table and ``reason``."""
    import tensorflow as tf

    message = (
        f"{label}: the served table takes no delta or update ({reason}); "
        "export the model again instead."
    )

    def refuse(keys, values, removed_keys):
        # Never -1: fails on every call, when the graph runs.
        check = tf.debugging.assert_equal(tf.size(keys), -1, message=message)
        with tf.control_dependencies([check]):
            return tf.size(keys)

    return dense_serving_export.entry(module_name, dim, tf.float32, refuse)
