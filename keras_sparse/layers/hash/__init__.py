"""`DistributedHashEmbedding` and `HashEmbeddingCollection`, with their helpers.

The layers (`embedding`, `collection`) map any 64-bit key to a row of a
fixed-capacity device table through a hash table (`keras_sparse.table`).
`DistributedHashEmbedding` is built from mixins, one concept each:
`table_mapping` (keys to rows through the table), `key_calls` (a call
given keys), `row_output` (rows to vectors, fresh rows drawn),
`stage_feed` (a call given an input stage's codes, and the stage's hold),
`records` (exports, imports, checkpoints: `record_export`,
`record_import`, `record_saving`, `record_loading`, `record_store`);
`ttl_state` checks and saves its time to live, `trained_rows` reads rows
as of the last trained step while a stage runs ahead. The helpers, one
concept each:

* key mapping: `key_mapper` (the one interface of every route,
  `KeyMapper`, and its result `MappedKeys`), `key_mapping` (the routes),
  `jax_step_mapping`,
  `jax_group_mapping` (JAX in-step mapping), `host_keys`, `string_keys`,
  `tf_string_hash`, `table_users`;
* rows a call admits: `fresh_rows`, `keyed_fresh_rows`;
* what the input stage hands over: `prepared_inputs`;
* checkpoints and serving: `records`, `record_placement`,
  `record_progress`, `serving_map`, `serving_export`, `serving_hooks`.
"""
