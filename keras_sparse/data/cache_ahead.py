"""The input stage's look-ahead for tables with ``cache_rows``.

A training pass hands each batch to Keras only after mapping, for every
table with ``cache_rows`` it feeds (an `AllToAllDenseEmbedding`'s, or a
table of an `EmbeddingCollection`), the batch's ids to cache rows
(`CacheRows.map_ahead`): the mapping, most of a cached step's host work,
then runs while the previous step trains, and the step only moves the
rows its mapping chose. Batches are mapped in the order Keras receives
them, after routing, so a step finds its batch's mapping first in line;
when it does not (a batch fetched but never trained), the mappings are
undone and the step maps its ids itself
(`keras_sparse.layers.row_storage.ahead_maps`).
"""

import numpy as np

from keras_sparse.layers.model_feeds import array_at
from keras_sparse.layers.row_storage import cache_batches


def cached_feeds(model, feeds):
    """``[(cache, ModelInput)]``: the tables with ``cache_rows`` the
    look-ahead serves and the model input of each. A fixed-vocabulary
    layer's table among the stage's ``feeds``, and the collection tables
    a functional model reads straight from an input; each fed plain ids
    (no per-id weights, whose zeros would leave positions unused). Each
    layer is called once (`model_feeds.plan`, `_of_a_collection`): a step
    takes a mapping only if it was made for exactly its ids, one per table
    and batch."""
    found = [
        (feed.layer.row_cache, feed.keys)
        for feed in feeds
        if feed.kind == "dense"
        and getattr(feed.layer, "row_cache", None) is not None
        and feed.weights is None
    ]
    if hasattr(model, "_inputs_struct"):  # a functional model: walk it
        found += [
            (cache, place)
            for cache, place in cache_batches.feeds(model)
            if _of_a_collection(cache)
        ]
    return found


def _of_a_collection(cache):
    """Whether ``cache`` is a table of an `EmbeddingCollection` called
    once in the model (a second call, e.g. with per-id weights, would map
    other ids in the step)."""
    owner = cache._owner() if cache._owner is not None else None
    tables = getattr(owner, "table_caches", {}).values()
    calls = len(getattr(owner, "_inbound_nodes", ()))
    return calls == 1 and any(c is cache for c in tables)


def host_ids(feeds, x):
    """The ids of batch ``x`` (host arrays, before any device copy) for
    each of ``feeds`` (`cached_feeds`), in order; None where not integers
    (the step then maps them itself)."""
    out = []
    for _, place in feeds:
        ids = np.asarray(array_at(x, place.find(x)))
        out.append(ids if ids.dtype.kind in "iu" else None)
    return out


def map_batch(feeds, ids):
    """Maps one batch's ``ids`` (`host_ids`) ahead for each of ``feeds``
    (`cached_feeds`), in the order Keras receives the batches; raises as
    the step would (e.g. an id out of range), before it runs."""
    for (cache, _), each in zip(feeds, ids):
        if each is not None:
            cache.map_ahead(each)
