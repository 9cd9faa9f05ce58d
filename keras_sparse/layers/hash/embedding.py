"""DistributedHashEmbedding: an embedding for an open-ended set of int64 keys."""

import keras
import numpy as np

from keras_sparse.layers import jax_full_keys
from keras_sparse.layers import placement
from keras_sparse.layers.arguments import check_choice
from keras_sparse.layers.arguments import check_given
from keras_sparse.layers.arguments import check_known
from keras_sparse.layers.arguments import check_positive_int
from keras_sparse.layers.hash import deltas
from keras_sparse.layers.hash import serving_hooks
from keras_sparse.layers.hash import serving_map
from keras_sparse.layers.hash import serving_state
from keras_sparse.layers.hash import stage_feed
from keras_sparse.layers.hash import trained_rows
from keras_sparse.layers.hash.deltas import checked_flag
from keras_sparse.layers.hash.key_calls import KeyCalls
from keras_sparse.layers.hash.quantized_table import QuantizedTable
from keras_sparse.layers.hash.records import HashRecords
from keras_sparse.layers.hash.row_output import RowOutput
from keras_sparse.layers.hash.stage_feed import StageFed
from keras_sparse.layers.hash.table_mapping import TableMapping
from keras_sparse.layers.hash.ttl_state import checked_ttl_steps
from keras_sparse.layers.row_storage import hash_store
from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase
from keras_sparse.layers.table_storage import ARGUMENTS as STORAGE_ARGUMENTS
from keras_sparse.layers.table_storage import TableStorage
from keras_sparse.ops import check_replicated_training
from keras_sparse.table import HashTable

_OWN_ARGUMENTS = (
    "output_dim",
    "capacity",
    "combiner",
    "optimizer",
    "embeddings_initializer",
    "embeddings_regularizer",
    "eviction",
    "admit_after",
    "key_dtype",
    "sharding",
    "table_device",
    "table_seed",
    "store",
    *STORAGE_ARGUMENTS,
    "ttl_steps",
    "track_changes",
)


@keras.saving.register_keras_serializable(package="keras_sparse")
class DistributedHashEmbedding(
    QuantizedTable,
    TableMapping,
    KeyCalls,
    RowOutput,
    StageFed,
    HashRecords,
    SparseEmbeddingBase,
):
    """Embedding for an unbounded key space backed by a `keras_sparse.table.HashTable`.

    Keys (int64 ids such as user or item ids, or strings) are mapped to rows
    of a ``[capacity, output_dim]`` table by a hash table with admission and
    eviction, so the vocabulary need not be known in advance. Only the rows a
    batch touches are trained, by the layer's own sparse optimizer.

    Semantics in training (``training=True``):

    - A key seen for the ``admit_after``-th time gets a row. Its vector is
      drawn from ``embeddings_initializer`` in the step and its optimizer
      slots are reset to their initial values, so a row reused after an
      eviction never carries the previous key's state.
    - Keys not (yet) admitted read zeros and train nothing.
    - When the table is full the coldest key of the two candidate buckets is
      evicted (``eviction="lru"`` or ``"lfu"``); with ``eviction=None`` a full
      table raises a `keras_sparse.table.TableFullError` naming capacity and
      size before any state changes.
    - With ``ttl_steps=N`` a key no training step has seen for ``N`` steps
      expires at the start of the next step: its row is free for that
      step's new keys and starts fresh like any new key (see
      `keras_sparse.table.ttl`; ``stats()["expired"]``).

    In inference (``training=False``, or a frozen layer) the table is only
    read: unknown keys read zeros and nothing is inserted. Compiled
    inference (``predict``/``evaluate`` on TensorFlow; on JAX with x64 or
    ``key_dtype="int32"``) and ``model.export`` read the layer's serving map
    instead of calling the table: a copy of its key->row map in four
    non-trainable variables, searched inside the program and refreshed when
    the table changed (see `keras_sparse.layers.hash.serving_map`).

    How compiled steps reach the table (one placement per call, see
    `keras_sparse.layers.hash.key_mapping`): the table is Python state (NumPy, or
    CuPy with ``table_device="gpu"``). Eagerly the layer calls it directly.
    Key-sharded (``sharding="key"``), each device maps its keys on their
    owners' shards inside the step. In a compiled JAX step on one device (no
    Keras distribution) the key->row mapping is an in-place
    ``jax.experimental.buffer_callback``: a CPU table in a CPU step reads the
    step's key buffer and writes the rows into its output buffers without
    copies; a GPU table in a step on the same GPU does the same with CuPy on
    XLA's stream, so keys and rows stay on the device. Under a distribution,
    and for a CPU table in a GPU step, it is an ordered
    ``jax.experimental.io_callback`` (see
    `keras_sparse.layers.hash.jax_step_mapping`). In a TensorFlow graph it is a
    `tf.numpy_function`. XLA cannot run host callbacks inside TensorFlow
    graphs, so on TensorFlow the layer sets ``supports_jit = False``:
    ``compile(jit_compile=True)`` warns and compiles the whole step as a plain
    tf.function without XLA (``"auto"`` picks that silently). On PyTorch the
    layer also reports ``supports_jit = False`` (``jit_compile=True`` falls
    back to eager steps). On JAX the whole step stays under ``jax.jit``. An
    error raised by the table inside a compiled step (a full table with
    ``eviction=None``) leaves the table as the last good step left it, but
    aborts the step, and Keras has donated that step's model variables: restore
    from a checkpoint. The prefetch stage (`keras_sparse.data.prefetch`) raises
    such errors before the step.

    Args:
        output_dim: embedding width.
        capacity: positive int, rows of the table; the hash table rounds it
            up to whole buckets of 16 rows and to at least 64 rows (4
            buckets), and ``layer.capacity`` / ``stats()["capacity"]``
            report the result: ``capacity=16`` holds 64 keys, also with
            ``eviction=None``. Key-sharded, each of the ``D`` shards gets
            ``capacity / D`` rounded the same way.
        combiner: None, "sum", "mean" or "sqrtn" (see
            `AllToAllDenseEmbedding`).
        optimizer: the sparse optimizer (default "adam"; None is refused): a
            name such as "adagrad", a `keras_sparse.optimizers` instance or a
            Keras SGD/Adagrad/Adam/Ftrl instance. The rows live outside the
            model's optimizer because their meaning changes when keys are
            evicted.
        embeddings_initializer: initializer of fresh rows. A key's first
            vector is a function of (``table_seed``, key) only, for
            RandomUniform, RandomNormal, TruncatedNormal and VarianceScaling
            (Glorot, He, Lecun; with the fans of the full ``[capacity,
            output_dim]`` table): the same whichever step, position, route,
            device count or backend admits it (see
            `keras_sparse.layers.hash.keyed_fresh_rows`). Other seeded
            initializers are drawn once per training step with the layer's
            seed generator and assigned in batch order
            (`keras_sparse.layers.hash.fresh_rows`).
        embeddings_regularizer: applied to the rows looked up in a batch.
        eviction: "lru", "lfu" or None.
        admit_after: int >= 1; sightings before a key gets a row.
        key_dtype: "int64" (default) or "int32"; the declared key dtype.
            int32 and int64 arrays are both accepted and widened to int64
            for the table. On JAX without x64, "int32" promises keys within
            the int32 range (batches fed to fit/evaluate/predict are checked)
            so the compiled step sees them whole and inference needs no
            host callback.
            Strings are always accepted and hashed with
            `keras_sparse.table.hash_strings` (FNV-1a-64 of the UTF-8 bytes),
            so the string "a" and the int key ``hash_strings(["a"])[0]``
            share a row.
        sharding: placement under `keras_sparse.sharding.distribution`
            (JAX): "auto" (planner's choice), "key" (every device owns the
            keys ``keras_sparse.table.owner_of`` gives it: its own hash
            table shard, ``capacity / devices`` rows and slots, admission
            and per-shard LRU/LFU eviction; keys travel to their owners
            inside the step; fresh rows are drawn per key, so training on
            any device or process count matches one device key by key), or
            "data" (replicated), "row", "column" (element-wise optimizers
            only): these keep one host key->row map per process that maps
            the whole batch each step, so they need a single process. On
            PyTorch, "key" and "auto" key-shard the layer across the
            torch.distributed processes when several run (build it after
            ``init_process_group``; train it under DistributedDataParallel),
            see `keras_sparse.sharding.torch_key_placement`. On
            TensorFlow under a MirroredStrategy of several replicas "key"
            and "auto" key-shard over the replicas the same way (see
            `keras_sparse.sharding.tf_key_placement`); the others are
            refused at the first training step.
        table_device: "cpu" (default), "gpu" or "auto": where the hash
            table's key->row map lives (see `HashTable`). With the model on
            a GPU, "gpu" keeps keys and rows on the device inside compiled
            JAX steps; "cpu" fed through `keras_sparse.data.prefetch` was
            the faster setup for many small fields (BENCHMARKS.md).
        table_seed: salt of the table's hash functions.
        table_dtype: the table's storage dtype, "float32", "bfloat16" or
            "float16" (None: the layer's variable dtype); lookups and the
            optimizer's math stay in float32 (see
            `keras_sparse.layers.table_storage`).
        stochastic_rounding: whether rows written into 16-bit tables and
            slots round stochastically (default) or to nearest.
        slot_dtype: the optimizer slots' storage dtype, as ``table_dtype``
            (None: float32 under the default policy).
        ttl_steps: None (keys never expire) or an int >= 1: the training
            steps a key may go unseen before it expires (inference does
            not refresh it). Not with ``store=``.
        track_changes: keep each key's step of last change and the keys
            removed (evicted, expired, erased) with their step, so that
            ``export(since_step=s)`` returns a delta (see
            `keras_sparse.layers.hash.deltas`). Costs 8 bytes a row; a GPU
            table then maps through its general path.

    Call arguments:
        inputs: int32/int64 keys of any shape, NumPy string arrays, TF string
            tensors (in graphs too), or (TensorFlow) integer tf.RaggedTensor /
            tf.SparseTensor. Float keys raise TypeError. On JAX without
            ``jax_enable_x64`` the device sees int64 batches as int32, but
            ``fit`` / ``evaluate`` / ``predict`` (and ``*_on_batch``) of a
            functional model hand the full 64-bit keys of the inputs feeding
            this layer to its host mapping (see
            `keras_sparse.layers.jax_full_keys`; JAX's truncation warning
            is then harmless for these inputs). Subclassed models get a clear
            error for keys beyond the int32 range: use
            ``keras_sparse.data.prefetch(..., feature_map=...)`` or x64.
            Strings through ``fit`` on JAX/PyTorch: hash them first with
            ``hash_strings``.
        weights: optional per-key weights of the keys' shape; weight 0 marks
            padding (never inserted, never trained).
        training: see above.

    Saving: the ``.keras`` file stores (key, row, vector, optimizer slots,
    score) records rather than the raw table, the table's capacity, bucket
    size, seed and LRU clock, ``sparse_iterations``, the fresh-row seed and
    the keys not yet admitted with their exact sighting counts (so a key
    half-way to admission stays half-way, on any capacity or device count).
    Loaded into a table of the same capacity and seed, every key
    returns to its row with its exact state; into another table, keys are
    placed hottest first and any that find no row are dropped with a warning
    saying how many and why. A file missing an entry the layer needs raises
    a ValueError before anything changes. The hit/miss counters are not
    saved. ``layer.export()`` / ``layer.import_(keys, values, ...)`` do the
    same for serving and warm starts; ``layer.stats()`` returns the table's
    counters.

    Example:

    >>> import numpy as np, keras_sparse as ks
    >>> from keras_sparse.layers.hash.embedding import DistributedHashEmbedding
    >>> layer = DistributedHashEmbedding(4, capacity=128, combiner="sum",
    ...                                  optimizer="adagrad")
    >>> out = layer(np.array([[10**12, 7], [7, -3]]), training=True)
    >>> tuple(out.shape), layer.stats()["size"]
    ((2, 4), 3)
    >>> tuple(layer(np.array([["user_1", "user_2"]])).shape)
    (1, 4)
    """

    def __init__(
        self,
        output_dim=None,
        *,
        capacity=None,
        combiner=None,
        optimizer="adam",
        embeddings_initializer="uniform",
        embeddings_regularizer=None,
        eviction="lru",
        admit_after=1,
        key_dtype="int64",
        sharding="auto",
        table_device="cpu",
        table_seed=0,
        store=None,
        table_dtype=None,
        stochastic_rounding=True,
        slot_dtype=None,
        ttl_steps=None,
        track_changes=False,
        **kwargs,
    ):
        name = kwargs.get("name") or "distributed_hash_embedding"
        cls_name = type(self).__name__
        check_known(name, cls_name, kwargs, _OWN_ARGUMENTS)
        check_given(
            name, cls_name, "output_dim", output_dim, "the embedding width", kwargs
        )
        check_given(
            name, cls_name, "capacity", capacity, "rows of the hash table", kwargs
        )
        for arg, value in (("output_dim", output_dim), ("capacity", capacity)):
            check_positive_int(f"Layer '{name}'", arg, value)
        if (
            not isinstance(admit_after, (int, np.integer))
            or isinstance(admit_after, bool)
            or admit_after < 1
        ):
            raise ValueError(
                f"Layer '{name}': `admit_after` must be an integer >= 1 (the "
                f"number of sightings before a key gets a row). Received: "
                f"admit_after={admit_after!r}."
            )
        if optimizer is None:
            raise ValueError(
                f"Layer '{name}': DistributedHashEmbedding needs a sparse "
                "`optimizer` (e.g. 'adagrad'). Rows are re-assigned to other "
                "keys on eviction, so their values and optimizer slots must be "
                "managed by the layer, not by the model's dense optimizer. "
                "Received: optimizer=None."
            )
        if key_dtype not in ("int64", "int32"):
            raise ValueError(
                f"Layer '{name}': `key_dtype` must be 'int64' or 'int32'. "
                f"Received: key_dtype={key_dtype!r}."
            )
        check_choice(name, "eviction", eviction, ("lru", "lfu", None))
        check_choice(name, "table_device", table_device, ("cpu", "gpu", "auto"))
        if not isinstance(table_seed, (int, np.integer)) or isinstance(
            table_seed, bool
        ):
            raise ValueError(
                f"Layer '{name}': `table_seed` must be an integer (the salt of "
                f"the table's hash functions). Received: table_seed={table_seed!r}."
            )
        storage = TableStorage(name, table_dtype, stochastic_rounding, slot_dtype)
        storage.check_no_store(name, store)
        ttl_steps = checked_ttl_steps(name, ttl_steps, store)
        table = HashTable(
            int(capacity),
            eviction=eviction,
            admit_after=int(admit_after),
            device=table_device,
            seed=int(table_seed),
            ttl_steps=ttl_steps,
            track_changes=checked_flag(name, "track_changes", track_changes),
        )
        super().__init__(
            table.capacity,
            int(output_dim),
            embeddings_initializer,
            embeddings_regularizer,
            None,
            combiner=combiner,
            optimizer=optimizer,
            sharding=sharding,
            table_storage=storage,
            **kwargs,
        )
        self.table = table
        self.requested_capacity = int(capacity)
        self.eviction = eviction
        self.admit_after = int(admit_after)
        self.key_dtype = key_dtype
        self.table_device = table_device
        self.table_seed = int(table_seed)
        self.ttl_steps = ttl_steps
        # Evicted keys go down to this store (None: they are dropped).
        self.store = hash_store.store_spec(name, store)
        self.row_tier = None
        self.seed_generator = keras.random.SeedGenerator(int(table_seed) + 1)
        # Fresh rows' first vectors are a function of (fresh_seed, key): a
        # constant, so they do not depend on the step (`keyed_fresh_rows`).
        self.fresh_seed = int(table_seed) + 1
        # Raw NumPy (int64 or string) keys reach `call` unconverted, so 64-bit
        # keys survive on JAX without x64 and strings can be hashed.
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True
        # Host callbacks cannot run under XLA in TensorFlow; torch steps run
        # eagerly. JAX keeps jit (io_callback).
        self.supports_jit = keras.backend.backend() == "jax"
        # JAX without x64 truncates int64 batches; let fit/evaluate/predict
        # hand the full keys to the host mapping.
        jax_full_keys.install()
        # Compiled inference and exports read the serving map: refresh it
        # before predict/evaluate/export.
        serving_hooks.install()

    keras_sparse_kind = "hash"
    # A key-owned table per device (sharding="key") is possible here only.
    _key_shardable = True

    @property
    def capacity(self):
        return self.table.capacity

    @property
    def variables(self):
        # Without the serving map inside JAX training entry points.
        return serving_state.visible(self, super().variables)

    def build(self, input_shape=None):
        if not self.built:
            # --- keras_sparse.sharding hook: a table shard per device under
            # key sharding (before the variables get their row count).
            placement.provider().place_hash_table(self)
            if self.store is not None:
                hash_store.check_attachable(self)
        built = self.built
        super().build(input_shape)
        if not built:
            serving_map.build(self)
            if self.store is not None:
                self.row_tier = hash_store.attach(self, self.store)

    # ------------------------------------------------------------------ call
    def call(self, inputs, weights=None, training=None):
        if training and self.trainable:
            # Before the table changes: replicas (tf.distribute, torch DDP)
            # would each map their own keys, so they are refused here unless
            # the keys are sharded to owners (a `KeyMapper` placement).
            key_sharded = isinstance(self.placement, placement.KeyMapper)
            check_replicated_training(self.name, maps_keys=not key_sharded)
        # --- prepared-input fast path (keras_sparse.data.prefetch) begin
        if self.prepared_form is not None:
            if not stage_feed.fed_keys(inputs):
                return self._call_prepared(inputs, weights, training)
            # Keys while a stage holds the layer: read-only calls map them
            # as of the last trained step (`trained_rows`).
            self.refuse_keys(inputs, training)
            self.trained_steps()  # re-attaches variables a JAX fit detached
            with trained_rows.as_trained(self):
                return self._call_with_keys(inputs, weights, training)
        # --- prepared-input fast path (keras_sparse.data.prefetch) end
        return self._call_with_keys(inputs, weights, training)

    def forget_removals(self, through_step):
        """Drops the removed keys logged at or before ``through_step`` (a
        layer built with ``track_changes=True`` logs every evicted,
        expired or erased key, 16 bytes each, for deltas). Deltas since
        ``through_step`` or later stay exact; earlier ones are refused.
        Returns how many entries were dropped. `ks.callbacks.DeltaExport`
        with ``forget_removals=True`` calls it after each file."""
        return deltas.forget_removals(self, through_step)

    def get_config(self):
        config = super().get_config()
        for key in ("embeddings_constraint",):
            config.pop(key, None)
        config.update(
            {
                "capacity": self.requested_capacity,
                "eviction": self.eviction,
                "admit_after": self.admit_after,
                "key_dtype": self.key_dtype,
                "table_device": self.table_device,
                "table_seed": self.table_seed,
                "store": hash_store.store_config(self.store),
                "ttl_steps": self.ttl_steps,
                "track_changes": self.table.track_changes,
            }
        )
        return config
