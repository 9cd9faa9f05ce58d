"""A fixed-vocabulary table larger than the device: ``cache_rows`` on it.

`AllToAllDenseEmbedding(input_dim, dim, cache_rows=C, store=...)` keeps the
whole ``[input_dim, dim]`` table (values and optimizer slots) in a dense row
store (`keras_sparse.store`: host memory or a file on disk) and only ``C``
rows in its Keras variables: a cache of the ids trained lately. An
`EmbeddingCollection` table of ``TableConfig(cache_rows=C, store=...)``
does the same; both get their `CacheRows` from
`keras_sparse.layers.row_storage.cache`.

Design: a dedicated cache for a fixed vocabulary, no hash table. Its host
map (`keras_sparse.layers.row_storage.dense_slots`) is direct: an int32
slot per id and an id per slot; CLOCK picks the victims, never a slot the
batch uses. A training step runs three parts:

- the mapping, on the host: ids -> slots, the slots given to new ids
  flagged and their victims recorded;
- the moves: each victim's row (values and optimizer slots, as the
  previous step left them) is written to the store, then the new ids'
  rows are read from the store into their slots;
- the layer's ordinary sparse lookup and update (`SparseEmbeddingBase`) on
  the ``[C, dim]`` variables, at the slots.

The host parts run compiled (`keras_sparse/kernels/cpu_cache.c` through
`keras_sparse.ops.native_cache`: a few passes over the batch and a row
copy per move), else as vectorized NumPy passes that compute the same
slots and victims; ``ks.compiled_cpu_helpers()`` says which. How they
reach the step:

- one host hop (`keras_sparse.layers.row_storage.cache_hop`) where the
  step's variables can be written in place: a compiled JAX step on one
  CPU device that calls the owner once (`CacheRows._route`
  "cpu_buffers"), whose in-place buffer callback gets the variables'
  buffers and maps the ids and moves the rows in one compiled call,
  directly between those buffers and the store's row arrays; and an
  eager PyTorch step on CPU, the same on the variables' memory. No host
  copies, no scatter, and JAX keeps its fast dispatch.
- two hops elsewhere (TensorFlow, JAX under a distribution, a layer
  called twice a step, eager JAX and TensorFlow): the mapping records a
  plan (`keras_sparse.layers.row_storage.dense_moves`) that the moves
  carry out through the in-step glue the hash layer's store uses too
  (`keras_sparse.layers.row_moves.move_rows`), on rows gathered from the
  variables and scattered back; direct calls in eager steps,
  ``tf.numpy_function``s in a TensorFlow graph, ordered ``io_callback``s
  in a JAX step.

Under a Keras distribution of one JAX process the cache is replicated: the
step's ``io_callback`` sees the whole global batch, so one id map and one
store serve every device's copy of the cache variables, which get the same
moves and the same (cross-device summed) update; batches are checked before
the step (`keras_sparse.layers.row_storage.cache_batches`), as a host error
inside it would stall the other devices. Under a TensorFlow
`MirroredStrategy` of one process each replica gathers the whole batch's
ids, the first to ask maps and moves them for all
(`keras_sparse.layers.row_storage.cache_replicas`), and each fills its own
copy of the cache. PyTorch processes under DistributedDataParallel each
hold a copy of the id map, store and cache, and each maps the whole batch
gathered in rank order (`keras_sparse.layers.row_storage.cache_processes`);
so do the JAX processes of a Keras distribution, every device's host call
handed the whole global batch inside the step
(`keras_sparse.layers.row_storage.cache_jax_processes`), and the workers
of a TensorFlow `MultiWorkerMirroredStrategy`, their replicas gathering
the batch across the workers
(`keras_sparse.layers.row_storage.cache_workers`).

A fill leaves the id's stored row in place (its write-back overwrites it).
Ids outside ``[0, input_dim)`` raise where the ids are mapped, before the
cache changes (a compiled step aborts with that error), and so does a
batch with more distinct ids than ``cache_rows``. Read-only calls
(inference) map ids without changing the cache and read the ids it does
not hold from the store (`row_moves.read_stored`). The store is
initialized from the layer's ``embeddings_initializer`` chunk by chunk
(`keras_sparse.layers.row_storage.cache_store`): each id's vector is a
function of (seed, id) only, so no chunk depends on another and no
full-size temporary exists.

The full table (store rows overridden by the cached rows,
`keras_sparse.layers.row_storage.cache_state`) is what `get_weights`,
``model.save`` and `set_weights`/``load_model`` see. ``model.save`` streams
it chunk by chunk into the file's asset files
(`keras_sparse.layers.store_assets`; memory bounded by a chunk) and
``load_model`` streams it back; `get_weights` and ``save_weights`` gather it
in host memory (the entries of a layer without a cache, so weight files
move both ways between the two). An `EmbeddingCollection` saves its cached
tables the same way, each through its cache's assets.

Training is exact: the values and slots of every id equal those of the same
layer without a cache, whatever ``cache_rows`` and the eviction order; only
speed differs.
"""

import weakref

import keras
import numpy as np
from keras import ops

from keras_sparse.backend_utils import is_symbolic
from keras_sparse.layers import inputs as input_forms
from keras_sparse.layers import row_changes
from keras_sparse.layers import row_moves
from keras_sparse.layers.hash import jax_step_mapping
from keras_sparse.layers.row_storage import ahead_maps
from keras_sparse.layers.row_storage import cache_checks
from keras_sparse.layers.row_storage import cache_hop
from keras_sparse.layers.row_storage import cache_jax_processes
from keras_sparse.layers.row_storage import cache_processes
from keras_sparse.layers.row_storage import cache_replicas
from keras_sparse.layers.row_storage import cache_store
from keras_sparse.layers.row_storage import cache_workers
from keras_sparse.layers.row_storage.cache_state import CacheState
from keras_sparse.layers.row_storage.dense_slots import DenseSlots
from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase


class CacheRows(CacheState, SparseEmbeddingBase):
    """The cache variables, id map and dense store of a table with
    ``cache_rows`` (see the module). The class name places its asset files
    in a model file (``cache_rows``), as files saved before expect."""

    # Model hooks (prefetch, sharding plans) leave it to its owner.
    keras_sparse_kind = "dense_cache"

    def __init__(
        self,
        label,
        input_dim,
        output_dim,
        cache_rows,
        spec,
        *,
        combiner,
        optimizer,
        initializer,
        dtype,
        name,
        store_name,
        owner=None,
        regularizer=None,
        constraint=None,
        track_changes=False,
    ):
        super().__init__(
            int(cache_rows),
            output_dim,
            # The cache's own rows are never read before a fill.
            "zeros",
            regularizer,
            constraint,
            combiner=combiner,
            optimizer=optimizer,
            sharding="data",
            name=name,
            dtype=dtype,
        )
        # Errors read "Layer '{owner_name}': ...".
        self.owner_name = label
        self.input_dim = int(input_dim)
        self.capacity = int(cache_rows)
        self.spec = spec
        # The store's folder name (under a `Disk` spec's path).
        self.store_name = store_name
        self.store_initializer = initializer
        self.slot_map = DenseSlots(label, input_dim, cache_rows)
        self.row_tier = None
        self.track_changes = bool(track_changes)
        # The layer calling this one (a weak reference: not a sublayer).
        self._owner = None if owner is None else weakref.ref(owner)

    def build(self, input_shape=None):
        if self.built:
            return
        self.embeddings = self._build_table()
        if self.track_changes:  # per id of the whole table, not per slot
            row_changes.add(self, self.input_dim)
        self.row_tier = cache_store.open_store(self)
        self.built = True

    # ---------------------------------------------------------------- call
    def call(self, inputs, weights=None, training=None):
        if (
            training
            and not is_symbolic(inputs)
            and cache_jax_processes.active()
            and not _in_shape_inference()
        ):  # an eager call holds arrays that no process can read whole
            raise ValueError(
                f"Layer '{self.owner_name}': `cache_rows` across JAX processes "
                "trains in compiled steps only (`model.fit`, `train_on_batch`); "
                "drop `run_eagerly=True`."
            )
        ids, weights, use = input_forms.fixed_vocabulary_ids(
            self.owner_name, inputs, weights, self.input_dim, self.combiner,
            in_range=False,
        )  # fmt: skip
        shape = tuple(ids.shape)
        if None in shape:  # TF graphs with an unknown batch size
            shape = tuple(ops.shape(ids))
        flat = ops.reshape(ids, (-1,))
        use = ops.reshape(use, (-1,))
        insert = bool(training) and self.trainable
        if insert:  # a layer built on one device, trained on several
            cache_checks.check_one_device(self.owner_name)
        one_hop = insert and self._one_hop(flat)
        replicas = cache_replicas.replica_context() if insert else None
        group = self._process_group() if insert else None
        if insert:
            if group is not None:  # torch.distributed processes under DDP
                slots, flat_all, use_all = self._map_processes(
                    group, flat, use, one_hop
                )
            elif cache_jax_processes.active():  # JAX processes, one mesh
                slots = self._map_jax_processes(flat, use)
            elif one_hop == "torch_cpu":
                slots = cache_hop.map_and_move_torch(self, flat, use)
            elif one_hop:
                slots = cache_hop.map_and_move(self, flat, use, int(flat.shape[0]))
            elif replicas is not None:  # a TensorFlow MirroredStrategy
                slots = self._map_replicated(replicas, flat, use)
            else:
                slots, fill = self._map(flat, use, insert)
                row_moves.move_rows(self, slots, fill, self._route())
            changes = row_changes.of(self)
            if changes is not None:  # the ids this step changes, not slots
                step = ops.convert_to_tensor(self.sparse_iterations) + 1
                if group is None:
                    row_changes.mark(changes, flat, use, step)
                else:  # every process's ids: each copy updates them all
                    row_changes.mark(changes, flat_all, use_all, step)
            vectors = self.lookup_rows(slots, use, training)
            valid = use
        else:
            slots, _ = self._map(flat, use, insert)
            cached = slots >= 0
            vectors = self.lookup_rows(slots, cached, training)
            # Ids the cache does not hold: read from the store (-2: unused).
            rows = ops.where(use, slots, -2)
            found, values = row_moves.read_stored(self, flat, rows)
            vectors = ops.where(ops.expand_dims(found, -1), values, vectors)
            valid = ops.logical_or(cached, found)
        vectors = ops.reshape(vectors, shape + (self.output_dim,))
        out = self.combine(vectors, weights, ops.reshape(valid, shape))
        return ops.cast(out, self.compute_dtype)

    def _one_hop(self, flat):
        """The route of a training step that maps and moves in one host hop
        (`cache_hop`): "cpu_buffers" (a compiled JAX step), "torch_cpu"
        (an eager PyTorch step on CPU), or None (two hops)."""
        backend = keras.backend.backend()
        if backend == "torch":
            if _in_shape_inference():
                return None
            route = "torch_cpu"
            return route if cache_hop.applies(self, route) else None
        if not is_symbolic(flat) or backend != "jax":
            return None
        if None in tuple(flat.shape):
            return None
        route = self._route()
        return route if cache_hop.applies(self, route) else None

    def _process_group(self):
        """The DDP process group of a PyTorch training call across
        processes, else None (`cache_processes.training_group`)."""
        if keras.backend.backend() != "torch" or _in_shape_inference():
            return None
        return cache_processes.training_group(self.owner_name)

    def _map_processes(self, group, flat, use, one_hop):
        """``(slots, ids, use)``: this process's int32 slots, its copy of
        the cache filled, after mapping and moving every process's batch
        (gathered in rank order) as every other process does
        (`cache_processes`); ``ids``/``use``: the gathered batch."""
        cache_processes.check_copies(self, group)
        ids, used, start = cache_processes.gather(group, flat, use)
        if one_hop == "torch_cpu":
            slots = cache_hop.map_and_move_torch(self, ids, used)
        else:
            slots, fill = self._map(ids, used, True)
            row_moves.move_rows(self, slots, fill, self._route())
        return slots[start : start + int(flat.shape[0])], ids, used

    def _map_jax_processes(self, flat, use):
        """The int32 slots of the global batch ``flat``, every device's copy
        of the cache filled: each process maps and moves the whole batch
        once for its devices (`cache_jax_processes`)."""
        rounds = self._rounds(cache_jax_processes.local_devices())
        # The step counter keys the rounds: every device reads it alike.
        asked = (rounds, ops.convert_to_tensor(self.sparse_iterations))
        slots, fill = self._map(flat, use, True, asked)
        row_moves.move_rows(self, slots, fill, rounds=asked)
        return slots

    def _rounds(self, callers):
        """The `cache_replicas.Rounds` of ``callers`` replicas or devices."""
        rounds = self.__dict__.get("_replica_rounds")
        if rounds is None or rounds.replicas != callers:
            rounds = cache_replicas.Rounds(self.owner_name, callers)
            self.__dict__["_replica_rounds"] = rounds
        return rounds

    def _map_replicated(self, context, flat, use):
        """This replica's int32 slots, its copy of the cache filled: the
        replicas' whole batch mapped and moved once per process
        (`cache_replicas`), each worker's copy alike (`cache_workers`)."""
        import tensorflow as tf

        local = cache_replicas.local_replicas()
        rounds = self._rounds(local)
        workers = cache_workers.spans_workers()
        words = cache_workers.fingerprint(self) if workers else None
        ids, used, start, words = cache_replicas.gather(context, flat, use, words)
        # The step counter keys the rounds: every replica reads it alike.
        step = ops.convert_to_tensor(self.sparse_iterations)
        asked = (rounds, step, cache_replicas.replica_id(context))
        check = None if words is None else (words, local)
        slots, fill = self._map(ids, used, True, asked, check)
        row_moves.move_rows(self, slots, fill, rounds=asked)
        mine = tf.slice(slots, tf.reshape(start, (1,)), tf.shape(flat)[:1])
        mine.set_shape(flat.shape)
        return mine

    def _map(self, flat, use, insert, rounds=None, check=None):
        """Flat ``(slots int32, fill bool)`` of ``flat`` ids where ``use``
        (see `DenseSlots.assign`; read-only: `DenseSlots.lookup`).
        ``rounds``: ``(Rounds, step, replica)``, the replicas' whole batch
        mapped once (TensorFlow); ``(Rounds, step)``, each JAX process's
        devices' (`cache_jax_processes.each_device` adds the device).
        ``check``: ``(words, local)``, the TensorFlow workers' fingerprints
        checked first (`cache_workers.check`)."""

        def mapped(ids, used):
            ids = np.asarray(ids).reshape(-1)
            used = np.asarray(used, bool).reshape(-1)
            if not insert:  # inference threads may read while a step maps
                with self.row_tier.lock:
                    slots = self.slot_map.lookup(ids, used)
                return slots, np.zeros(slots.shape, bool)
            with self.row_tier.lock:
                slots, fill, evicted = self.slot_map.assign(ids, used)
                self.row_tier.record(ids, fill, evicted)
            return slots, fill

        if rounds is None:
            host, extra = mapped, []
        else:

            def host(ids, used, step, replica, *words):
                def once():
                    if words:  # before the cache changes
                        cache_workers.check(self, words[0], check[1])
                    return mapped(ids, used)

                return rounds[0].run("map", replica, step, once)

            extra = list(rounds[1:]) + ([] if check is None else [check[0]])

        if not is_symbolic(flat):
            if _in_shape_inference():  # placeholder values: map nothing
                return ops.full_like(use, -1, "int32"), ops.zeros_like(use)
            out = host(ops.convert_to_numpy(flat), ops.convert_to_numpy(use))
            return tuple(ops.convert_to_tensor(x) for x in out)
        n = None if None in tuple(flat.shape) else int(flat.shape[0])
        backend = keras.backend.backend()
        if backend == "jax" and rounds is not None:
            import jax

            types = [
                jax.ShapeDtypeStruct((n,), np.int32),
                jax.ShapeDtypeStruct((n,), np.bool_),
            ]
            host = jax_step_mapping.final_on_failure(self, host)
            return cache_jax_processes.each_device(host, types, flat, use, *extra)
        if backend == "jax":

            def host_rows(ids, used, out):
                out[0][...], out[1][...] = host(ids, used)

            return jax_step_mapping.rows_in_step(
                self, self._route(), flat, use, n, host_rows, None
            )
        if backend == "tensorflow":
            import tensorflow as tf

            slots, fill = tf.numpy_function(
                host, [flat, use] + extra, [tf.int32, tf.bool], stateful=True
            )
            slots.set_shape((n,))
            fill.set_shape((n,))
            return slots, fill
        raise NotImplementedError(
            f"Layer '{self.owner_name}': compiled steps are not supported on "
            f"the {backend} backend with `cache_rows`; use jit_compile=False."
        )

    def _route(self):
        """How a compiled JAX step reaches the host: in-place buffer
        callbacks ("cpu_buffers") where the step runs on one CPU device
        and calls the owner once (the callbacks are unordered), else
        ordered ``io_callback``s (as `jax_step_mapping.choose_route`)."""
        if keras.backend.backend() != "jax":
            return "io_callback"
        import jax

        owner = None if self._owner is None else self._owner()
        if (
            not jax_step_mapping.IN_PLACE_CALLBACKS
            or jax_step_mapping.buffer_callback_or_none() is None
            or keras.distribution.distribution() is not None
            or len(getattr(owner, "_inbound_nodes", ())) > 1
            or jax.default_backend() != "cpu"
        ):
            return "io_callback"
        return "cpu_buffers"

    def full_keys(self, ids):
        # `row_moves.read_stored`'s keys: ids of a fixed vocabulary fit in
        # the step's integers as they are.
        return np.asarray(ids, np.int64)

    # ---------------------------------------------------------------- state
    def map_ahead(self, ids):
        """Maps a training batch's ids (an integer NumPy array, the layer's
        input as its step will see it) ahead of its step, after every batch
        mapped before it, so that the step only moves rows
        (`keras_sparse.layers.row_storage.ahead_maps`). For the input stage,
        which calls it in the order it hands batches to Keras. Returns
        False, doing nothing, where a step maps other ids than its own
        batch's (replicas and processes map the gathered batch) or no
        batch is mapped (not built, not trainable)."""
        if not (self.built and self.trainable) or not ahead_maps.one_mapper():
            return False
        self.slot_map.ahead.map(np.asarray(ids).reshape(-1))
        return True

    def stats(self):
        """The cache's counters (``hits``/``misses`` of the ids of training
        calls, a repeat within a call being a hit; ``evictions``), ``size``
        and ``capacity``, and its store's (``fills``, ``write_backs``,
        ``store_hits``, ``store_size``, ``store_bytes``)."""
        slot_map = self.slot_map
        out = slot_map.trained_counts()
        out["inserts"] = out["misses"]
        out.update(size=slot_map.size, capacity=slot_map.capacity)
        out.update(slot_map.ahead.counts)
        out.update(self.row_tier.stats())
        return out


def _in_shape_inference():
    """True inside Keras' ``compute_output_spec`` (placeholder values)."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()
