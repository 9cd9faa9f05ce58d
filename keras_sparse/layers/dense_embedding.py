"""AllToAllDenseEmbedding: a drop-in for keras.layers.Embedding."""

import keras
import numpy as np
from keras import ops

from keras_sparse.layers import inputs as input_forms
from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase
from keras_sparse.sharding import keras_integration as _sharding


def _check_positive_int(layer_name, name, value):
    if (
        not isinstance(value, (int, np.integer))
        or isinstance(value, bool)
        or value <= 0
    ):
        raise ValueError(
            f"Layer '{layer_name}': `{name}` must be a positive integer. "
            f"Received: {name}={value!r} (of type {type(value).__name__})."
        )


@keras.saving.register_keras_serializable(package="keras_sparse")
class AllToAllDenseEmbedding(SparseEmbeddingBase):
    """Fixed-vocabulary embedding with combiners and sparse optimizers.

    Same constructor as `keras.layers.Embedding`, plus keyword-only extras:

    Args:
        input_dim: vocabulary size; ids must be in ``[0, input_dim)``.
        output_dim: embedding width.
        embeddings_initializer, embeddings_regularizer, embeddings_constraint,
        mask_zero, weights: as in `keras.layers.Embedding`. With a sparse
            optimizer the regularizer applies to the rows looked up in the
            batch and the constraint to the rows just updated.
        combiner: None returns one vector per id (like Keras); "sum", "mean"
            or "sqrtn" pool the last axis (the bag) of the ids, so
            ``[batch, bag] -> [batch, output_dim]``. Padding (``mask_zero`` ids
            0, weight 0, ragged/sparse gaps) is excluded; an empty bag pools
            to zeros.
        optimizer: None keeps Keras semantics (dense gradients through the
            model's optimizer). A name ("sgd", "adagrad", "rowwise_adagrad",
            "adam", "ftrl"), a `keras_sparse.optimizers` instance or a Keras
            SGD/Adagrad/Adam/Ftrl instance makes the layer update only the
            touched rows inside its backward pass; the model's optimizer then
            leaves the table alone.
        sharding: placement of the table across devices ("auto", "data",
            "table", "row", "column").

    Call arguments:
        inputs: integer ids of any rank, or (TensorFlow) a tf.RaggedTensor or
            tf.SparseTensor.
        weights: optional per-id weights of the ids' shape; weight 0 marks
            padding (see `keras_sparse.ragged_to_padded`).

    Example:

    >>> import numpy as np, keras_sparse as ks
    >>> layer = ks.AllToAllDenseEmbedding(1000, 8, combiner="mean", optimizer="adagrad")
    >>> tuple(layer(np.array([[1, 2, 3], [4, 5, 6]])).shape)
    (2, 8)
    """

    def __init__(
        self,
        input_dim,
        output_dim,
        embeddings_initializer="uniform",
        embeddings_regularizer=None,
        embeddings_constraint=None,
        mask_zero=False,
        weights=None,
        lora_rank=None,
        lora_alpha=None,
        quantization_config=None,
        *,
        combiner=None,
        optimizer=None,
        sharding="auto",
        **kwargs,
    ):
        name = kwargs.get("name") or "all_to_all_dense_embedding"
        _check_positive_int(name, "input_dim", input_dim)
        _check_positive_int(name, "output_dim", output_dim)
        for arg, value in (
            ("lora_rank", lora_rank),
            ("lora_alpha", lora_alpha),
            ("quantization_config", quantization_config),
        ):
            if value is not None:
                raise ValueError(
                    f"Layer '{name}': `{arg}` is not supported by "
                    "AllToAllDenseEmbedding; pass None (LoRA and quantized "
                    "tables are not available for sparse embeddings yet)."
                )
        super().__init__(
            int(input_dim),
            int(output_dim),
            embeddings_initializer,
            embeddings_regularizer,
            embeddings_constraint,
            combiner=combiner,
            optimizer=optimizer,
            sharding=sharding,
            **kwargs,
        )
        self.input_dim = int(input_dim)
        self.mask_zero = bool(mask_zero)
        self.supports_masking = self.mask_zero
        if weights is not None:
            self.build()
            if isinstance(weights, (list, tuple)) and len(weights) == 1:
                weights = weights[0]
            weights = np.asarray(weights)
            if weights.shape != (self.input_dim, self.output_dim):
                raise ValueError(
                    f"Layer '{self.name}': `weights` must have shape "
                    f"{(self.input_dim, self.output_dim)}; received {weights.shape}."
                )
            # Padded to the variable's rows when a distribution pads the table.
            self.embeddings.assign(
                _sharding.padded_value(self, self.embeddings, weights)
            )

    def call(self, inputs, weights=None, training=None):
        ids, weights, valid = input_forms.fixed_vocabulary_ids(
            self.name, inputs, weights, self.input_dim, self.combiner, self.mask_zero
        )
        rows = self.lookup_rows(ids, valid, training)
        out = self.combine(rows, weights, valid)
        return ops.cast(out, self.compute_dtype)

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero or self.combiner is not None:
            return None
        return ops.not_equal(inputs, 0)

    def get_config(self):
        config = super().get_config()
        config.update({"input_dim": self.input_dim, "mask_zero": self.mask_zero})
        return config
