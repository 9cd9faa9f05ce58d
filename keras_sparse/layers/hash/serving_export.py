"""Hash tables inside exported SavedModels, updatable while they serve.

``model.export(path)`` writes each `DistributedHashEmbedding` as its serving
map (`keras_sparse.layers.hash.serving_map`) and its rows: plain variables that
the exported graph searches, with no Python callback. This module adds, for
every hash layer the export archive tracks, an entry of the artifact's
``keras_sparse_tables`` dict: a small module holding those variables and an
``update(keys, values)`` function saved with the artifact, so a server that
loaded the model with TensorFlow alone can install retrained records
(``layer.export()``'s ``keys`` and ``values``) without a new export::

    served = tf.saved_model.load(path)
    records = np.load("user_records.npz")  # np.savez(..., **layer.export())
    served.keras_sparse_tables["user"].update(records["keys"], records["values"])

``update`` replaces the whole map: the keys read ``values`` (in their
order), every other key reads zeros. ``apply_delta(keys, values,
removed_keys)`` applies a delta (``layer.export(since_step=s)``, see
`keras_sparse.layers.hash.deltas`) to the map it serves: the delta's keys
read their new ``values``, its ``removed_keys`` read zeros, the other keys
keep theirs. The served map must be the records as of step ``s`` (an
export, or the previous delta applied): the artifact does not know its
step, so the order is the caller's to keep. It is not atomic with respect to
requests served at the same moment (the map, its directory and the vectors
are separate variables, and a JAX-exported artifact writes its
non-trainable variables back after each request): apply updates between
requests, e.g. on a replica taken out of rotation.
"""

import types

from keras_sparse.layers import dense_serving_export
from keras_sparse.layers.hash import serving_map


def _tf_variables(archive):
    """``keras variable -> variable`` the archive saves (JAX converts each
    variable; TensorFlow's are their own: the Keras variable itself, as the
    artifact's functions read it; its inner ``tf.Variable`` would be saved
    as a second copy, which ``apply_delta`` does not write)."""
    keras_vars = getattr(archive, "_backend_variables", None)
    if keras_vars is None:
        return lambda v: v
    by_id = {id(k): t for k, t in zip(keras_vars, archive._tf_trackable.variables)}
    return lambda v: by_id[id(v)]


def attach(archive, resource):
    """Adds ``keras_sparse_tables`` entries for ``resource``'s hash layers
    (and its fixed-vocabulary tables: `keras_sparse.layers.dense_serving_export`,
    `keras_sparse.layers.collection_serving_export`)."""
    from keras_sparse.layers import collection_serving_export

    layers = serving_map.hash_layers(resource)
    dense = dense_serving_export.dense_layers(resource)
    collections = collection_serving_export.collections(resource)
    if not layers and not dense and not collections:
        return
    tf_variable = _tf_variables(archive)
    added = {}
    for layer in layers:
        if layer.quantized_rows is not None:  # int8/int4 rows: not updatable
            continue
        added[layer.name] = _served_table(layer, tf_variable)
    for layer in dense:
        added[layer.name] = dense_serving_export.served_table(layer, tf_variable)
    for layer in collections:
        for name, table in collection_serving_export.served_tables(
            layer, tf_variable
        ).items():
            if name in added:
                raise ValueError(
                    f"Layer '{layer.name}' table '{name}': the artifact's "
                    f"`keras_sparse_tables` entry {name!r} is taken (a layer or "
                    "another collection's table of that name); rename the "
                    "table or the layer so that each name is unique."
                )
            added[name] = table
    tables = dict(getattr(archive._tf_trackable, "keras_sparse_tables", {}))
    tables.update(added)
    archive._tf_trackable.keras_sparse_tables = tables


def _served_table(layer, tf_variable):
    import tensorflow as tf

    module = tf.Module(name=f"{layer.name}_table")
    module.key_words = tf_variable(layer.serving_key_words)
    module.rows = tf_variable(layer.serving_rows)
    module.directory = tf_variable(layer.serving_directory)
    module.meta = tf_variable(layer.serving_meta)
    module.embeddings = tf_variable(layer.embeddings)
    capacity = int(layer.serving_rows.shape[0])
    spec = [
        tf.TensorSpec([None], tf.int64, name="keys"),
        tf.TensorSpec([None, layer.output_dim], module.embeddings.dtype, name="values"),
    ]

    @tf.function(input_signature=spec, autograph=False)
    def update(keys, values):
        return _update(module, capacity, layer.name, keys, values)

    module.update = update
    removed = tf.TensorSpec([None], tf.int64, name="removed_keys")

    @tf.function(input_signature=[*spec, removed], autograph=False)
    def apply_delta(keys, values, removed_keys):
        return _apply_delta(module, capacity, layer.name, keys, values, removed_keys)

    module.apply_delta = apply_delta
    return module


def _apply_delta(module, capacity, name, keys, values, removed_keys):
    """The served keys and vectors, updated by a delta, through `_update`."""
    import tensorflow as tf

    n = module.meta[0]
    words = module.key_words[:n]
    high = tf.cast(words[:, 0], tf.int64)
    low = tf.cast(words[:, 1], tf.int64) + 2**31
    served = tf.bitwise.left_shift(high, 32) + low
    vectors = tf.gather(module.embeddings, module.rows[:n])
    drop = tf.sort(tf.concat([removed_keys, keys], axis=0))
    # Served keys the delta replaces or removes: found in `drop`.
    at = tf.minimum(tf.searchsorted(drop, served), tf.maximum(tf.size(drop) - 1, 0))
    found = tf.logical_and(
        tf.size(drop) > 0, tf.equal(tf.gather(tf.concat([drop, [0]], 0), at), served)
    )
    keep = tf.logical_not(found)
    all_keys = tf.concat([tf.boolean_mask(served, keep), keys], axis=0)
    all_values = tf.concat([tf.boolean_mask(vectors, keep), values], axis=0)
    return _update(module, capacity, name, all_keys, all_values)


def _update(module, capacity, name, keys, values):
    """`serving_map.padded_map` in TensorFlow ops, assigned in place."""
    import tensorflow as tf

    n = tf.shape(keys)[0]
    checks = [
        tf.debugging.assert_less_equal(
            n,
            capacity,
            message=f"Layer '{name}': more keys than the table's {capacity} rows",
        ),
        tf.debugging.assert_equal(
            tf.shape(values)[0], n, message=f"Layer '{name}': one value per key"
        ),
    ]
    with tf.control_dependencies(checks):
        by_key = tf.argsort(keys, stable=True)
    k = tf.gather(keys, by_key)
    distinct = tf.reduce_all(tf.not_equal(k[1:], k[:-1]))
    with tf.control_dependencies(
        [tf.debugging.assert_equal(distinct, True, message=f"'{name}': repeated key")]
    ):
        high64 = tf.bitwise.right_shift(k, 32)
    high = tf.cast(high64, tf.int32)
    low = tf.cast(k - tf.bitwise.left_shift(high64, 32) - 2**31, tf.int32)
    bits = serving_map.directory_bits(capacity)
    bucket = serving_map.bucket_of(high, low, bits, xp=_tf_ops())
    # Stable: keys stay sorted within their bucket.
    by_bucket = tf.argsort(bucket, stable=True)
    order = tf.gather(by_key, by_bucket)
    words = tf.gather(tf.stack([high, low], axis=1), by_bucket)
    counts = tf.math.bincount(bucket, minlength=2**bits, maxlength=2**bits)
    directory = tf.concat([[0], tf.cumsum(counts)], axis=0)
    fullest = tf.reduce_max(tf.concat([counts, [0]], axis=0))
    rounds = tf.reduce_sum(
        tf.cast(tf.bitwise.right_shift(fullest, tf.range(31)) > 0, tf.int32)
    )
    pad = capacity - n
    version = module.meta[1] + 1
    # Empty first: a request served meanwhile reads zeros for this layer.
    module.meta.assign(tf.stack([0, module.meta[1], 0, module.meta[3]]))
    module.key_words.assign(
        tf.concat([words, tf.fill([pad, 2], serving_map.PAD_WORD)], axis=0)
    )
    module.rows.assign(tf.concat([tf.range(n), tf.fill([pad], -1)], axis=0))
    module.directory.assign(directory)
    # Rows past the new keys keep their old vectors: nothing points at them.
    dense_serving_export.scatter_rows(
        module.embeddings, tf.range(n), tf.gather(values, order)
    )
    module.meta.assign(tf.stack([n, version, rounds, module.meta[3]]))
    return n


def _tf_ops():
    """TensorFlow's ops under keras.ops' names, for `serving_map.bucket_of`."""
    import tensorflow as tf

    return types.SimpleNamespace(
        multiply=tf.math.multiply,
        bitwise_xor=tf.bitwise.bitwise_xor,
        right_shift=tf.bitwise.right_shift,
        bitwise_and=tf.bitwise.bitwise_and,
    )
