"""Which model input feeds each keras_sparse layer, and where it sits in a batch.

`plan` walks a functional model (or reads a ``feature_map``) once and gives
one `Feed` per keras_sparse layer. A feed's `ModelInput` finds the layer's
array in any batch ``x`` the way Keras' functional models read their inputs
(``Functional._standardize_inputs``): by the input's place in the model's
input structure (``keras.Model([ids], ...)`` or ``{"g": [ids]}`` as well as a
bare ``ids``), by the input's name in dict data, or by its position among the
flattened inputs (a bare array for a one-element list, a list for a dict
with sorted keys). Used by the prefetch stage (`keras_sparse.data.prefetch`)
and by the JAX full-key queues (`keras_sparse.layers.jax_full_keys`).
"""

from keras import tree

__all__ = [
    "Feed",
    "ModelInput",
    "check_sole_readers",
    "plan",
    "replace_at",
    "split_batch",
]


class ModelInput:
    """Where one model input sits in a batch's ``x``.

    Args:
        path: keys/indices of the input in the model's input structure (or
            the ``feature_map`` entry: ``(key,)``, or ``()`` for a bare array).
        index: position among the model's flattened inputs, or None.
        count: number of flattened model inputs, or None when unknown.
        name: the Input's name (dict data may be keyed by it), or None.
    """

    def __init__(self, path, index=None, count=None, name=None):
        self.path = tuple(path)
        self.index = index
        self.count = count
        self.name = name

    def describe(self):
        if self.name is not None:
            return f"input '{self.name}'"
        return f"input at {list(self.path)}" if self.path else "the single input"

    def find(self, x):
        """Path of this input's array in ``x`` (for `array_at`/`replace_at`).

        Raises ValueError when ``x`` holds no array for it.
        """
        path = _follow(x, self.path)
        if path is not None:
            return path
        if isinstance(x, dict) and self.name in x and _is_leaf(x[self.name]):
            return (self.name,)
        if self.index is not None:
            leaves = [tuple(p) for p, _ in tree.flatten_with_path(x)]
            if len(leaves) == self.count:
                return leaves[self.index]
        raise ValueError(
            f"cannot find {self.describe()} in a batch of structure "
            f"{_structure(x)}; give the data the structure of the model's "
            "inputs."
        )


def _is_leaf(x):
    return not isinstance(x, (dict, list, tuple))


def _follow(x, path):
    """``path`` when it leads to a leaf of ``x``, else None."""
    for step in path:
        if isinstance(x, dict) and step in x:
            x = x[step]
        elif isinstance(x, (list, tuple)) and isinstance(step, int):
            if not -len(x) <= step < len(x):
                return None
            x = x[step]
        else:
            return None
    return path if _is_leaf(x) else None


def _structure(x):
    return tree.map_structure(lambda a: type(a).__name__, x)


def array_at(x, path):
    """The leaf of ``x`` at ``path``."""
    for step in path:
        x = x[step]
    return x


def replace_at(x, path, value):
    """``x`` with its leaf at ``path`` replaced by ``value``.

    Copies the containers on the path and leaves ``x`` untouched. Lists
    become tuples: ``tf.data`` would stack a list of arrays into one tensor.
    """
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(x, dict):
        out = dict(x)
        out[head] = replace_at(x[head], rest, value)
        return out
    out = list(x)
    out[head] = replace_at(x[head], rest, value)
    return tuple(out)


def split_batch(batch):
    """``(x, y, sample_weight)`` of a batch as Keras yields it."""
    if isinstance(batch, dict):
        return batch, None, None
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple):
        return batch, None, None
    x = batch[0]
    y = batch[1] if len(batch) > 1 else None
    sw = batch[2] if len(batch) > 2 else None
    return x, y, sw


# ------------------------------------------------------------------ planning
class Feed:
    """One keras_sparse layer and the model inputs of its keys and weights.

    ``kind``: "hash" (a `DistributedHashEmbedding`, whose keys the stage maps)
    or "dense" (read for routing only).
    """

    def __init__(self, layer, keys, weights, kind):
        self.layer = layer
        self.keys = keys  # ModelInput
        self.weights = weights  # ModelInput or None
        self.kind = kind


def model_inputs(model):
    """``{id(KerasTensor): ModelInput}`` for a functional model's inputs."""
    struct = getattr(model, "_inputs_struct", None)
    if struct is None:
        inputs = getattr(model, "inputs", None) or []
        struct = inputs[0] if len(inputs) == 1 else list(inputs)
    flat = tree.flatten_with_path(struct)
    return {
        id(t): ModelInput(path, i, len(flat), getattr(t, "name", None))
        for i, (path, t) in enumerate(flat)
    }


def _sparse_layers(model):
    from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase

    seen, out = set(), []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, SparseEmbeddingBase) and id(layer) not in seen:
            seen.add(id(layer))
            out.append(layer)
    return out


def _kind(layer):
    return "hash" if is_hash_layer(layer) else "dense"


def is_hash_layer(layer):
    """True for a `DistributedHashEmbedding` (by its kind marker, so this
    module needs no import of the layer classes)."""
    return getattr(layer, "keras_sparse_kind", None) == "hash"


def is_fixed_layer(layer):
    """True for fixed-vocabulary keras_sparse layers (ids < 2**31)."""
    return getattr(layer, "keras_sparse_kind", None) == "fixed"


def plan(model, feature_map=None):
    """The `Feed` of each keras_sparse layer of ``model``.

    Functional models are walked: a layer must be called once, directly on
    a model input. ``feature_map`` (``{layer_name: input_key}``; a dict key
    of ``x``, an int position in a tuple/list ``x``, or None for a bare
    array ``x``) replaces the walk (subclassed models); layers it does not
    name are left out. Raises ValueError naming the layer otherwise.
    """
    if feature_map is not None:
        return _mapped_feeds(model, feature_map)
    inputs = field_calls = None
    feeds = []
    for layer in _sparse_layers(model):
        if inputs is None:
            inputs, field_calls = model_inputs(model), _field_calls(model)
        feed = _walked_feed(layer, _kind(layer), inputs, field_calls)
        if feed is not None:
            feeds.append(feed)
    return feeds


def _mapped_feeds(model, feature_map):
    places = {}  # one ModelInput per key: layers of one key share an input
    feeds = []
    for layer in _sparse_layers(model):
        if layer.name not in feature_map:
            continue
        key = feature_map[layer.name]
        if key not in places:
            places[key] = ModelInput((), 0, 1) if key is None else ModelInput((key,))
        feeds.append(Feed(layer, places[key], None, _kind(layer)))
    return feeds


def _calls(layer, field_calls):
    """``[(keys, weights)]``: the KerasTensors of each call of ``layer`` in
    the model (weights None when not given), its calls as a field of a
    `HashEmbeddingCollection` included."""
    calls = []
    for node in getattr(layer, "_inbound_nodes", []):
        args, kwargs = node.arguments.args, node.arguments.kwargs
        if args:
            calls.append(
                (args[0], kwargs.get("weights", args[1] if args[1:] else None))
            )
    return calls + field_calls.get(id(layer), [])


def _field_calls(model):
    """``{id(field layer): [(keys, weights)]}``: what each call of a
    `HashEmbeddingCollection` hands its fields (entries of its dicts)."""
    out = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if getattr(layer, "keras_sparse_kind", None) != "hash_collection":
            continue
        for keys, weights in _calls(layer, {}):
            if not isinstance(keys, dict):
                continue
            weights = weights if isinstance(weights, dict) else {}
            for name, field in layer.fields.items():
                out.setdefault(id(field), []).append(
                    (keys.get(name), weights.get(name))
                )
    return out


def _walked_feed(layer, kind, inputs, field_calls=None):
    own = [c for c in _calls(layer, field_calls or {}) if id(c[0]) in inputs]
    if len(own) != 1:
        if kind == "dense":
            return None  # routing only; skipped when not fed by an input
        raise ValueError(
            f"prefetch: cannot tell which model input feeds layer "
            f"'{layer.name}' (it must be called once, directly on a model "
            "input, in a functional model). Pass "
            "`feature_map={layer_name: input_key}`."
        )
    keys, w = own[0]
    weights = None
    if w is not None:
        if id(w) not in inputs:
            raise ValueError(
                f"prefetch: the `weights` of layer '{layer.name}' do not "
                "come directly from a model input."
            )
        weights = inputs[id(w)]
    return Feed(layer, inputs[id(keys)], weights, kind)


def check_sole_readers(model, feeds):
    """Refuses a hash layer's key input that another layer reads too.

    The prefetch stage replaces such an input with the hash layers' codes;
    any other reader (a layer other than a `DistributedHashEmbedding` fed by
    it) would silently get codes instead of keys. For functional models
    (whose feeds `plan` found by walking them).
    """
    by_path = {f.keys.path: f for f in feeds if f.kind == "hash"}
    readers = {
        t: by_path[place.path]
        for t, place in model_inputs(model).items()
        if place.path in by_path
    }
    hash_layers = {id(f.layer) for f in feeds if f.kind == "hash"}
    for nodes in getattr(model, "_nodes_by_depth", {}).values():
        for node in nodes:
            if (
                node.arguments is None
                or id(node.operation) in hash_layers
                # Hands each field's keys to a hash layer (its field).
                or getattr(node.operation, "keras_sparse_kind", None)
                == "hash_collection"
            ):
                continue
            for t in node.arguments.keras_tensors:
                feed = readers.get(id(t))
                if feed is not None:
                    raise ValueError(
                        f"prefetch: {feed.keys.describe()} feeds hash layer "
                        f"'{feed.layer.name}' and also layer "
                        f"'{node.operation.name}'; the stage replaces it with "
                        "the hash layers' row codes, which that layer would "
                        "read as keys. Give that layer its own model input."
                    )


def input_groups(feeds):
    """Indices of the hash feeds of each model input, in feed order."""
    groups = {}
    for i, feed in enumerate(feeds):
        if feed.kind == "hash":
            groups.setdefault(id(feed.keys), []).append(i)
    return list(groups.values())
