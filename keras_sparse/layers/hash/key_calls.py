"""A `DistributedHashEmbedding` call given keys (not a stage's codes).

Mixin of the layer: the keys a user passes (arrays, lists, strings, ragged
or sparse tensors) normalized to one rectangular form with the mask of the
positions to map, mapped to rows (`TableMapping`) and looked up
(`RowOutput`).
"""

import keras
import numpy as np
from keras import ops

from keras_sparse.backend_utils import is_symbolic
from keras_sparse.backend_utils import is_tf_ragged_or_sparse
from keras_sparse.layers import inputs as input_forms
from keras_sparse.layers import row_moves
from keras_sparse.layers.hash.host_keys import host_keys as _host_keys
from keras_sparse.layers.hash.host_keys import string_kind as _string_kind
from keras_sparse.layers.hash.tf_string_hash import hash_strings_tf


class KeyCalls:
    """Mixin of `DistributedHashEmbedding`: its calls with keys (see the
    module docstring)."""

    def _normalize(self, inputs, weights):
        """(keys, weights, present); keys stay NumPy when given as NumPy."""
        if isinstance(inputs, (list, tuple)):
            try:
                inputs = np.asarray(inputs)
            except ValueError:
                raise ValueError(
                    f"Layer '{self.name}': `inputs` is a ragged Python list "
                    "(rows of different lengths). Pass a rectangular array "
                    "with `weights` 0 at the padding "
                    "(`keras_sparse.ragged_to_padded(values, row_lengths)` "
                    "makes both), or a tf.RaggedTensor on TensorFlow."
                ) from None
        if _string_kind(inputs) and not is_tf_ragged_or_sparse(inputs):
            if is_symbolic(inputs) and keras.backend.backend() == "tensorflow":
                # In the graph (no Python callback), so exports keep it.
                inputs = hash_strings_tf(inputs)
            else:
                try:
                    inputs = _host_keys(inputs).reshape(np.shape(inputs))
                except (TypeError, ValueError) as e:
                    raise type(e)(f"Layer '{self.name}': `inputs`: {e}.") from None
        if isinstance(inputs, np.ndarray):
            input_forms.check_integer_dtype(self.name, inputs)
            if weights is not None:
                weights = ops.convert_to_tensor(weights)
                if "float" not in str(weights.dtype):
                    weights = ops.cast(weights, "float32")
                if tuple(weights.shape) != inputs.shape:
                    raise ValueError(
                        f"Layer '{self.name}': `weights` must have the shape of "
                        f"the keys {inputs.shape}; received {tuple(weights.shape)}."
                    )
            return inputs, weights, None
        form = input_forms.normalize(self.name, inputs, weights)
        return form.ids, form.weights, form.present

    def _call_with_keys(self, inputs, weights, training):
        """`call` given keys (not a stage's codes)."""
        keys, weights, shape, use = self._call_keys(inputs, weights)
        insert = bool(training) and self.trainable
        # A frozen layer in a training step still maps through the table:
        # the serving map is refreshed for inference calls only.
        mapped = self._map_keys(keys, use, insert, inference=not training)
        rows, fresh, extra = mapped.rows, mapped.fresh, mapped.drawn()
        valid = rows >= 0
        if self.row_tier is not None and not insert:
            # Read-only calls read evicted keys from the store.
            rows = ops.where(use, rows, -2)  # padding is never looked up
            extra = {"stored": row_moves.read_stored(self, keys, rows)}
        if mapped.exchange_slot is not None:  # key sharding's packing
            extra = {**(extra or {}), "exchange_slot": mapped.exchange_slot}
        return self._vectors_out(rows, valid, fresh, weights, shape, insert, extra)

    def _call_keys(self, inputs, weights):
        """``(keys, weights, shape, use)`` of a call: keys normalized (a
        trailing axis added for a combiner), the keys' shape and the flat
        bool mask of the positions to map (not padding, weight not 0)."""
        keys, weights, present = self._normalize(inputs, weights)
        if self.combiner is not None and len(keys.shape) == 1:
            keys = (
                keys[:, None]
                if isinstance(keys, np.ndarray)
                else ops.expand_dims(keys, -1)
            )
            weights = None if weights is None else ops.expand_dims(weights, -1)
            present = None if present is None else ops.expand_dims(present, -1)
        shape = tuple(keys.shape)
        if None in shape:  # TF graphs with an unknown batch size
            shape = tuple(ops.shape(keys))
        use = ops.ones(shape, "bool")
        if present is not None:
            use = ops.logical_and(use, present)
        if weights is not None:
            use = ops.logical_and(use, ops.not_equal(weights, 0))
        return keys, weights, shape, ops.reshape(use, (-1,))
