"""HashEmbeddingCollection: many hash fields, one table call per step."""

import weakref

import keras

from keras_sparse.layers.hash import jax_group_mapping
from keras_sparse.layers.hash import jax_step_mapping
from keras_sparse.layers.hash import key_mapping
from keras_sparse.layers.hash.embedding import DistributedHashEmbedding
from keras_sparse.layers.hash.host_keys import string_kind
from keras_sparse.ops import check_replicated_training


@keras.saving.register_keras_serializable(package="keras_sparse")
class HashEmbeddingCollection(keras.layers.Layer):
    """Several `DistributedHashEmbedding` fields whose tables are called
    together: one table call per training step for all fields.

    A model with many hash fields (user id, item id, ...) otherwise makes
    one table call per field and step. In a compiled JAX training step the
    collection concatenates its fields' keys, maps them with one callback
    and, with GPU tables (``table_device="gpu"``), one kernel launch whose
    blocks each run one field's table. Each field keeps its own layer,
    table, capacity, eviction, admission, optimizer and initializer, and
    gets exactly the rows, vectors and counts it would get as a separate
    layer. Under a Keras distribution that one callback is an ordered
    ``io_callback``, as for a single layer. Elsewhere (eager calls,
    TensorFlow, PyTorch, inference, prepared inputs from
    `keras_sparse.data.prefetch`, fields whose keys differ in dtype, a field
    layer also called outside the collection) each field is called as its
    own layer.

    Args:
        fields: dict ``{name: DistributedHashEmbedding}``, one layer per
            field (each layer in one field only).

    Call arguments:
        inputs: dict ``{name: keys}`` with exactly the fields' names; keys
            as a `DistributedHashEmbedding` takes them.
        weights: optional dict ``{name: weights}`` (any subset of fields).
        training: as for `DistributedHashEmbedding`.

    Returns a dict ``{name: output}``.

    Example:

    >>> import numpy as np, keras_sparse as ks
    >>> fields = {
    ...     name: ks.DistributedHashEmbedding(4, capacity=64, combiner="sum",
    ...                                       optimizer="adagrad", name=name)
    ...     for name in ("user", "item")
    ... }
    >>> collection = ks.HashEmbeddingCollection(fields)
    >>> out = collection({"user": np.array([[10**12], [7]]),
    ...                   "item": np.array([[3, 4], [4, 5]])}, training=True)
    >>> sorted(out), tuple(out["item"].shape)
    (['item', 'user'], (2, 4))
    >>> collection.fields["item"].stats()["size"]
    3
    """

    keras_sparse_kind = "hash_collection"

    def __init__(self, fields=None, **kwargs):
        name = kwargs.get("name") or "hash_embedding_collection"
        if not isinstance(fields, dict) or not fields:
            raise ValueError(
                f"Layer '{name}': `fields` must be a non-empty dict "
                "{name: DistributedHashEmbedding}. Received: "
                f"fields={fields!r}."
            )
        seen = {}
        for field, layer in fields.items():
            if not isinstance(field, str) or not field:
                raise ValueError(
                    f"Layer '{name}': field names must be non-empty strings. "
                    f"Received: {field!r}."
                )
            if not isinstance(layer, DistributedHashEmbedding):
                raise TypeError(
                    f"Layer '{name}': field '{field}' must be a "
                    "DistributedHashEmbedding. Received: "
                    f"{type(layer).__name__}."
                )
            if id(layer) in seen:
                raise ValueError(
                    f"Layer '{name}': fields '{seen[id(layer)]}' and '{field}' "
                    "share one layer; give each field its own layer."
                )
            seen[id(layer)] = field
        super().__init__(**kwargs)
        self.field_names = list(fields)
        self.fields = dict(fields)
        for layer in fields.values():
            # Read by the step mapping: a table reached from several calls
            # per step must keep their program order.
            owners = layer.__dict__.setdefault("_ks_hash_collections", [])
            owners.append(weakref.ref(self))
        # Raw NumPy keys (int64, strings) reach the fields unconverted, as
        # with a single DistributedHashEmbedding.
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True
        self.supports_jit = keras.backend.backend() == "jax"

    def build(self, input_shape=None):
        for name in self.field_names:
            layer = self.fields[name]
            if not layer.built:
                shape = input_shape.get(name) if isinstance(input_shape, dict) else None
                layer.build(shape)
        self.built = True

    def _checked(self, inputs, weights):
        if not isinstance(inputs, dict) or set(inputs) != set(self.field_names):
            got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(
                f"Layer '{self.name}': `inputs` must be a dict with exactly the "
                f"fields {sorted(self.field_names)}. Received: {got}."
            )
        weights = {} if weights is None else weights
        if not isinstance(weights, dict) or not set(weights) <= set(self.field_names):
            raise ValueError(
                f"Layer '{self.name}': `weights` must be a dict whose keys are "
                f"among the fields {sorted(self.field_names)}. Received: "
                f"{sorted(weights) if isinstance(weights, dict) else weights!r}."
            )
        return weights

    def call(self, inputs, weights=None, training=None):
        weights = self._checked(inputs, weights)
        layers = [self.fields[name] for name in self.field_names]
        route = self._together_route(layers, inputs, training)
        if route is None:
            return {
                name: layer(inputs[name], weights=weights.get(name), training=training)
                for name, layer in zip(self.field_names, layers)
            }
        for layer in layers:
            check_replicated_training(layer.name, maps_keys=True)
        prepared = [
            layer._call_keys(inputs[name], weights.get(name))
            for name, layer in zip(self.field_names, layers)
        ]
        keys = [keras.ops.reshape(p[0], (-1,)) for p in prepared]
        # Fresh rows drawn per key need each key's words (high word from
        # the callback, which has the full keys).
        words = any(layer.keys_drawn_per_key() for layer in layers)
        mapped = jax_group_mapping.map_group_in_step(
            self, layers, keys, [p[3] for p in prepared], True, route, words
        )
        out = {}
        for name, layer, (_, w, shape, _), field in zip(
            self.field_names, layers, prepared, mapped
        ):
            out[name] = layer._vectors_out(
                field.rows, field.rows >= 0, field.fresh, w, shape, True, field.drawn()
            )
        return out

    def _together_route(self, layers, inputs, training):
        """The route of one callback for all fields, or None (each field
        maps its own keys): only training steps of trainable fields under
        ``jax.jit``, where every field would take the in-step callback."""
        if not training or len(layers) < 2:
            return None
        dtypes = {str(getattr(inputs[name], "dtype", None)) for name in inputs}
        if len(dtypes) != 1:  # one key buffer: no promotion of any field's keys
            return None
        for name, layer in zip(self.field_names, layers):
            keys = inputs[name]
            if (
                not layer.trainable
                or jax_step_mapping.calls_per_step(layer) > 1
                or layer.prepared_form is not None
                or string_kind(keys)
                or None in tuple(getattr(keys, "shape", (None,)))
                or key_mapping.placement_of(layer, keys, True, False) != "jax_step"
            ):
                return None
        return jax_group_mapping.group_route(self, layers)

    def compute_output_shape(self, input_shape):
        return {
            name: self.fields[name].compute_output_shape(input_shape[name])
            for name in self.field_names
        }

    def stats(self):
        """``{field: DistributedHashEmbedding.stats()}``."""
        return {name: self.fields[name].stats() for name in self.field_names}

    def export(self, include_rows=False, since_step=None):
        """``{field: layer.export(include_rows, since_step)}``: the fields'
        records, or their deltas (`keras_sparse.apply_delta` applies them
        field by field)."""
        return {
            name: self.fields[name].export(include_rows, since_step=since_step)
            for name in self.field_names
        }

    def get_config(self):
        config = super().get_config()
        config["fields"] = {
            name: keras.saving.serialize_keras_object(self.fields[name])
            for name in self.field_names
        }
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["fields"] = {
            name: keras.saving.deserialize_keras_object(layer)
            for name, layer in config["fields"].items()
        }
        return cls(**config)
