"""Per-key records of a `DistributedHashEmbedding`: export, import, checkpoints.

A record is a key with its row, vector, optimizer slots and score. Saving
stores records plus what fixes a key's candidate buckets (capacity, bucket
size, seed), the LRU clock and the admission counts, so a load into the same
geometry puts every key back at its row, and a load elsewhere re-places keys
hottest first and says what it dropped. Every argument is validated before
anything changes. Big tables show a progress bar (`keras_sparse.progress`).

`HashRecords` joins one mixin per concept: `record_export` (records out,
the table as of its last trained step), `record_import` (records in),
`record_saving` and `record_loading` (checkpoints), `record_store` (the row
store's rows in model files, `flush_store`); `record_progress` paces their
progress bars.
"""

from keras_sparse.layers.hash.record_export import RecordExport
from keras_sparse.layers.hash.record_import import RecordImport
from keras_sparse.layers.hash.record_loading import RecordLoading
from keras_sparse.layers.hash.record_saving import RecordSaving
from keras_sparse.layers.hash.record_store import RecordStore


class HashRecords(RecordExport, RecordImport, RecordSaving, RecordLoading, RecordStore):
    """Mixin of `DistributedHashEmbedding`: its records and checkpoints."""
