"""What an input stage (`keras_sparse.data.prefetch`) may do to a hash layer.

A stage maps a layer's keys ahead of the step and feeds it int32 codes
instead of keys. While at least one open stage holds the layer, ``call``
takes the prepared path (``_call_prepared``); the layer switches back to raw
keys when the last stage releases it. Stages reach the layer only through
this mixin and `DistributedHashEmbedding.map_host_keys`, never through its
private state.
"""


class StageFed:
    """Mixin of `DistributedHashEmbedding`: the layer's side of the input
    stage's hold (see the module docstring)."""

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
