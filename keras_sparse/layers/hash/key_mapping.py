"""Where a `DistributedHashEmbedding`'s keys become rows: one decision per call.

The layer reads as one pipeline: normalize keys -> `map_keys` -> gather the
rows (fresh ones re-initialized) -> combine. `placement_of` names where the
key->row mapping runs, and each placement is one small function here or one
module of its own:

``"host"``         eager call, CPU table: NumPy keys, one table call.
``"gpu"``          eager call, GPU table: keys and rows stay on the device
                   (DLPack), see ``layer._map_on_gpu``.
``"jax_step"``     compiled JAX step, one table per process:
                   `keras_sparse.layers.hash.jax_step_mapping` (in-place buffer
                   callbacks on one device, an ordered io_callback otherwise).
``"key_sharded"``  compiled JAX step, a table shard per device:
                   `keras_sparse.sharding.jax_key_mapping`, reached through
                   the sharding hooks (`keras_sparse.layers.placement`).
``"tf_graph"``     TensorFlow graph: a ``tf.numpy_function`` into the table.
``"serving_map"``  compiled inference (``training`` falsy) on JAX or TF,
                   exports included: a binary search of the layer's serving
                   map inside the program, no host callback
                   (`keras_sparse.layers.hash.serving_map`).
``"shape_only"``   Keras' shape inference calling the layer eagerly on
                   placeholder values (PyTorch's ``compute_output_spec``,
                   e.g. when ``fit`` builds the model): no key has a row and
                   the table is not called, so it neither changes nor counts.

Each placement is a `KeyMapper` (`keras_sparse.layers.hash.key_mapper`,
the interface the key-sharded placements of `keras_sparse.sharding`
implement too) and returns flat `MappedKeys`: ``rows`` (int32, -1 where a
key has none), ``fresh`` (at the first position of each newly assigned
row) and, in training calls of layers whose fresh rows are drawn per key
(`keras_sparse.layers.hash.keyed_fresh_rows`), ``words`` (each key's two
32-bit halves: from the host keys, in the graph, or the high word from
the step's callback and the low word from the step's keys) or, key
sharded, ``init`` (the values, drawn on each device inside the step).
Rows computed ahead of the step by `keras_sparse.data.prefetch` bypass this
module (the layer's ``_call_prepared``).
"""

import keras
import numpy as np
from keras import ops

from keras_sparse.backend_utils import is_symbolic
from keras_sparse.layers import placement
from keras_sparse.layers.hash import jax_step_mapping
from keras_sparse.layers.hash import serving_map
from keras_sparse.layers.hash.host_keys import host_keys
from keras_sparse.layers.hash.host_keys import string_kind
from keras_sparse.layers.hash.key_mapper import KeyMapper
from keras_sparse.layers.hash.key_mapper import MappedKeys
from keras_sparse.ops.key_hash import step_words
from keras_sparse.ops.key_hash import words_of_keys
from keras_sparse.table.sharded_table import key_words


def _key_sharded(layer):
    return getattr(layer.table, "num_shards", None) is not None


def _key_mapper(layer):
    """The layer's `KeyMapper` when it was built key-sharded on TensorFlow
    or PyTorch (there the mapping is collective in every call), else None."""
    mapper = getattr(layer, "placement", None)
    return mapper if isinstance(mapper, KeyMapper) else None


def placement_of(layer, keys, insert=True, inference=False):
    """The name of the placement that maps ``keys`` for ``layer`` now."""
    symbolic = not isinstance(keys, np.ndarray) and is_symbolic(keys)
    if not symbolic and _in_shape_inference():
        return "shape_only"
    if _key_mapper(layer) is not None:
        return "key_sharded"
    if not symbolic:
        if layer.table.device == "gpu" and not string_kind(keys):
            return "gpu"
        return "host"
    backend = keras.backend.backend()
    if inference and backend != "torch" and serving_map.usable(layer, keys):
        return "serving_map"
    if backend == "jax":
        return "key_sharded" if _key_sharded(layer) else "jax_step"
    if backend == "tensorflow":
        return "tf_graph"
    raise NotImplementedError(
        f"Layer '{layer.name}': compiled steps are not supported on the "
        f"{backend} backend; use jit_compile=False."
    )


def _in_shape_inference():
    """True inside Keras' ``compute_output_spec``, whose calls only infer
    output shapes (PyTorch runs them on placeholder values when its "meta"
    device cannot)."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def _shape_only(layer, keys, use, insert, draw=None):
    return MappedKeys(ops.full_like(use, -1, "int32"), ops.zeros_like(use))


def _wants_words(layer, insert):
    """Whether this call's fresh rows are drawn per key (training only)."""
    return insert and layer.keys_drawn_per_key()


def _host(layer, keys, use, insert, draw=None):
    words = None
    full = layer.full_keys(keys)
    if _wants_words(layer, insert):
        full = host_keys(full)
        words = ops.convert_to_tensor(key_words(full))
    mapped = layer.map_host_keys(full, ops.convert_to_numpy(use), insert)
    rows, fresh = (
        ops.convert_to_tensor(mapped.rows),
        ops.convert_to_tensor(mapped.fresh),
    )
    return MappedKeys(rows, fresh, words=words)


def _gpu(layer, keys, use, insert, draw=None):
    words = None
    if _wants_words(layer, insert):
        if isinstance(keys, np.ndarray):
            words = key_words(host_keys(keys))
        else:
            words = words_of_keys(ops.reshape(keys, (-1,)))
        words = ops.convert_to_tensor(words)
    return layer._map_on_gpu(keys, use, insert)._replace(words=words)


def _size(keys):
    return None if None in tuple(keys.shape) else int(np.prod(keys.shape))


def _jax_step(layer, keys, use, insert, draw=None):
    words = _wants_words(layer, insert)
    mapped = jax_step_mapping.map_in_step(
        layer, keys, use, insert, _size(keys), words=words
    )
    if not words:
        return MappedKeys(*mapped)
    rows, fresh, high = mapped
    return MappedKeys(rows, fresh, words=step_words(high, ops.reshape(keys, (-1,))))


def _key_sharded_step(layer, keys, use, insert, draw=None):
    flat = ops.reshape(keys, (-1,))
    if draw is None and insert:
        draw = layer.keyed_draw()
    mapper = _key_mapper(layer)
    if mapper is not None:
        mapped = mapper.map_keys(layer, flat, use, insert, draw)
    else:  # JAX: the active distribution's placement, None if not key-sharded
        mapped = placement.provider().map_keys_in_step(layer, flat, use, insert, draw)
    if mapped is None:
        raise ValueError(
            f"Layer '{layer.name}' holds a table shard per device, but the "
            "active distribution does not key-shard it. Run it under the "
            "keras_sparse.sharding.distribution it was built with, or save "
            "it and reload it with keras_sparse.sharding.load_model(...)."
        )
    return mapped


def _rows_and_fresh(mapped):
    return mapped.rows, mapped.fresh


def _tf_graph(layer, keys, use, insert, draw=None):
    import tensorflow as tf

    n = _size(keys)
    rows, fresh = tf.numpy_function(
        lambda k, u: _rows_and_fresh(layer._map_step_keys(k, u, insert)),
        [keys, use],
        [tf.int32, tf.bool],
        stateful=True,
    )
    rows.set_shape((n,))
    fresh.set_shape((n,))
    words = None
    if _wants_words(layer, insert):  # in the graph, from the int64 keys
        words = words_of_keys(ops.reshape(keys, (-1,)))
    return MappedKeys(rows, fresh, words=words)


def _serving_map(layer, keys, use, insert, draw=None):
    rows = serving_map.lookup(layer, ops.reshape(keys, (-1,)))
    rows = ops.where(use, rows, -1)
    return MappedKeys(rows, ops.zeros_like(use))


class Route:
    """The `KeyMapper` of one placement: a function of this module."""

    def __init__(self, name, fn):
        self.name = name
        self._fn = fn

    def __repr__(self):
        return f"Route({self.name!r})"

    def map_keys(self, layer, keys, use, insert, draw=None):
        return self._fn(layer, keys, use, insert, draw)


ROUTES = {
    name: Route(name, fn)
    for name, fn in (
        ("host", _host),
        ("gpu", _gpu),
        ("jax_step", _jax_step),
        ("key_sharded", _key_sharded_step),
        ("tf_graph", _tf_graph),
        ("serving_map", _serving_map),
        ("shape_only", _shape_only),
    )
}


def route_of(layer, keys, insert=True, inference=False):
    """The `KeyMapper` that maps ``keys`` for ``layer`` now."""
    return ROUTES[placement_of(layer, keys, insert, inference)]


def map_keys(layer, keys, use, insert, inference=False):
    """Flat `MappedKeys` of ``keys`` (any shape) and flat bool ``use``;
    ``insert`` adds admitted new keys (training); ``inference`` (a call
    with ``training`` falsy) may read the serving map."""
    return route_of(layer, keys, insert, inference).map_keys(layer, keys, use, insert)
