"""Undoing the table calls of batches a prefetch stage mapped but never trained.

A stage maps batches ahead of their steps. When a pass is abandoned (the
stage closed while batches it mapped were not trained: early stopping, an
exception, ``steps_per_epoch``), their table calls must not stay. Without a
row store the stage erases the keys they gave fresh rows (`prefetch`). A
layer with a row store (``DistributedHashEmbedding(store=...)``) cannot
erase: the keys those calls evicted are in no row and not in the store,
since their write-back happens in the step that never ran. So the table is
put back exactly as the last trained step left it (the calls' undo records,
`keras_sparse.table.undo`: keys at their rows, scores, clock, admission
counts) and the calls' row moves are dropped. An evicted key is back in its
row, which no untrained step touched; a key an untrained call was to bring
back from the store is still there.

A layer with a time to live (``ttl_steps``) is undone the same way
(`undo_since`): erasing would leave the table's clock advanced by the
untrained calls, so later keys would expire early, and the keys those calls
expired would stay erased. Its untrained calls are those of the batches
past its step counter.
"""

import keras


def undo_untrained(layer, journal):
    """Undoes ``layer``'s table calls whose steps did not run (its row
    store's pending moves; their undo records are the newest of
    ``journal``, a `keras_sparse.data.lookahead.Journal`). Returns how many
    calls were undone."""
    tier = layer.row_tier
    _wait_for_steps()
    count = tier.pending()
    if not count:
        return 0
    records = journal.newest(count)
    if records is None:
        raise RuntimeError(
            f"Layer '{layer.name}': {count} table calls of the prefetch stage "
            "have no step yet, but the stage kept the records of fewer (Keras "
            "fetched batches of a finished pass that it did not train); the "
            "keys they evicted cannot be returned to the table. Restore the "
            "model from a checkpoint."
        )
    layer.table.undo_calls(records)
    tier.drop_newest(count)
    return count


def undo_since(layer, journal, first):
    """Undoes ``layer``'s table calls for the batches ``first`` on of the
    pass ``journal`` (a `keras_sparse.data.lookahead.Journal`) recorded.
    Returns how many calls were undone, or None when the journal no longer
    holds them all (Keras fetched batches far ahead of training)."""
    try:
        records = journal.since(first, layer.name)
    except RuntimeError:
        return None
    if records:
        layer.table.undo_calls(records)
    return len(records)


def _wait_for_steps():
    """Returns once every dispatched step has run its host moves (JAX runs
    compiled steps asynchronously)."""
    if keras.backend.backend() == "jax":
        import jax

        jax.effects_barrier()
