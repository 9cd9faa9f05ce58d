"""Flat rows of a `DistributedHashEmbedding` call -> its output.

Mixin of the layer, shared by the keys path (`KeyCalls`) and a stage's
prepared codes (`StageFed`): fresh rows re-initialized in training (drawn
per key, `keras_sparse.layers.hash.keyed_fresh_rows`, or by rank,
`keras_sparse.layers.hash.fresh_rows`), rows looked up, evicted keys read
from the row store in read-only calls, and vectors pooled.
"""

import keras
from keras import ops

from keras_sparse.layers import row_moves
from keras_sparse.layers.hash.fresh_rows import fresh_row_values
from keras_sparse.layers.hash.keyed_fresh_rows import folded_fresh_values
from keras_sparse.layers.hash.keyed_fresh_rows import has_seed
from keras_sparse.layers.hash.keyed_fresh_rows import keyed_fresh_values
from keras_sparse.layers.hash.keyed_fresh_rows import per_key


class RowOutput:
    """Mixin of `DistributedHashEmbedding`: rows to output vectors (see the
    module docstring)."""

    def keys_drawn_per_key(self):
        """Whether fresh rows are drawn per key in training, so the key
        mapping must hand over each position's key words."""
        return per_key(self.embeddings_initializer) or (
            getattr(self.table, "num_shards", None) is not None
            and has_seed(self.embeddings_initializer)
        )

    def keyed_draw(self):
        """``(draw, seed)`` for fresh rows drawn per key:
        ``draw(fresh, words, seed) -> [n, dim]`` and the seed it takes (None
        for `keyed_fresh_rows.per_key` initializers, which use the layer's
        fixed ``fresh_seed``; else this step's seed, advancing the seed
        generator once, for key-sharded layers only)."""
        init, dim, dtype = (
            self.embeddings_initializer,
            self.output_dim,
            self.embeddings.dtype,
        )
        fans = (self.num_rows, self.output_dim)
        if per_key(init):
            fixed = self.fresh_seed

            def draw(fresh, words, seed):
                return keyed_fresh_values(init, fresh, words, dim, dtype, fixed, fans)

            return draw, None
        seed = self.seed_generator.next() if has_seed(init) else None

        def folded(fresh, words, seed):
            return folded_fresh_values(init, fresh, words, dim, dtype, seed, fans)

        return folded, seed

    def _train_lookup(self, rows, valid, fresh, prepared):
        """`lookup_rows` in training, re-initializing the fresh rows first:
        ``prepared["init"]`` when the mapping drew them (key sharding, per
        device), drawn per key from ``prepared["words"]`` (int32 ``[n, 2]``),
        else by rank (`fresh_rows`: initializers without a per-key form)."""
        init = prepared.pop("init", None)
        words = prepared.pop("words", None)
        if init is None and words is not None and self.keys_drawn_per_key():
            draw, seed = self.keyed_draw()
            init = draw(fresh, words, seed)
        elif init is None:
            init = fresh_row_values(
                self.embeddings_initializer,
                fresh,
                self.output_dim,
                self.embeddings.dtype,
                self.seed_generator,
                fans=(self.num_rows, self.output_dim),
            )
        # Rows the store fills are not drawn. Key-sharded placements whose
        # owners move their shards' rows in the mapping have done so.
        if self.row_tier is not None and not getattr(
            self.placement, "moves_rows", False
        ):
            filled = row_moves.move_rows(self, rows, fresh, self._moves_route())
            fresh = ops.logical_and(fresh, ops.logical_not(filled))
        return self.lookup_rows(rows, valid, True, reset=(fresh, init), **prepared)

    def _moves_route(self):
        """The route of the step's row moves: the one the layer's key
        mapping takes (`jax_step_mapping.choose_route`) where that is the
        in-place CPU buffer callback, else an ordered ``io_callback``.

        Unordered buffer callbacks keep the moves exact because their
        order is carried by data. In a step, the moves take the mapping's
        rows and fresh flags as inputs (so they run after it, whichever
        route mapped) and the lookup takes the filled rows (so they run
        before it; they are always consumed, never pruned). Across steps,
        step t+1 starts from the table and slot variables step t wrote
        with its filled rows, so step t's moves (write-backs of the keys
        it evicted, then its fills) finish before step t+1's moves read
        the store; and the plans they carry out are queued in call order
        (`RowTier.held` covers a plan whose step has not run yet).
        ``choose_route`` keeps io_callback where this fails: a layer
        called more than once a step (its calls must keep their order)
        and partitioned steps."""
        if keras.backend.backend() != "jax":
            return "io_callback"
        from keras_sparse.layers.hash import jax_step_mapping

        route = jax_step_mapping.choose_route(self)
        return route if route == "cpu_buffers" else "io_callback"

    def _vectors_out(self, rows, valid, fresh, weights, shape, insert, prepared=None):
        """Looks up flat ``rows`` and pools/reshapes them to the output.

        ``prepared``: the stage's ``segments`` / ``exchange_slot`` (see
        `_call_prepared`), passed on to `lookup_rows` (which uses segments
        only in training).
        """
        prepared = dict(prepared or {})
        if insert:
            vectors = self._train_lookup(rows, valid, fresh, prepared)
        else:
            prepared.pop("words", None)
            prepared.pop("init", None)
            stored = prepared.pop("stored", None)
            vectors = self.lookup_rows(rows, valid, False, **prepared)
            if stored is not None:  # keys the row store holds
                found, values = stored
                vectors = ops.where(ops.expand_dims(found, -1), values, vectors)
                valid = ops.logical_or(valid, found)
        vectors = ops.reshape(vectors, shape + (self.output_dim,))
        out = self.combine(vectors, weights, ops.reshape(valid, shape))
        return ops.cast(out, self.compute_dtype)
