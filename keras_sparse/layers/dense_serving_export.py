"""Fixed-vocabulary tables inside exported SavedModels, updatable while they
serve.

``model.export(path)`` saves an `AllToAllDenseEmbedding`'s table as a plain
variable of the artifact. For each such layer (float table, no
``cache_rows``) the artifact's ``keras_sparse_tables`` dict gets an entry,
as hash layers do (`keras_sparse.layers.hash.serving_export`), with
``apply_delta(keys, values, removed_keys)``: the rows ``keys`` (ids in
``[0, input_dim)``) take ``values``, every other row keeps its vector. A
delta of a layer built with ``track_changes=True``
(``layer.export(since_step=s)``) installs that way without a new export::

    served = tf.saved_model.load(path)
    d = layer.export(since_step=s)  # in the training process, saved to disk
    served.keras_sparse_tables["items"].apply_delta(
        d["keys"], d["values"], d["removed_keys"]
    )

``update(keys, values)`` does the same for a full export's records. A fixed
vocabulary removes no rows, so ``removed_keys`` must be empty (the deltas'
is). The write is one in-place scatter into the served variable; as for
hash tables, apply updates between requests.
"""

import functools
import re


def dense_layers(resource):
    """The `AllToAllDenseEmbedding` layers of a model or layer whose table
    the artifact can update (float rows, no ``cache_rows``)."""
    import keras

    from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase

    return [
        x
        for x in all_layers(resource)
        # `AllToAllDenseEmbedding`: a keras Embedding with sparse updates.
        if isinstance(x, SparseEmbeddingBase)
        and isinstance(x, keras.layers.Embedding)
        and x.built
        and x.row_cache is None
        and not x.quantization_mode
    ]


def all_layers(resource):
    """``resource`` and the layers inside it."""
    flatten = getattr(resource, "_flatten_layers", None)
    if flatten is None:
        return [resource]
    return list(flatten(include_self=True, recursive=True))


def served_table(layer, tf_variable):
    """A ``tf.Module`` holding ``layer``'s served table variable, with
    ``apply_delta`` and ``update``."""
    return rows_module(
        f"{layer.name}_table",
        f"Layer '{layer.name}'",
        tf_variable(layer.embeddings),
        layer.input_dim,
        layer.output_dim,
    )


def rows_module(module_name, label, variable, input_dim, dim, offset=0):
    """A ``tf.Module`` whose ``apply_delta`` and ``update`` write rows
    ``[0, input_dim)`` of a table held at rows ``offset + id`` of
    ``variable`` (an `EmbeddingCollection` stack holds several tables);
    errors start with ``label``."""
    write = functools.partial(_write_rows, variable, label, input_dim, offset)
    module = entry(module_name, dim, variable.dtype, write)
    module.embeddings = variable
    return module


def entry(module_name, dim, dtype, write):
    """A ``tf.Module`` with ``apply_delta(keys, values, removed_keys)`` and
    ``update(keys, values)``, each ``write(keys, values, removed_keys)``
    traced into the artifact (``update`` removes no keys)."""
    import tensorflow as tf

    module = tf.Module(name=identifier(module_name))
    keys = tf.TensorSpec([None], tf.int64, name="keys")
    values = tf.TensorSpec([None, dim], dtype, name="values")
    removed = tf.TensorSpec([None], tf.int64, name="removed_keys")

    @tf.function(input_signature=[keys, values, removed], autograph=False)
    def apply_delta(keys, values, removed_keys):
        return write(keys, values, removed_keys)

    @tf.function(input_signature=[keys, values], autograph=False)
    def update(keys, values):
        return write(keys, values, keys[:0])

    module.apply_delta = apply_delta
    module.update = update
    return module


def identifier(name):
    """``name`` as a `tf.Module` accepts it (a Python identifier)."""
    name = re.sub(r"\W", "_", name)
    return name if name.isidentifier() else f"t_{name}"


def _write_rows(variable, label, input_dim, offset, keys, values, removed_keys):
    """Checks the rows, then scatters ``values`` into rows ``offset +
    keys``; returns the number of rows written."""
    import tensorflow as tf

    checks = [
        tf.debugging.assert_equal(
            tf.shape(values)[0],
            tf.shape(keys)[0],
            message=f"{label}: one row of values per key",
        ),
        tf.debugging.assert_greater_equal(
            keys,
            tf.constant(0, tf.int64),
            message=f"{label}: keys are row ids in [0, {input_dim})",
        ),
        tf.debugging.assert_less(
            keys,
            tf.constant(input_dim, tf.int64),
            message=f"{label}: keys are row ids in [0, {input_dim})",
        ),
        tf.debugging.assert_equal(
            tf.size(removed_keys),
            0,
            message=f"{label}: a fixed vocabulary removes no rows "
            "(removed_keys must be empty)",
        ),
    ]
    with tf.control_dependencies(checks):
        scatter_rows(variable, keys + offset, values)
    return tf.size(keys)


def scatter_rows(variable, rows, values):
    """Writes ``values`` into rows ``rows`` of ``variable`` in place (a
    ``tf.Variable`` or a TensorFlow-backend Keras variable: its handle)."""
    import tensorflow as tf

    return tf.raw_ops.ResourceScatterNdUpdate(
        ref=variable.handle, indices=tf.expand_dims(rows, 1), updates=values
    )
