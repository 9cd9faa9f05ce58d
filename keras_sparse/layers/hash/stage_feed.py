"""What an input stage (`keras_sparse.data.prefetch`) may do to a hash layer.

A stage maps a layer's keys ahead of the step and feeds it int32 codes
instead of keys. While at least one open stage holds the layer, ``call``
takes the prepared path (``_call_prepared``); the layer switches back to raw
keys when the last stage releases it. Stages reach the layer only through
this mixin and `DistributedHashEmbedding.map_host_keys`, never through its
private state.

A stage-held layer tells the keys a user passes from the codes the stage
feeds where that is cheap (`fed_keys`, `check_codes`): a read-only call with
NumPy keys maps them as of the last trained step
(`keras_sparse.layers.hash.trained_rows`); a training call with keys, or
values no code can take, raises naming the layer.
"""

import numpy as np
from keras import ops

from keras_sparse.backend_utils import is_symbolic
from keras_sparse.backend_utils import is_tf_ragged_or_sparse
from keras_sparse.layers import placement
from keras_sparse.layers import row_moves
from keras_sparse.layers.hash.host_keys import string_kind
from keras_sparse.layers.hash.prepared_inputs import split_words
from keras_sparse.layers.hash.prepared_inputs import take_blocks
from keras_sparse.layers.hash.prepared_inputs import unpack_prepared

_WHAT_TO_DO = (
    "Feed it the stage's own batches (model.fit / evaluate / predict of a "
    "keras_sparse.data.prefetch stage), call the layer with keys as a NumPy "
    "array for a read-only call (training=False), or close the stage first "
    "(stage.close(), or leave its `with` block)."
)


def fed_keys(inputs):
    """Whether a stage-held layer's ``inputs`` are surely keys, not codes:
    the stage hands Keras tensors, never NumPy arrays, lists or strings."""
    return (
        isinstance(inputs, (np.ndarray, list, tuple))
        or string_kind(inputs)
        or is_tf_ragged_or_sparse(inputs)
    )


class StageFed:
    """Mixin of `DistributedHashEmbedding`: the layer's side of the input
    stage's hold, and its calls with the codes a stage feeds (see the module
    docstring)."""

    #: ``(layer, trained steps) -> undo records`` of the table calls made for
    #: batches a training stage mapped but the model has not trained yet, or
    #: None (`keras_sparse.data.lookahead`; read by checkpoints and exports).
    stage_lookahead = None
    _stage_holds = 0
    _stage_form = None

    @property
    def prepared_form(self):
        """The `PreparedForm` of the codes open stages feed this layer, or
        None when it is called with keys."""
        return self._stage_form if self._stage_holds else None

    def trained_steps(self):
        """The layer's step counter: the batches it trained. Mid-epoch, a
        JAX ``fit`` keeps the variables in its loop; those of the model a
        training stage feeds are re-attached first (as Keras does for a
        callback's ``self.model``)."""
        sync = getattr(self.stage_lookahead, "sync", None)
        if sync is not None:
            sync()
        try:
            return int(ops.convert_to_numpy(self.sparse_iterations))
        except TypeError:  # a JAX fit detached the value
            raise RuntimeError(
                f"Layer '{self.name}': its variables are detached while a JAX "
                "model.fit runs an epoch, so its trained state cannot be read. "
                "Reach the layer through the callback's `self.model` (which "
                "re-attaches them, e.g. self.model.get_layer(name)), or read "
                "it after fit."
            ) from None

    def refuse_keys(self, inputs, training):
        """Raises for keys passed to a training call of a stage-held layer:
        its table is mapped by the stage, batch by batch, in order."""
        if training and self.trainable:
            raise ValueError(
                f"Layer '{self.name}': a training call received keys "
                f"(`inputs` of dtype {getattr(inputs, 'dtype', type(inputs))}) "
                "while a prefetch stage holds the layer: the stage maps its "
                "table and feeds it prepared int32 codes. " + _WHAT_TO_DO
            )

    def check_codes(self, codes, training):
        """Raises when an eager call of a stage-held layer got values no
        code of this layer can take (keys, most likely); ``codes``: its own
        block, unpacked. Skipped where the check would cost a device sync
        in a training step (PyTorch on a GPU)."""
        if is_symbolic(codes):
            return
        if training and getattr(getattr(codes, "device", None), "type", "") == "cuda":
            return
        values = ops.convert_to_numpy(codes)
        rows = self.num_rows
        if values.size == 0 or (values.min() >= -1 - rows and values.max() < rows):
            return
        raise ValueError(
            f"Layer '{self.name}': a prefetch stage holds this layer, so it "
            f"takes the int32 codes the stage prepares (in [{-1 - rows}, "
            f"{rows - 1}] for its {rows} rows), not keys; received values in "
            f"[{values.min()}, {values.max()}]. " + _WHAT_TO_DO
        )

    def unclear_codes(self, error):
        """A clear error for prepared inputs whose layout does not fit."""
        return ValueError(
            f"Layer '{self.name}': a prefetch stage holds this layer, so it "
            "takes the prepared int32 codes the stage lays out for it, not "
            f"keys; the input does not fit that layout ({error}). " + _WHAT_TO_DO
        )

    def hold_for_stage(self, form):
        """Counts one more open stage feeding codes laid out as ``form``.

        Returns True when the layer switched from keys to codes (compiled
        functions must then be retraced). Raises, changing nothing, when
        another open stage feeds codes laid out differently.
        """
        if self._stage_holds and form != self._stage_form:
            raise ValueError(
                f"prefetch: layer '{self.name}' is fed by another open "
                "stage whose prepared inputs are laid out differently "
                "(dedup / bucket / replicas / shared inputs); close it "
                "first, or create both stages with the same `dedup`, "
                "`bucket` and `feature_map`."
            )
        self._stage_holds += 1
        self._stage_form = form
        return self._stage_holds == 1

    def release_from_stage(self):
        """Counts one stage fewer; True when the layer switched back to keys."""
        if not self._stage_holds:
            return False
        self._stage_holds -= 1
        if self._stage_holds:
            return False
        self._stage_form = None
        return True

    # --- prepared-input fast path (keras_sparse.data.prefetch) begin
    def _call_prepared(self, codes, weights, training):
        """`call` for inputs prepared by `keras_sparse.data.prefetch`.

        Active only while a prefetch stage holds the layer in "prepared
        inputs" mode (``self.prepared_form`` not None, see `hold_for_stage`).
        ``codes`` are int32 of the keys' shape: ``row >= 0`` for a key
        already in the table, ``-2 - row`` for a row freshly assigned by the
        stage (re-initialized in this step, exactly like the slow path's
        ``fresh`` flag) and ``-1`` for a key without a row (not admitted,
        padding, or absent in inference). The
        stage already did the table lookup in batch order, so no host callback
        runs here; the fresh-row draw and the sparse-update counter advance
        exactly as in the slow path. With a layout set by the stage
        (``prepared_form.layout = (replicas, channel)``, see
        `unpack_prepared`), ``codes`` also carry a second int32 per position:
        its segment among the batch's distinct rows (``channel ==
        "segments"``; the sparse update uses them instead of sorting) or its
        slot in its owner's row-exchange buffer (``channel`` an
        `ExchangeBuckets`; the sharded lookup skips its own packing). When
        the model input also feeds other hash layers, ``codes`` holds every
        such layer's blocks and ``prepared_form.share`` says which are this
        layer's (`take_blocks`). Layers drawing fresh rows per key also get
        two blocks of key words last (``prepared_form.words``: the replicas
        they are packed for, `split_words`).
        """
        codes = ops.cast(ops.convert_to_tensor(codes), "int32")
        if is_symbolic(codes):
            codes, extra, words = self._unpacked(codes)
        else:  # keys of another shape would fail obscurely in the unpacking
            try:
                codes, extra, words = self._unpacked(codes)
            except Exception as e:  # noqa: BLE001 - each backend's shape error
                raise self.unclear_codes(e) from None
            self.check_codes(codes, training)
        segments = exchange_slot = None
        layout = self.prepared_form.layout
        if layout is not None:
            if layout[1] == "segments":
                segments = extra
            else:
                self._check_exchange_buckets(layout[1])
                exchange_slot = extra
        if weights is not None:
            weights = ops.convert_to_tensor(weights)
            if "float" not in str(weights.dtype):
                weights = ops.cast(weights, "float32")
        if self.combiner is not None and len(codes.shape) == 1:
            codes = ops.expand_dims(codes, -1)
            weights = None if weights is None else ops.expand_dims(weights, -1)
        shape = tuple(codes.shape)
        if None in shape:
            shape = tuple(ops.shape(codes))
        flat = ops.reshape(codes, (-1,))
        fresh = ops.less_equal(flat, -2)
        rows = ops.where(fresh, -2 - flat, flat)
        valid = ops.greater_equal(rows, 0)
        insert = bool(training) and self.trainable
        prepared = {"segments": segments, "exchange_slot": exchange_slot}
        if words is not None:
            prepared["words"] = words
        if self.row_tier is not None and not insert and words is not None:
            # Read-only: keys without a row are read from the store.
            if weights is not None:  # padding is never looked up
                use = ops.reshape(ops.not_equal(weights, 0), (-1,))
                rows = ops.where(use, rows, -2)
            prepared["stored"] = row_moves.read_stored_words(self, words, rows)
        return self._vectors_out(rows, valid, fresh, weights, shape, insert, prepared)

    def _unpacked(self, codes):
        """``(codes, extra, words)`` of a prepared input: this layer's
        blocks (`take_blocks`), its key words (`split_words`) and the
        segments or exchange slots of its layout (`unpack_prepared`), None
        where absent."""
        form = self.prepared_form
        share = form.share
        if share is not None:  # the input feeds other hash layers too
            codes = take_blocks(codes, *share)
        extra = words = None
        layout = form.layout
        words_replicas = form.words
        if words_replicas:  # two blocks of key words follow the others
            blocks = (1 if layout is None else 2) + 2
            codes, words = split_words(codes, words_replicas, blocks)
        if layout is not None:
            codes, extra = unpack_prepared(codes, layout[0])
        return codes, extra, words

    def _check_exchange_buckets(self, buckets):
        now = placement.provider().exchange_buckets(self)
        if now != buckets:
            raise ValueError(
                f"Layer '{self.name}': the prefetch stage bucketed its ids for "
                f"{buckets}, but the active distribution gives {now}. Create "
                "the stage under the distribution the model runs with."
            )

    # --- prepared-input fast path (keras_sparse.data.prefetch) end
