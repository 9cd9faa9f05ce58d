"""A fixed-vocabulary table of ``cache_rows`` rows over a row store.

The one builder of cached tables (see `keras_sparse.layers.row_storage`):
`AllToAllDenseEmbedding(cache_rows=, store=)` and an `EmbeddingCollection`
table of ``TableConfig(cache_rows=, store=)`` each get a
`keras_sparse.layers.dense_cache.CacheRows` from `cached_table`,
checked by the same rules (`check_table`, `check_layer`,
`keras_sparse.layers.row_storage.cache_checks`) and built by `build`.
"""

from keras_sparse.layers import dense_cache
from keras_sparse.layers.row_storage import cache_checks


def check_table(where, input_dim, cache_rows, store, sharding, initializer):
    """The store spec of a table's ``cache_rows``/``store`` (what the table
    alone decides); raises ValueError naming ``where`` and the argument."""
    cache_checks.check_cache_rows(where, input_dim, cache_rows, store)
    cache_checks.check_sharding(where, sharding)
    cache_checks.check_initializer(where, initializer)
    return cache_checks.store_spec(where, store)


def check_layer(where, optimizer):
    """What a cached table needs of the layer owning it: a sparse
    optimizer (its cached rows change ids, so the layer updates them)."""
    cache_checks.check_optimizer(where, optimizer)


def cached_table(label, input_dim, output_dim, cache_rows, spec, **options):
    """The `CacheRows` of a ``[input_dim, output_dim]`` table: ``cache_rows``
    rows in its variables, the whole table in a dense store opened from
    ``spec`` when built. ``label`` names the table in errors ("Layer
    '{label}': ..."); ``options`` are `CacheRows`' keyword arguments."""
    return dense_cache.CacheRows(
        label, int(input_dim), int(output_dim), int(cache_rows), spec, **options
    )


def build(cache, input_shape=None):
    """Builds ``cache`` (its variables, then its store, filled from the
    table's initializer); refuses the several devices it cannot follow
    (`cache_checks.check_one_device`)."""
    cache_checks.check_one_device(cache.owner_name)
    cache.build(input_shape)
