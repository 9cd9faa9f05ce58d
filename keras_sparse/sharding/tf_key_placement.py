"""Key-sharded `DistributedHashEmbedding` under tf.distribute.MirroredStrategy
(and MultiWorkerMirroredStrategy).

With ``sharding="key"`` (or ``"auto"``) under a MirroredStrategy of ``D``
replicas the layer holds a `keras_sparse.table.ShardedHashTable` of ``D``
shards in this process: replica ``d`` owns the keys with
``owner_of(key, D) == d``, the shard's admission counts and LRU/LFU state,
and rows ``[d * B, (d + 1) * B)`` of the ``[D * B, dim]`` table and slots,
held as per-replica parts (`tf_placement.ReplicaPartVariable`, laid out as a
row-sharded table's). In each step every replica runs:

```
local keys ─► all_gather(keys, use)          (the global batch, in order)
          ─► numpy_function on shard d: one lookup_or_insert of the used keys
              it owns, in global batch order (admission, eviction, clock)
          ─► owner re-initializes its fresh rows (values drawn per key from
              the gathered keys, slots to initial) before any gather
          ─► all_gather(owned rows, fresh) ─► each replica takes its positions
          ─► the row-sharded lookup (`tf_sharded_lookup`) of the global rows
```

Each shard sees exactly the keys, in exactly the order, that a one-device
layer holding the same ``ShardedHashTable`` gives it (replica 0's positions
first): rows, admission counts, scores and evictions match it key by key.
Every shard is called in every training step (maybe with no keys), so the
shards' LRU clocks advance together.

With a row store (``store=``) each shard's table is a cache over a store
of its own (`keras_sparse.layers.row_tier_shards`): the owner's table call
records the shard's moves, and before it re-initializes its fresh rows the
owner carries them out on its part (`_move_owned`: evicted keys written
back from their rows, rows whose keys the store holds filled from it), so
a key's vector, slots and score come back when it is seen again. In one
process read-only calls read the stores on the host; across workers each
worker's stores answer for the keys its shards own (`read_stored`).

Under MultiWorkerMirroredStrategy each worker holds the shards of its own
replicas (``table.local``) and the all-gathers span the workers; saves
gather every worker's records (`gathered_records`, a collective; with
stores, the stored rows too, in memory), while `export` gives this
worker's shards' records (tables and stores); a call outside a step
gathers every worker's keys for the workers to answer from the shards they
hold (`_map_outside_steps`).

Bytes each replica receives per step, with ``T`` keys in the global batch,
``U <= T`` of them used (not padding) and ``dim`` float32 columns: the keys
and use flags (``12 T``) and batch sizes (``4 D``), the owners' answers
(``8 U``), then the row-sharded lookup's ``4 T + 4 D`` (ids) and ``4 T dim``
forward and backward. Fresh rows cost no bytes: their owner draws them from
the gathered keys. All exchanges are all-gathers (TensorFlow's all_to_all
hangs on logical CPU devices).
"""

import dataclasses

import numpy as np
import tensorflow as tf

from keras_sparse.layers.hash.key_mapper import MappedKeys
from keras_sparse.layers.hash.key_mapper import UndoCollector
from keras_sparse.layers.hash.keyed_fresh_rows import has_seed
from keras_sparse.layers.hash.keyed_fresh_rows import per_key
from keras_sparse.ops.key_hash import words_of_keys
from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState
from keras_sparse.ops.tensorflow import workers as tf_workers
from keras_sparse.ops.tensorflow.lookup import reset_rows
from keras_sparse.ops.tensorflow.row_writes import write_rows
from keras_sparse.sharding.gathered_records import merge_records
from keras_sparse.sharding.tf_placement import TfShardedPlacement
from keras_sparse.sharding.tf_sharded_lookup import replica_id
from keras_sparse.table.keys import to_host
from keras_sparse.table.sharded_table import owner_of

#: A hash layer's strategies that key-shard it under several replicas.
KEY_STRATEGIES = ("key", "auto")


def key_replicas(layer):
    """``D`` when ``layer`` (a hash layer about to be built) is key-sharded
    over the ``D > 1`` replicas of the active (MultiWorker)MirroredStrategy,
    else None."""
    active = tf_workers.several_replicas()
    if layer.sharding not in KEY_STRATEGIES or active is None:
        return None
    strategy, replicas, where = active
    head = f"Layer '{layer.name}': sharding={layer.sharding!r} under {where}"
    if not isinstance(strategy, tf_workers.STRATEGIES):
        if layer.sharding == "auto":
            return None  # trained, it is refused by `ops.tensorflow.replicas`
        raise NotImplementedError(
            f"{head}: TensorFlow key-shards hash layers under {tf_workers.NAMES} only."
        )
    tf_workers.check_built_outside_step(head)
    if layer.table.device != "cpu":
        raise ValueError(
            f"{head}: key-sharded on TensorFlow, the table shards live on the "
            f"host; use table_device='cpu' (got {layer.table_device!r})."
        )
    init = layer.embeddings_initializer
    if has_seed(init) and not per_key(init):
        raise ValueError(
            f"{head}: fresh rows are drawn per key on their owner, which "
            f"{type(init).__name__} cannot do. Use a RandomUniform, "
            "RandomNormal, TruncatedNormal or VarianceScaling (Glorot, He, "
            "Lecun) initializer, or an unseeded one (zeros, constant)."
        )
    return replicas


def key_shards(layer):
    """``(D, this process's shards, None)`` of a key-sharded hash layer
    (`key_replicas`): under MultiWorkerMirroredStrategy a worker holds the
    shards of its own replicas only."""
    replicas = key_replicas(layer)
    if replicas is None:
        return None
    return replicas, tf_workers.local_replicas(tf.distribute.get_strategy()), None


def build_placement(layer):
    """The `TfKeyPlacement` of a hash layer whose table `place_hash_table`
    made a ``ShardedHashTable`` of the replica count, else None."""
    replicas = key_replicas(layer)
    if replicas is None or getattr(layer.table, "num_shards", None) != replicas:
        return None
    # Its all-gathers and host calls need a step without XLA.
    layer.supports_jit = False
    return TfKeyPlacement(replicas, tf.distribute.get_strategy(), layer.name)


class TfKeyPlacement:
    """`TablePlacement` and `KeyMapper` of a key-sharded hash layer: its
    variables and lookups are those of a row-sharded table (``rows``, a
    `TfShardedPlacement`); `map_keys` maps keys on their owners' shards."""

    strategy = "key"
    # With a row store each owner moves its shard's rows itself (in
    # `_reset_owned`): the layer's own moves of global rows are skipped.
    moves_rows = True

    def __init__(self, devices, distribute, layer_name):
        self.devices = int(devices)
        self.layer_name = layer_name
        self.rows = TfShardedPlacement("row", devices, distribute, layer_name)

    def __repr__(self):
        return f"TfKeyPlacement(devices={self.devices})"

    def __getattr__(self, name):
        # Variables, saves and loads: those of the row-sharded layout.
        if name == "rows":
            raise AttributeError(name)
        return getattr(self.rows, name)

    # --------------------------------------------------------------- lookups
    def lookup(self, state: TableState, batch: LookupBatch):
        """The row-sharded lookup; ``batch.reset`` is ignored: `map_keys`
        had each owner re-initialize its fresh rows already."""
        return self.rows.lookup(state, dataclasses.replace(batch, reset=None))

    def gather(self, table_var, batch: LookupBatch):
        return self.rows.gather(table_var, batch)

    # ---------------------------------------------------------------- keys
    def map_keys(self, layer, keys, use, insert, draw=None):
        """`MappedKeys` ``(rows, fresh, init)`` of this replica's flat
        ``keys``/``use`` (see `keras_sparse.layers.hash.key_mapper`). ``init`` is zeros:
        the owners re-initialized the fresh rows before this returns."""
        keys = tf.cast(tf.reshape(keys, [-1]), tf.int64)
        use = tf.cast(tf.reshape(use, [-1]), tf.bool)
        context = self.rows.replica_context()
        if context is None:
            return self._map_outside_steps(layer, keys, use, insert)
        self.rows._check_step()
        me = replica_id(context)
        n = tf.shape(keys)[0]
        all_keys, all_use, sizes = context.all_gather(
            [keys, tf.cast(use, tf.int32), n[None]], axis=0
        )
        start = tf.reduce_sum(sizes[:me])
        rows, fresh, owner = tf.numpy_function(
            lambda k, u: _owner_call(layer, me, self.devices, k, u, insert),
            [all_keys, all_use],
            [tf.int32, tf.bool, tf.int32],
            stateful=True,
            name="key_sharded_owner_call",
        )
        rows.set_shape(all_keys.shape)
        fresh.set_shape(all_keys.shape)
        owner.set_shape(all_keys.shape)
        reset = tf.no_op()
        if insert:
            reset = self._reset_owned(layer, context, me, all_keys, rows, fresh)
        with tf.control_dependencies([reset]):
            mine = owner == me
            answer = tf.stack([rows, tf.cast(fresh, tf.int32)], axis=1)
            answers = context.all_gather(tf.boolean_mask(answer, mine), axis=0)
        # Owner-major, each owner's in batch order: a stable sort by owner
        # (unused positions, owner D, last) gives the same order.
        place = tf.math.invert_permutation(tf.argsort(owner, stable=True))
        missing = tf.shape(owner)[0] - tf.shape(answers)[0]
        answers = tf.concat([answers, tf.tile([[-1, 0]], [missing, 1])], 0)
        got = tf.gather(answers, place[start : start + n])
        init = tf.zeros([n, layer.output_dim], layer.embeddings.dtype)
        return MappedKeys(got[:, 0], got[:, 1] > 0, init=init)

    def _reset_owned(self, layer, context, me, all_keys, rows, fresh):
        """Re-initializes the rows this replica's shard assigned in this
        step: values drawn per key, slots to their initial values."""
        init = layer.embeddings_initializer
        dim, dtype = layer.output_dim, layer.embeddings.dtype
        if per_key(init):
            draw, seed = layer.keyed_draw()
            values = draw(fresh, words_of_keys(all_keys), seed)
        else:  # unseeded (zeros, constant): every row alike
            values = tf.broadcast_to(
                tf.cast(init((1, dim), dtype=dtype), dtype),
                [tf.shape(all_keys)[0], dim],
            )
        state = {"table": self.rows.local(layer.embeddings, context)}
        state.update({n: self.rows.local(v, context) for n, v in layer.slots.items()})
        local = tf.where(fresh, rows - me * int(state["table"].shape[0]), 0)
        if layer.row_tier is not None:  # rows the shard's store fills
            filled = _move_owned(layer.row_tier.shard(me), state, local, fresh)
            fresh = tf.logical_and(fresh, tf.logical_not(filled))
        reset_rows(state, layer.sparse_optimizer, local, fresh, values)
        return tf.group([tf.identity(state["table"][:1])])

    def _map_outside_steps(self, layer, keys, use, insert):
        """Outside a replica's step (an eager or cross-replica call): reads
        the shards on the host; training there is refused."""
        if insert:
            raise NotImplementedError(
                f"Layer '{self.layer_name}': a key-sharded layer trains only "
                "inside its strategy's steps (model.fit, or strategy.run)."
            )
        strategy = self.rows.distribute
        held = layer.table.local
        if len(held) == self.devices:
            return MappedKeys(_read_held(layer, keys, use), tf.zeros_like(use))
        # Across workers each holds its replicas' shards: every worker reads
        # every worker's keys in the shards it holds (-1 elsewhere).
        n = tf.shape(keys)[0]
        both = tf.stack([keys, tf.cast(use, tf.int64)], axis=1)
        both, start = tf_workers.concat_over_workers(strategy, both)
        found = _read_held(layer, both[:, 0], both[:, 1] > 0) + 1
        rows = tf_workers.sum_over_workers(strategy, found) - 1
        return MappedKeys(rows[start : start + n], tf.zeros_like(use))

    @property
    def read_stored(self):
        """Reads of a read-only call's stored keys across workers
        (`_read_stored`); None where this process holds every shard (the
        layer reads the stores on the host)."""
        if len(tf_workers.local_replicas(self.rows.distribute)) == self.devices:
            return None
        return self._read_stored

    def _read_stored(self, layer, keys, rows):
        """``(found, values)`` of a read-only call's keys without a row
        (``rows`` -1): each key is read from its owner's store, on the
        worker holding it, and the answers summed over the replicas (in a
        step) or workers (outside one): a key has one owner, so one answer."""
        shape = tuple(rows.shape)
        keys = tf.cast(tf.reshape(keys, [-1]), tf.int64)
        rows = tf.cast(tf.reshape(rows, [-1]), tf.int64)
        n = tf.shape(keys)[0]
        both = tf.stack([keys, rows], axis=1)
        context = self.rows.replica_context()
        if context is None:
            strategy = self.rows.distribute
            both, start = tf_workers.concat_over_workers(strategy, both)
            found, values = _read_owned_stores(layer, both, layer.table.local)
            found = tf_workers.sum_over_workers(strategy, found)
            values = tf_workers.sum_over_workers(strategy, values)
        else:
            me = replica_id(context)
            both, sizes = context.all_gather([both, n[None]], axis=0)
            start = tf.reduce_sum(sizes[:me])
            found, values = _read_owned_stores(layer, both, [me])
            found = context.all_reduce(tf.distribute.ReduceOp.SUM, found)
            values = context.all_reduce(tf.distribute.ReduceOp.SUM, values)
        found = tf.reshape(found[start : start + n] > 0, shape)
        values = tf.reshape(values[start : start + n], shape + (layer.output_dim,))
        return found, values

    def gathered_records(self, records, admission, clock):
        """Every worker's ``records`` (dict of arrays, concatenated in
        worker order), ``admission`` (``(keys, counts)`` or None, sorted by
        key) and LRU ``clock`` (the largest): under
        MultiWorkerMirroredStrategy a collective, so every worker must save
        together; one process holds every shard otherwise."""
        if len(tf_workers.local_replicas(self.rows.distribute)) == self.devices:
            return records, admission, clock
        mine = (records, admission, int(clock))
        parts = tf_workers.gather_objects(self.rows.distribute, mine)
        return merge_records(parts)


def _read_held(layer, keys, use):
    """Global rows of the used ``keys`` that this process's shards hold
    (-1 elsewhere), without counting them in the stats."""
    devices = layer.table.num_shards
    held = np.asarray(layer.table.local)

    def read(k, u):
        rows = np.full(k.shape, -1, np.int32)
        u = u.astype(bool) & np.isin(owner_of(k, devices), held)
        rows[u] = to_host(layer.table.lookup(k[u].astype(np.int64), count=False))
        return rows

    rows = tf.numpy_function(read, [keys, use], tf.int32, stateful=True)
    rows.set_shape(keys.shape)
    return rows


def _read_owned_stores(layer, both, shards):
    """``(found int32 [n], values [n, dim])`` of the ``[n, 2]`` (key, row)
    pairs whose keys ``shards`` own, read from those shards' stores (zeros
    elsewhere)."""
    devices = layer.table.num_shards
    dtype = layer.embeddings.dtype
    held = np.asarray(shards)

    def read(pairs):
        keys, rows = pairs[:, 0], pairs[:, 1]
        found = np.zeros(keys.shape[0], np.int32)
        values = np.zeros((keys.shape[0], layer.output_dim), dtype)
        at = np.flatnonzero(np.isin(owner_of(keys, devices), held))
        if at.size:
            hit, got = layer.row_tier.read_missing(keys[at], rows[at], dtype)
            found[at], values[at] = hit, got
        return found, values

    found, values = tf.numpy_function(
        read, [both], [tf.int32, dtype], stateful=True, name="key_sharded_reads"
    )
    found.set_shape(both.shape[:1])
    values.set_shape(both.shape[:1] + [layer.output_dim])
    return found, values


def _move_owned(tier, state, local, fresh):
    """The shard's row moves on its owner, before the fresh rows are
    reset: `keras_sparse.layers.row_tier.RowTier.move` of this replica's
    ``local`` rows (its shard's keys evicted by this step's call are
    written back from their rows, then rows whose keys the store holds are
    filled: values and slots). Returns the bool mask of the filled
    positions (the others are for the caller to initialize)."""
    names = list(state)
    before = [tf.gather(state[name], local) for name in names]

    def host(rows, step_fresh, *values):
        filled, fills = tier.move(rows, step_fresh, dict(zip(names, values)))
        return (filled,) + tuple(fills[name] for name in names)

    out = tf.numpy_function(
        host,
        [local, fresh] + before,
        [tf.bool] + [b.dtype for b in before],
        stateful=True,
        name="key_sharded_row_moves",
    )
    filled, fills = out[0], out[1:]
    filled.set_shape(fresh.shape)
    rows = tf.boolean_mask(local, filled)
    for name, value, like in zip(names, fills, before):
        value.set_shape(like.shape)
        write_rows(state[name], rows, tf.boolean_mask(value, filled))
    return filled


def _owner_call(layer, me, devices, keys, use, insert):
    """Host half on replica ``me``: one call of its shard with the used
    keys it owns, in global batch order. Returns ``(rows, fresh, owner)``
    over all positions: global rows and fresh flags (at the first position
    of each newly assigned row) where ``me`` owns the key, -1 / False
    elsewhere, and each position's owner (``devices`` where unused)."""
    keys = np.asarray(keys, np.int64)
    owner = np.where(np.asarray(use, bool), owner_of(keys, devices), devices)
    at = np.flatnonzero(owner == me)
    table = layer.table.shard(me)
    rows = np.full(keys.shape, -1, np.int32)
    fresh = np.zeros(keys.shape, bool)
    tier = None if layer.row_tier is None else layer.row_tier.shard(me)
    try:
        if insert:
            # With a store, the call's evicted keys go down to it.
            undo = None if tier is None else UndoCollector()
            res, new = table.lookup_or_insert_fresh(keys[at], undo=undo)
            got, new = to_host(res.rows), to_host(new).astype(bool)
            # A key at several positions is fresh at its first one only.
            new_at = np.flatnonzero(new)
            _, first = np.unique(got[new_at], return_index=True)
            fresh[at[new_at[first]]] = True
            if tier is not None:  # the moves the owner's step carries out
                tier.record(
                    MappedKeys.of_table_call(keys[at], got, fresh[at], undo.record)
                )
        else:  # a read (inference, a frozen layer): not counted in stats()
            got = to_host(table.lookup(keys[at], count=False))
    except (ValueError, RuntimeError) as e:  # TableFullError is one
        raise type(e)(
            f"Layer '{layer.name}': table shard {me} of {devices} (capacity "
            f"{table.capacity}, size {table.size}) refused this step's keys. "
            f"({e})"
        ) from None
    got = np.asarray(got, np.int64)
    rows[at] = np.where(got >= 0, got + me * layer.table.shard_rows, -1)
    return rows, fresh, owner.astype(np.int32)
