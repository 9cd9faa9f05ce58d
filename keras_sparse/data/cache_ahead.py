"""The input stage's look-ahead for tables with ``cache_rows``.

A training pass hands each batch to Keras only after mapping, for every
`AllToAllDenseEmbedding` with ``cache_rows`` it feeds, the batch's ids to
cache rows (`CacheRows.map_ahead`): the mapping, most of a cached step's
host work, then runs while the previous step trains, and the step only
moves the rows its mapping chose. Batches are mapped in the order Keras
receives them, after routing, so a step finds its batch's mapping first in
line; when it does not (a batch fetched but never trained), the mappings
are undone and the step maps its ids itself
(`keras_sparse.layers.row_storage.ahead_maps`).
"""

import numpy as np

from keras_sparse.layers.model_feeds import array_at


def cached_feeds(feeds):
    """The feeds whose layer has a ``cache_rows`` table the look-ahead
    serves: a fixed-vocabulary layer's, fed plain ids (no per-id weights,
    whose zeros would leave positions unused)."""
    return [
        feed
        for feed in feeds
        if feed.kind == "dense"
        and getattr(feed.layer, "row_cache", None) is not None
        and feed.weights is None
    ]


def map_batch(feeds, x):
    """Maps batch ``x``'s ids ahead for each of ``feeds`` (`cached_feeds`);
    raises as the step would (e.g. an id out of range), before it runs."""
    for feed in feeds:
        ids = np.asarray(array_at(x, feed.keys.find(x)))
        if ids.dtype.kind in "iu":
            feed.layer.row_cache.map_ahead(ids)
