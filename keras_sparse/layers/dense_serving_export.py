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


def dense_layers(resource):
    """The `AllToAllDenseEmbedding` layers of a model or layer whose table
    the artifact can update (float rows, no ``cache_rows``)."""
    import keras

    from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase

    layers = [resource]
    flatten = getattr(resource, "_flatten_layers", None)
    if flatten is not None:
        layers = list(flatten(include_self=True, recursive=True))
    return [
        x
        for x in layers
        # `AllToAllDenseEmbedding`: a keras Embedding with sparse updates.
        if isinstance(x, SparseEmbeddingBase)
        and isinstance(x, keras.layers.Embedding)
        and x.built
        and x.row_cache is None
        and not x.quantization_mode
    ]


def served_table(layer, tf_variable):
    """A ``tf.Module`` holding ``layer``'s served table variable, with
    ``apply_delta`` and ``update``."""
    import tensorflow as tf

    module = tf.Module(name=f"{layer.name}_table")
    module.embeddings = tf_variable(layer.embeddings)
    dim = layer.output_dim
    keys = tf.TensorSpec([None], tf.int64, name="keys")
    values = tf.TensorSpec([None, dim], module.embeddings.dtype, name="values")
    removed = tf.TensorSpec([None], tf.int64, name="removed_keys")

    @tf.function(input_signature=[keys, values, removed], autograph=False)
    def apply_delta(keys, values, removed_keys):
        return _write_rows(module, layer.name, layer.input_dim, keys, values,
                           removed_keys)  # fmt: skip

    @tf.function(input_signature=[keys, values], autograph=False)
    def update(keys, values):
        return _write_rows(module, layer.name, layer.input_dim, keys, values,
                           keys[:0])  # fmt: skip

    module.apply_delta = apply_delta
    module.update = update
    return module


def _write_rows(module, name, input_dim, keys, values, removed_keys):
    """Checks the rows, then scatters ``values`` into rows ``keys``;
    returns the number of rows written."""
    import tensorflow as tf

    checks = [
        tf.debugging.assert_equal(
            tf.shape(values)[0],
            tf.shape(keys)[0],
            message=f"Layer '{name}': one row of values per key",
        ),
        tf.debugging.assert_greater_equal(
            keys,
            tf.constant(0, tf.int64),
            message=f"Layer '{name}': keys are row ids in [0, {input_dim})",
        ),
        tf.debugging.assert_less(
            keys,
            tf.constant(input_dim, tf.int64),
            message=f"Layer '{name}': keys are row ids in [0, {input_dim})",
        ),
        tf.debugging.assert_equal(
            tf.size(removed_keys),
            0,
            message=f"Layer '{name}': a fixed vocabulary removes no rows "
            "(removed_keys must be empty)",
        ),
    ]
    with tf.control_dependencies(checks):
        module.embeddings.scatter_nd_update(tf.expand_dims(keys, 1), values)
    return tf.size(keys)
