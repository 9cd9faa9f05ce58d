"""DistributedHashEmbedding: an embedding for an open-ended set of int64 keys."""

import keras
import numpy as np
from keras import ops

from keras_sparse.backend_utils import is_symbolic
from keras_sparse.backend_utils import is_tf_ragged_or_sparse
from keras_sparse.layers import inputs as input_forms
from keras_sparse.layers import jax_full_keys
from keras_sparse.layers import placement
from keras_sparse.layers import row_moves
from keras_sparse.layers import row_tier
from keras_sparse.layers.arguments import check_choice
from keras_sparse.layers.arguments import check_given
from keras_sparse.layers.arguments import check_known
from keras_sparse.layers.hash import key_mapping
from keras_sparse.layers.hash import serving_hooks
from keras_sparse.layers.hash import serving_map
from keras_sparse.layers.hash import stage_feed
from keras_sparse.layers.hash import table_users
from keras_sparse.layers.hash import trained_rows
from keras_sparse.layers.hash.fresh_rows import fresh_row_values
from keras_sparse.layers.hash.host_keys import host_keys as _host_keys
from keras_sparse.layers.hash.host_keys import string_kind as _string_kind
from keras_sparse.layers.hash.host_keys import to_numpy as _to_numpy
from keras_sparse.layers.hash.keyed_fresh_rows import folded_fresh_values
from keras_sparse.layers.hash.keyed_fresh_rows import has_seed
from keras_sparse.layers.hash.keyed_fresh_rows import keyed_fresh_values
from keras_sparse.layers.hash.keyed_fresh_rows import per_key
from keras_sparse.layers.hash.prepared_inputs import split_words
from keras_sparse.layers.hash.prepared_inputs import take_blocks
from keras_sparse.layers.hash.prepared_inputs import unpack_prepared
from keras_sparse.layers.hash.records import HashRecords
from keras_sparse.layers.hash.stage_feed import StageFed
from keras_sparse.layers.hash.tf_string_hash import hash_strings_tf
from keras_sparse.layers.hash.ttl_state import checked_ttl_steps
from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase
from keras_sparse.layers.table_storage import ARGUMENTS as STORAGE_ARGUMENTS
from keras_sparse.layers.table_storage import TableStorage
from keras_sparse.ops import check_replicated_training
from keras_sparse.table import BatchTooLargeError
from keras_sparse.table import HashTable
from keras_sparse.table import TableFullError


def _first_fresh_only(rows, fresh, xp):
    """Clears ``fresh`` (in place) except at each new row's first position.

    Duplicates of a new key share its row. Flagged at every position, the
    step would scatter several drawn vectors onto that one row, and which one
    a scatter keeps is unspecified (PyTorch's CPU ``index_put_`` varies from
    run to run): training would not be reproducible.
    """
    at = xp.flatnonzero(fresh)
    if at.size < 2:
        return
    _, first = xp.unique(rows[at], return_index=True)
    if first.size < at.size:
        fresh[at] = False
        fresh[at[first]] = True


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
)


@keras.saving.register_keras_serializable(package="keras_sparse")
class DistributedHashEmbedding(StageFed, HashRecords, SparseEmbeddingBase):
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
            if (
                not isinstance(value, (int, np.integer))
                or isinstance(value, bool)
                or value <= 0
            ):
                raise ValueError(
                    f"Layer '{name}': `{arg}` must be a positive integer. "
                    f"Received: {arg}={value!r} (of type {type(value).__name__})."
                )
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
        self.store = row_tier.store_spec(name, store)
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

    def build(self, input_shape=None):
        if not self.built:
            # --- keras_sparse.sharding hook: a table shard per device under
            # key sharding (before the variables get their row count).
            placement.provider().place_hash_table(self)
        built = self.built
        super().build(input_shape)
        if not built:
            serving_map.build(self)
            if self.store is not None:
                self.row_tier = row_tier.attach(self, self.store)

    # ---------------------------------------------------------------- mapping
    def _lookup_or_insert(self, keys, undo=None):
        """``(rows, fresh)`` of flat keys (NumPy or CuPy, as the table gives);
        ``undo``: see `HashTable.lookup_or_insert_fresh`."""
        try:
            if undo is None:
                res, fresh = self.table.lookup_or_insert_fresh(keys)
            else:
                res, fresh = self.table.lookup_or_insert_fresh(keys, undo=undo)
            return res.rows, fresh
        except BatchTooLargeError as e:
            raise BatchTooLargeError(
                f"Layer '{self.name}': this batch has more distinct keys to "
                f"admit than the hash table has rows (capacity="
                f"{self.table.capacity}: the `capacity` argument, "
                f"{self.requested_capacity}, rounded to whole buckets); "
                "nothing was changed. Use a larger `capacity` or a smaller "
                f"batch. ({e})"
            ) from None
        except TableFullError as e:
            raise TableFullError(
                f"Layer '{self.name}': the hash table is full (capacity="
                f"{self.table.capacity}, size={self.table.size}) and "
                f"eviction=None; nothing was changed. Use eviction='lru'/"
                f"'lfu' or a larger capacity. ({e})"
            ) from None

    def _table_rows(self, flat, use, insert, xp, out=None, undo=None):
        """Flat int64 keys and bool ``use``, both NumPy (``xp=np``) or both
        CuPy -> ``(rows int32, fresh bool)`` of ``xp``, rows -1 where absent
        or unused, fresh at the first position of each newly assigned row;
        written into ``out`` (two arrays) when given. ``undo``: collects
        the table call's undo record (see `HashTable.lookup_or_insert_fresh`)."""
        n = flat.shape[0]
        rows, fresh = (
            out if out is not None else (xp.empty(n, xp.int32), xp.empty(n, bool))
        )
        if insert and xp is not np and undo is None:
            # GPU table: one launch writing rows and fresh, no host sync
            # (None: the general path below).
            if self.table.step_rows(flat, use, (rows, fresh)) is not None:
                return rows, fresh
        # No padding (the usual case): no mask copies and scatters. On CuPy
        # the check is one host sync, cheaper than the syncs of mask indexing.
        if use is None or bool(use.all()):
            use = slice(None)
        else:
            rows[...] = -1
            fresh[...] = False
        as_xp = _to_numpy if xp is np else xp.asarray
        selected = flat[use]
        if insert:
            tier = self.row_tier
            if tier is not None and getattr(self.table, "num_shards", None):
                raise ValueError(
                    f"Layer '{self.name}': a key-sharded layer with a `store` "
                    "trains in compiled steps only (model.fit, or a jitted "
                    "step under its keras_sparse.sharding.distribution), where "
                    "each owner device moves its shard's rows; this eager "
                    "training call is not supported."
                )
            if tier is not None:  # the call's evictions go down to the store
                undo = row_tier.UndoCollector(undo)
            if undo is None:
                got, new = self._lookup_or_insert(selected)
            else:
                got, new = self._lookup_or_insert(selected, undo)
            rows[use] = as_xp(got)
            fresh[use] = as_xp(new)
            _first_fresh_only(rows, fresh, xp)
            if tier is not None:
                tier.record(flat, rows, fresh, undo.record)
        else:
            # Read-only calls (inference, a frozen layer) leave `stats` alone:
            # compiled inference reads the serving map, which cannot count.
            # As of the last trained step while a stage maps ahead.
            rows[use] = as_xp(trained_rows.read_rows(self, selected))
            if self.row_tier is not None:  # its store read follows (whole keys)
                self.row_tier.read_keys = flat
        return rows, fresh

    def map_host_keys(self, keys, use, insert, out=None, undo=None):
        """Host keys (any shape), use (bool; None: every position) -> flat
        NumPy (rows, fresh), through the table in call order (an input
        stage maps its batches with this; ``undo`` receives the call's undo
        record)."""
        if use is not None:
            use = np.asarray(use, dtype=bool).reshape(-1)
        return self._table_rows(_host_keys(keys), use, insert, np, out, undo)

    def _map_step_keys(self, keys, use, insert, out=None):
        """`map_host_keys` of the keys a compiled step received: the high 32
        bits JAX dropped are restored first. A third array in ``out``
        receives each key's high word (int32)."""
        if out is None or len(out) == 2:
            return self.map_host_keys(self._full_keys(keys), use, insert, out)
        flat = _host_keys(self._full_keys(keys))
        out[2][...] = (flat >> 32).astype(np.int32)
        return self.map_host_keys(flat, use, insert, out[:2])

    def _gpu_rows(self, keys, use, insert, out=None):
        """GPU table: CuPy-readable keys and use -> flat CuPy (rows, fresh),
        on the current CuPy stream; no host copy of the keys.

        Checked by ``tests/gpu`` (on a GPU, and on emulated CUDA in CI).
        int32 keys of a JAX step without x64 whose full 64-bit keys the input
        pipeline queued (`keras_sparse.layers.jax_full_keys`) are replaced by
        those keys, copied from the host (where they came from) and checked
        against the step's keys on the device.
        """
        import cupy as cp

        from keras_sparse.table.keys import to_cupy_keys

        flat, _ = to_cupy_keys(keys)  # zero-copy for CUDA tensors
        if jax_full_keys.has_queued(self):
            flat = jax_full_keys.restore(self, flat, cp)
        use = cp.asarray(use).reshape(-1).astype(bool, copy=False)
        if out is not None and len(out) == 3:  # the keys' high words too
            out[2][...] = (flat.astype(cp.int64, copy=False) >> 32).astype(cp.int32)
            out = out[:2]
        return self._table_rows(flat, use, insert, cp, out)

    def _map_on_gpu(self, keys, use, insert):
        """GPU table, eager call: keys and rows stay on the device via DLPack."""
        import cupy as cp

        use = cp.asarray(ops.convert_to_numpy(use))
        rows, fresh = self._gpu_rows(keys, use, insert)
        return _from_dlpack(rows), _from_dlpack(fresh)

    def _restore_part(self, keys, part, parts):
        """Full int64 keys of one device's slice of a step's batch (see
        `jax_full_keys.restore_part`)."""
        return jax_full_keys.restore_part(self, keys, part, parts)

    def _full_keys(self, keys):
        """Keys with the high 32 bits JAX dropped restored (see
        `keras_sparse.layers.jax_full_keys`); other keys pass through."""
        if keras.backend.backend() != "jax" or _string_kind(keys):
            return keys
        return jax_full_keys.restore(self, _host_keys(keys))

    def _map_keys(self, keys, use, insert, inference=False):
        """Flat ``(rows, fresh, words)`` for ``keys``, wherever the mapping
        runs now (see `keras_sparse.layers.hash.key_mapping`)."""
        return key_mapping.map_keys(self, keys, use, insert, inference)

    # ------------------------------------------------------------------ call
    def _normalize(self, inputs, weights):
        """(keys, weights, present); keys stay NumPy when given as NumPy."""
        if isinstance(inputs, (list, tuple)):
            try:
                inputs = np.asarray(inputs)
            except ValueError:
                raise ValueError(
                    f"Layer '{self.name}': `inputs` is a ragged Python list "
                    "(rows of different lengths). Pass a rectangular array "
                    "with `weights` 0 at the padding "
                    "(`keras_sparse.ragged_to_padded(values, row_lengths)` "
                    "makes both), or a tf.RaggedTensor on TensorFlow."
                ) from None
        if _string_kind(inputs) and not is_tf_ragged_or_sparse(inputs):
            if is_symbolic(inputs) and keras.backend.backend() == "tensorflow":
                # In the graph (no Python callback), so exports keep it.
                inputs = hash_strings_tf(inputs)
            else:
                try:
                    inputs = _host_keys(inputs).reshape(np.shape(inputs))
                except (TypeError, ValueError) as e:
                    raise type(e)(f"Layer '{self.name}': `inputs`: {e}.") from None
        if isinstance(inputs, np.ndarray):
            input_forms.check_integer_dtype(self.name, inputs)
            if weights is not None:
                weights = ops.convert_to_tensor(weights)
                if "float" not in str(weights.dtype):
                    weights = ops.cast(weights, "float32")
                if tuple(weights.shape) != inputs.shape:
                    raise ValueError(
                        f"Layer '{self.name}': `weights` must have the shape of "
                        f"the keys {inputs.shape}; received {tuple(weights.shape)}."
                    )
            return inputs, weights, None
        form = input_forms.normalize(self.name, inputs, weights)
        return form.ids, form.weights, form.present

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

    def _call_with_keys(self, inputs, weights, training):
        """`call` given keys (not a stage's codes)."""
        keys, weights, shape, use = self._call_keys(inputs, weights)
        insert = bool(training) and self.trainable
        # A frozen layer in a training step still maps through the table:
        # the serving map is refreshed for inference calls only.
        rows, fresh, extra = self._map_keys(keys, use, insert, inference=not training)
        valid = rows >= 0
        if self.row_tier is not None and not insert:
            # Read-only calls read evicted keys from the store.
            rows = ops.where(use, rows, -2)  # padding is never looked up
            extra = {"stored": row_moves.read_stored(self, keys, rows)}
        return self._vectors_out(rows, valid, fresh, weights, shape, insert, extra)

    def _call_keys(self, inputs, weights):
        """``(keys, weights, shape, use)`` of a call: keys normalized (a
        trailing axis added for a combiner), the keys' shape and the flat
        bool mask of the positions to map (not padding, weight not 0)."""
        keys, weights, present = self._normalize(inputs, weights)
        if self.combiner is not None and len(keys.shape) == 1:
            keys = (
                keys[:, None]
                if isinstance(keys, np.ndarray)
                else ops.expand_dims(keys, -1)
            )
            weights = None if weights is None else ops.expand_dims(weights, -1)
            present = None if present is None else ops.expand_dims(present, -1)
        shape = tuple(keys.shape)
        if None in shape:  # TF graphs with an unknown batch size
            shape = tuple(ops.shape(keys))
        use = ops.ones(shape, "bool")
        if present is not None:
            use = ops.logical_and(use, present)
        if weights is not None:
            use = ops.logical_and(use, ops.not_equal(weights, 0))
        return keys, weights, shape, ops.reshape(use, (-1,))

    # --- prepared-input fast path (keras_sparse.data.prefetch) begin
    def _call_prepared(self, codes, weights, training):
        """`call` for inputs prepared by `keras_sparse.data.prefetch`.

        Active only while a prefetch stage holds the layer in "prepared
        inputs" mode (``self.prepared_form`` not None, see `StageFed`).
        ``codes`` are int32 of the keys' shape: ``row >= 0`` for a key
        already in the table, ``-2 - row`` for a row freshly assigned by the
        stage (re-initialized in this step, exactly like the slow path's
        ``fresh`` flag) and ``-1`` for a key without a row (not admitted,
        padding, or absent in inference). The
        stage already did the table lookup in batch order, so no host callback
        runs here; the fresh-row draw and the sparse-update counter advance
        exactly as in the slow path. With a layout set by the stage
        (``prepared_form.layout = (replicas, channel)``, see
        `unpack_prepared`), ``codes`` also carry a second int32 per position:
        its segment among the batch's distinct rows (``channel ==
        "segments"``; the sparse update uses them instead of sorting) or its
        slot in its owner's row-exchange buffer (``channel`` an
        `ExchangeBuckets`; the sharded lookup skips its own packing). When
        the model input also feeds other hash layers, ``codes`` holds every
        such layer's blocks and ``prepared_form.share`` says which are this
        layer's (`take_blocks`). Layers drawing fresh rows per key also get
        two blocks of key words last (``prepared_form.words``: the replicas
        they are packed for, `split_words`).
        """
        codes = ops.cast(ops.convert_to_tensor(codes), "int32")
        if is_symbolic(codes):
            codes, extra, words = self._unpacked(codes)
        else:  # keys of another shape would fail obscurely in the unpacking
            try:
                codes, extra, words = self._unpacked(codes)
            except Exception as e:  # noqa: BLE001 - each backend's shape error
                raise self.unclear_codes(e) from None
            self.check_codes(codes, training)
        segments = exchange_slot = None
        layout = self.prepared_form.layout
        if layout is not None:
            if layout[1] == "segments":
                segments = extra
            else:
                self._check_exchange_buckets(layout[1])
                exchange_slot = extra
        if weights is not None:
            weights = ops.convert_to_tensor(weights)
            if "float" not in str(weights.dtype):
                weights = ops.cast(weights, "float32")
        if self.combiner is not None and len(codes.shape) == 1:
            codes = ops.expand_dims(codes, -1)
            weights = None if weights is None else ops.expand_dims(weights, -1)
        shape = tuple(codes.shape)
        if None in shape:
            shape = tuple(ops.shape(codes))
        flat = ops.reshape(codes, (-1,))
        fresh = ops.less_equal(flat, -2)
        rows = ops.where(fresh, -2 - flat, flat)
        valid = ops.greater_equal(rows, 0)
        insert = bool(training) and self.trainable
        prepared = {"segments": segments, "exchange_slot": exchange_slot}
        if words is not None:
            prepared["words"] = words
        if self.row_tier is not None and not insert and words is not None:
            # Read-only: keys without a row are read from the store.
            if weights is not None:  # padding is never looked up
                use = ops.reshape(ops.not_equal(weights, 0), (-1,))
                rows = ops.where(use, rows, -2)
            prepared["stored"] = row_moves.read_stored_words(self, words, rows)
        return self._vectors_out(rows, valid, fresh, weights, shape, insert, prepared)

    def _unpacked(self, codes):
        """``(codes, extra, words)`` of a prepared input: this layer's
        blocks (`take_blocks`), its key words (`split_words`) and the
        segments or exchange slots of its layout (`unpack_prepared`), None
        where absent."""
        form = self.prepared_form
        share = form.share
        if share is not None:  # the input feeds other hash layers too
            codes = take_blocks(codes, *share)
        extra = words = None
        layout = form.layout
        words_replicas = form.words
        if words_replicas:  # two blocks of key words follow the others
            blocks = (1 if layout is None else 2) + 2
            codes, words = split_words(codes, words_replicas, blocks)
        if layout is not None:
            codes, extra = unpack_prepared(codes, layout[0])
        return codes, extra, words

    def _check_exchange_buckets(self, buckets):
        now = placement.provider().exchange_buckets(self)
        if now != buckets:
            raise ValueError(
                f"Layer '{self.name}': the prefetch stage bucketed its ids for "
                f"{buckets}, but the active distribution gives {now}. Create "
                "the stage under the distribution the model runs with."
            )

    # --- prepared-input fast path (keras_sparse.data.prefetch) end

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
        if self.row_tier is not None:  # rows the store fills are not drawn
            filled = row_moves.move_rows(self, rows, fresh)
            fresh = ops.logical_and(fresh, ops.logical_not(filled))
        return self.lookup_rows(rows, valid, True, reset=(fresh, init), **prepared)

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

    def stats(self):
        """The hash table's counters, size, capacity and load factor.

        The counters count the keys of training calls (``training=True`` on
        a trainable layer: each ``fit`` / ``train_on_batch`` step, the batch
        a `keras_sparse.data.prefetch` training stage maps for its step, an
        eager call), once per call and the same on JAX, TensorFlow and
        PyTorch; padding (weight 0) is not counted:

        - ``hits`` / ``misses``: key occurrences that found / did not find
          a row, as if the step's keys arrived one at a time in batch
          order: a repeat of a key the same step gave a row is a hit. So
          without evictions the counts do not depend on how the samples
          are shuffled or batched.
        - ``inserts``: keys given a row; ``evictions``: keys that lost
          theirs to make room.
        - ``rejected_admissions``: occurrences of keys not yet seen
          ``admit_after`` times (the admitting occurrence is an insert).
        - ``overflows``: keys left without a row because both of their
          buckets were taken by keys of the same step.

        Calls that only read the table count nothing: inference
        (``evaluate``, ``predict``, ``training=False``, exports), a frozen
        layer, and the calls Keras makes to infer shapes while it builds
        or traces a model. Key-sharded, the counters are those of this
        process's shards. They are not saved.
        """
        out = self.table.stats()
        if self.row_tier is not None:
            out.update(self.row_tier.stats())
        return out

    @property
    def table(self):
        """The layer's hash table (`keras_sparse.table.HashTable` or a
        sharded table). Assigning another layer's table shares it: the two
        layers' calls then keep one order in a step."""
        return self.__dict__.get("_ks_table")

    @table.setter
    def table(self, table):
        if table is not None and table is not self.table:
            row_tier.check_not_shared(self, table)
        self.__dict__["_ks_table"] = table
        table_users.register(table, self)

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
                "store": row_tier.store_config(self.store),
                "ttl_steps": self.ttl_steps,
            }
        )
        return config


def _from_dlpack(x):
    """A CuPy array as a tensor of the active backend, on the GPU."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax.dlpack

        return jax.dlpack.from_dlpack(x)
    if backend == "torch":
        import torch

        return torch.from_dlpack(x)
    import tensorflow as tf

    return tf.experimental.dlpack.from_dlpack(x.toDlpack())
