"""Row storage: where a table's rows live, built in one place.

Every keras_sparse table keeps its rows in the ways below, all built by
this package, for every layer kind:

- on the device, in Keras variables: the values, the sparse optimizer's
  slots, a dedup scratch, and the layer's step counter
  (`keras_sparse.layers.row_storage.variables`): the tables of
  `AllToAllDenseEmbedding`, `DistributedHashEmbedding` (through
  `SparseEmbeddingBase`), the stacks of `EmbeddingCollection`;
- with ``cache_rows``, a cache of that many rows in such variables over a
  row store holding the whole table (`keras_sparse.layers.row_storage.cache`,
  the cache itself being `keras_sparse.layers.dense_cache.CacheRows`): a
  fixed-vocabulary table of `AllToAllDenseEmbedding` or of
  `EmbeddingCollection`, with the same arguments, checks and exactness;
- with ``store=`` of `DistributedHashEmbedding`, a store of the keys its
  table evicted (`keras_sparse.layers.row_storage.hash_store`; the moves
  themselves: `keras_sparse.layers.row_tier`).

This package imports nothing on purpose: ``variables`` sits below the layer
classes, ``cache`` above the layer base its cache builds on, ``hash_store``
beside the hash layer it serves.
"""
