"""A three-field hash model, built with a `HashEmbeddingCollection` or with
separate `DistributedHashEmbedding` layers (the reference), for tests."""

import numpy as np

FIELDS = {
    # name: (layer arguments, keys per sample or None for a 1-D input)
    "user": (dict(capacity=128, combiner="sum", eviction="lru"), 3),
    "item": (
        dict(capacity=64, combiner="mean", eviction="lfu", admit_after=2),
        4,
    ),
    "ctx": (dict(capacity=64, combiner=None, eviction="lru", table_seed=3), None),
}


def field_layers(table_device="cpu", dim=4):
    import keras

    import keras_sparse as ks

    return {
        name: ks.DistributedHashEmbedding(
            dim,
            optimizer="adagrad",
            table_device=table_device,
            embeddings_initializer=keras.initializers.RandomUniform(seed=7),
            name=f"{name}_emb",
            **kwargs,
        )
        for name, (kwargs, _) in FIELDS.items()
    }


def fields_model(together, table_device="cpu", jit_compile="auto", key_dtype="int32"):
    """``(model, layers)``: the three fields -> concatenate -> Dense(1);
    ``together`` maps them with one `HashEmbeddingCollection`."""
    import keras

    import keras_sparse as ks

    inputs = {
        name: keras.Input((width,) if width else (), dtype=key_dtype, name=name)
        for name, (_, width) in FIELDS.items()
    }
    weights = keras.Input((FIELDS["item"][1],), dtype="float32", name="item_w")
    layers = field_layers(table_device)
    if together:
        collection = ks.HashEmbeddingCollection(layers, name="fields")
        outs = collection(inputs, weights={"item": weights})
    else:
        outs = {
            name: layer(inputs[name], weights=weights if name == "item" else None)
            for name, layer in layers.items()
        }
    joined = keras.layers.Concatenate()([outs[name] for name in FIELDS])
    y = keras.layers.Dense(1, kernel_initializer="ones")(joined)
    model = keras.Model({**inputs, "item_w": weights}, y)
    model.compile("sgd", "mse", jit_compile=jit_compile)
    return model, layers


def fields_data(samples=192, seed=0):
    """Keys drawn from more ids than the tables hold (they evict), item
    weights with zeros (padding), and targets."""
    rng = np.random.default_rng(seed)
    x = {}
    for name, (_, width) in FIELDS.items():
        shape = (samples, width) if width else (samples,)
        x[name] = rng.zipf(1.3, shape).astype("int32") % 300
    w = rng.random((samples, FIELDS["item"][1])).astype("float32")
    x["item_w"] = np.where(w < 0.2, 0.0, w).astype("float32")
    return x, rng.normal(size=(samples, 1)).astype("float32")
