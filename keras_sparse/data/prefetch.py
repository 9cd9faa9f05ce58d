"""Asynchronous prefetching input stage for models with keras_sparse layers.

``stage = keras_sparse.data.prefetch(source, model, threads=2, capacity=4)``
returns a `keras.utils.PyDataset` that ``model.fit`` / ``evaluate`` /
``predict`` accept on every backend. Worker threads do each
`DistributedHashEmbedding`'s input-side work ahead of the step: the hash
table's ``lookup_or_insert`` (key -> row, admission, eviction), plus the
optional locality routing of samples to data-parallel replicas. The step then
receives *prepared* inputs and runs without the per-step host callback
(``io_callback`` on JAX, ``tf.numpy_function`` on TensorFlow, eager host
work on PyTorch).

Prepared-input encoding (int32, the keys' shape):

- ``row`` (``>= 0``): the key is in the table at ``row``;
- ``-2 - row`` (``<= -2``): the key got ``row`` freshly in this batch; the
  step re-initializes the row (vector from the initializer, optimizer slots
  reset) before reading it, exactly like the slow path's ``fresh`` flag;
- ``-1``: no row (not admitted yet, weight 0 / padding, or an unknown key in
  inference). Reads zeros and trains nothing.

With ``dedup=True`` (the default) the workers also number each batch's
distinct rows per layer (the "segments": unique rows + inverse, computed
with NumPy) and hand them over stacked with the codes along the batch axis
(`keras_sparse.layers.hash.prepared_inputs`); the step's sparse update then
takes them instead of sorting the ids itself. The numbers are those the
step's own sort would give, so results do not change. For a layer
row-sharded under the active distribution with compact exchange buffers
(``row_exchange_slack``), the workers instead bucket its ids by owning
shard (``bucket=True``, `keras_sparse.sharding.exchange_buckets`): each
id's slot in its owner's send buffer travels with the codes, the step skips
its packing, all-reduce and overflow callback, and a batch that would
overflow a buffer raises in the worker, naming the layer, before its step.

While a stage is open, its hash layers are in "prepared inputs" mode (a
per-layer counter; the model's cached train/test/predict functions are reset
so they retrace) and *only* prepared inputs may reach them; ``close()`` (or
leaving the ``with`` block, or garbage collection) restores the raw-key path
and resets the cached functions again. Use one stage per data set (e.g.
``validation_data=prefetch(val, model, training=False)``).

Ordering and exactness. Each layer's table is mutated in batch order: a
layer's table call for batch ``i`` runs only after its call for batch
``i - 1`` (a turn counter per table; layers given one shared table object
take turns in feed order), with exactly the same call as the slow
path (``layer.map_host_keys``), one call per layer per batch. The tables of
different layers are independent, so their calls run in parallel: one
thread may do layer ``f`` of batch ``i`` while another does layer ``g`` of
batch ``i`` or ``i + 1``. Everything else (conversion, encoding, routing)
runs in parallel too. Batches are handed to Keras in order
(``deterministic=True``). Embedding values are read inside the step, so a
row evicted by batch ``i + k`` and handed to another key is only
re-initialized when step ``i + k`` runs, after step ``i`` has read (and
updated) it for its previous key. Fresh rows start from the same values in
both paths: per key (the stage hands each position's key words to the step,
`keras_sparse.layers.hash.keyed_fresh_rows`) or, for initializers without a
per-key form, one seed from the layer's generator per training step, sized
by the same rule (`keras_sparse.layers.hash.fresh_rows`); a new row is flagged fresh
at its first position in the batch only (so each is reset from one drawn
vector, whatever order a backend's scatter writes duplicates in: PyTorch's
varies from run to run), and ``sparse_iterations`` advances once per step in
both, so the seed generator, every table (same calls, same order, same LRU
clock) and the variables evolve identically: training with the stage is
bit-identical to training without it, whatever the number of threads.
On a GPU, XLA's scatter-adds (the gradient sums) are not deterministic by
default, so two runs of either path differ by float rounding; with
``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` the stage is bit-identical
there too (checked on an H100).

Checkpoints. A save during the fit (``ModelCheckpoint(save_freq=N)``,
``model.save`` or ``layer.export()`` in a callback) sees each table as of
the layer's last trained step: every table call of a training stage keeps
its undo record (`keras_sparse.table.undo`) in a per-table journal, and the
layer undoes, on a copy, the calls of the batches its step counter says are
not trained yet (`keras_sparse.data.lookahead`). Its variables need no undo:
a row the look-ahead gave to a new key still holds the evicted key's vector
and slots until that key's step resets it. The step count at which each
pass begins is read when the stage is made and then advanced by the batches
each pass trained, since reading it inside a fit is unreliable (purged on
JAX, possibly advanced by a step in flight on TensorFlow).

Caveats:

- On JAX without ``jax_enable_x64``, Keras truncates int64 keys to int32
  before the slow path sees them; the stage sees the full 64-bit keys. The
  two paths agree for keys in the int32 range.
- Batches looked up but never trained (early stopping, an exception, a new
  pass) inserted keys whose rows were not re-initialized. When such a pass is
  abandoned, the stage erases the keys that got a fresh row in the batches
  the layer's ``sparse_iterations`` counter says were not trained (they are
  re-inserted, fresh, when next seen), so no key can ever read a row that
  was not reset for it. A layer with a row store (``store=``) cannot erase:
  the keys those batches evicted are not in its store yet. Its table is put
  back exactly as its last trained step left it and the batches' row moves
  are dropped (`keras_sparse.data.untrained`); its moves otherwise run in
  the steps, in order, and read-only steps read stored keys by the key
  words the stage hands them.
- GPU tables (``table_device="gpu"``) take the same call: the worker sends
  the batch's keys to the GPU, the CUDA kernels map them, and the int32 codes
  come back to the worker, all off the step's critical path (the transfer
  then moves them to the device with the rest of the batch).
- ``deterministic=False`` lets batches out in completion order only when no
  layer mutates its table (inference stages); training stages keep order.
- Subclassed models: the stage cannot see which input feeds which layer;
  pass ``feature_map={layer_name: input_key}`` (``input_key``: a dict key of
  ``x``, an int position in a tuple/list ``x``, or None for a single array
  ``x``). Functional models are walked automatically (inputs as one tensor,
  a list, a dict or nested; the data in any structure Keras accepts for
  them, `keras_sparse.layers.model_feeds`); a layer must be fed directly by a model
  input, and called once.
- One model input may feed several hash layers: the stage stacks each
  layer's codes (and segments) along the batch axis of that input and each
  layer takes its own (`keras_sparse.layers.hash.prepared_inputs.take_blocks`).
  An input that feeds a hash layer and any other layer is refused (the
  other layer would read row codes as keys).
- Shutdown: ``close()`` returns once the workers have finished their
  current unit (a table call, a conversion: milliseconds), so no table call
  runs after it. The thread reading the source may be blocked inside the
  source's ``next()``, which Python cannot interrupt: ``close()`` does not
  wait for it; it is a daemon thread (it never keeps the process alive),
  drops what ``next()`` returns, closes the source's iterator and exits.
  When the source raises, the error reaches the step and every thread of
  the pass ends.
- ``route="locality"`` permutes samples within a batch; for ``predict`` that
  would permute the outputs, so it is refused for inference stages. Fresh
  rows start per key, so the routed run equals the unrouted one up to float
  summation order (except for seeded initializers without a per-key form,
  e.g. Orthogonal, whose draws follow batch positions).
  Routing gathers each device's ids on its own shard, and those ids pass
  through the exchange block a device sends to itself: with compact row
  buffers (``row_exchange_slack``) routed batches need a slack near the
  device count, else the bucketing reports an overflow before the step.
"""

import collections
import threading
import time
import weakref

import keras
import numpy as np
from keras import tree

from keras_sparse.data import lookahead
from keras_sparse.data import routing as routing_lib
from keras_sparse.data.sources import make_source
from keras_sparse.data.transfer import batch_copier
from keras_sparse.data.untrained import undo_since
from keras_sparse.data.untrained import undo_untrained
from keras_sparse.layers.hash import table_users
from keras_sparse.layers.hash.prepared_inputs import KeyWords
from keras_sparse.layers.hash.prepared_inputs import PreparedForm
from keras_sparse.layers.hash.prepared_inputs import host_segments
from keras_sparse.layers.hash.prepared_inputs import pack_groups
from keras_sparse.layers.hash.prepared_inputs import rows_of_codes
from keras_sparse.layers.hash.prepared_inputs import segment_scratch
from keras_sparse.layers.model_feeds import array_at
from keras_sparse.layers.model_feeds import check_sole_readers
from keras_sparse.layers.model_feeds import input_groups
from keras_sparse.layers.model_feeds import plan
from keras_sparse.layers.model_feeds import replace_at
from keras_sparse.layers.model_feeds import split_batch

__all__ = ["PrefetchError", "PrefetchStage", "prefetch"]

_POLL = 0.05


class PrefetchError(RuntimeError):
    """A worker of a prefetch stage failed.

    ``original`` (and ``__cause__``, unless Keras' traceback filtering cleared
    it) is the worker's exception with its traceback; the message embeds the
    formatted worker traceback too (it survives tf.data's re-wrapping).
    """

    original = None


# ------------------------------------------------------------------- engine
class _Engine:
    """Threads, queues and the sequencer of one stage (no ref to the stage)."""

    def __init__(
        self, feeds, source, threads, capacity, insert, ordered, route, replicas
    ):
        self.feeds = feeds
        self.source = source
        self.threads = threads
        self.capacity = capacity
        self.insert = insert
        self.ordered = ordered
        self.route = route
        self.replicas = replicas
        self.cond = threading.Condition()
        self.closed = False
        self.stats = {
            "batches": 0, "routed_batches": 0, "bytes_unrouted": 0,
            "bytes_routed": 0, "prepare_s": 0.0, "table_s": 0.0,
            "route_s": 0.0, "wait_s": 0.0, "erased_keys": 0, "undone_calls": 0,
        }  # fmt: skip
        self._pass = None
        self._pass_count = 0
        self.record_buffers = []  # per lane: `lookahead.RecordBuffers`
        # Per feed: its layer's step counter when the next pass begins
        # (None: unknown, read then).
        self.base = _counters(feeds)
        self.copy_batch = None  # host -> device copy (`transfer.batch_copier`)
        # Per feed: None (codes alone) or ``(replicas, channel)``, what the
        # codes travel with (`prepared_inputs`): "segments" or the
        # `ExchangeBuckets` of a row-sharded layer. See `_feed_layout`.
        self.layouts = [None] * len(feeds)
        # Per feed: 0, or the replicas its key words are packed for.
        self.words = [0] * len(feeds)
        # Per feed: None, or ``(replicas, start, count, blocks)`` when its
        # model input feeds other hash layers too (`_shares`).
        self.shares = [None] * len(feeds)
        # Hash feeds per model input, and the replicas its blocks are packed
        # for (`_shares`).
        self.groups = []
        self.scratch = {}  # feed index -> `segment_scratch` array

    # ---------------------------------------------------------------- passes
    def start_pass(self):
        self.end_pass(complete=False)
        p = _Pass(self, self.source.passes(), self.source.num_batches)
        self._pass = p
        self._pass_count += 1
        p.start()
        return p

    def end_pass(self, complete):
        p, self._pass = self._pass, None
        if p is None:
            return
        p.stop()
        if not complete or not p.exhausted():
            trained = self._rollback(p)
        else:
            trained = [p.next] * len(self.feeds)  # every batch served was trained
        for journal in p.journals:
            journal.release()  # no save asks for this pass's records again
        # The next pass's first step count, known without reading the counter
        # inside a fit (see `_Pass`).
        self.base = [
            None if i0 is None or t is None else i0 + t
            for i0, t in zip(p.iter0, trained)
        ]
        self.source.end_pass()

    def _rollback(self, p):
        """Erases keys given fresh rows by looked-up but untrained batches
        (layers with a row store or a time to live: undoes those batches'
        table calls, see `keras_sparse.data.untrained`); returns the
        batches of the pass trained per feed (None: unknown)."""
        done = [None] * len(self.feeds)
        undone = set()  # lanes (tables) whose untrained calls are undone
        for f_idx, feed in enumerate(self.feeds):
            if feed.kind != "hash" or not self.insert:
                continue
            it = getattr(feed.layer, "sparse_iterations", None)
            if it is None:
                continue
            # Erasing too much is safe (a key only loses its row); too little
            # is not: when a counter cannot be read (JAX purges variables
            # inside a fit epoch), assume nothing of this pass was trained.
            trained = 0
            if p.iter0[f_idx] is not None:
                try:
                    trained = int(keras.ops.convert_to_numpy(it)) - p.iter0[f_idx]
                    done[f_idx] = min(max(trained, 0), p.next)
                except Exception:  # noqa: BLE001
                    trained = 0
            if getattr(feed.layer, "row_tier", None) is not None:
                # Erasing would lose the keys those calls evicted: undo them.
                journal = p.journals[p.lane[f_idx]]
                self.stats["undone_calls"] += undo_untrained(feed.layer, journal)
                continue
            if feed.layer.table.ttl_steps is not None and done[f_idx] is not None:
                # Erasing would leave the clock advanced (later keys expire
                # early) and the keys those calls expired gone: undo them.
                lane = p.lane[f_idx]
                if lane in undone:
                    continue
                count = undo_since(feed.layer, p.journals[lane], done[f_idx])
                if count is not None:
                    undone.add(lane)
                    self.stats["undone_calls"] += count
                    continue
            keys = [
                fresh[f_idx]
                for seq, fresh in p.pending.items()
                if seq >= trained and fresh.get(f_idx) is not None
            ]
            if keys:
                keys = np.unique(np.concatenate(keys))
                self.stats["erased_keys"] += int(feed.layer.table.erase(keys))
        p.pending.clear()
        return done

    def shutdown(self):
        if self.closed:
            return
        self.closed = True
        try:
            self.end_pass(complete=False)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # ----------------------------------------------------------- preparation
    def prepare_parallel(self, batch):
        x, y, sw = split_batch(batch)
        jobs = []
        for feed in self.feeds:
            keys = np.asarray(_feed_array(x, feed.keys, feed))
            w = None
            if feed.weights is not None:
                w = np.asarray(_feed_array(x, feed.weights, feed))
            jobs.append((keys, w))
        return (x, y, sw), jobs

    def table_call(self, f_idx, job, journal=None):
        """Layer ``f_idx``'s table call for one batch (caller holds its turn).

        ``journal``: the `lookahead.Journal` of the layer's table, given the
        call's undo record when it inserts.

        Returns ``(codes, fresh_keys, segments)``: the prepared int32 codes
        (the keys' shape), the keys that got a fresh row (None when there are
        none), which a rollback erases if the batch is never trained, and the
        codes' segments (`host_segments`; None without dedup).
        """
        keys, w = job
        feed = self.feeds[f_idx]
        layer = feed.layer
        k = keys
        if layer.combiner is not None and k.ndim == 1:
            k = k[:, None]
            w = None if w is None else w[:, None]
        use = None if w is None else (w != 0).reshape(-1)  # None: every position
        insert = self.insert and layer.trainable
        undo = journal if insert else None
        mapped = layer.map_host_keys(k, use, insert, undo=undo)
        rows, fresh = mapped.rows, mapped.fresh
        codes = rows.astype(np.int32)  # a copy: rows are kept for the segments
        np.subtract(-2, codes, out=codes, where=fresh)  # fresh rows: -2 - row
        fresh_keys = None
        if insert and fresh.any():
            from keras_sparse.layers.hash.host_keys import host_keys as _host_keys

            # Converted elementwise: the fresh positions' keys alone.
            fresh_keys = _host_keys(k.reshape(-1)[fresh])
        codes = codes.reshape(keys.shape)
        segments = None
        layout = self.layouts[f_idx]
        if layout is not None and layout[1] == "segments":
            # The caller holds this layer's turn: its scratch is ours alone.
            if f_idx not in self.scratch:
                self.scratch[f_idx] = segment_scratch(layer.num_rows)
            segments = host_segments(codes, self.scratch[f_idx], rows=rows)
        return codes, fresh_keys, segments

    def finish(self, parts, codes, segments):
        """The batch handed to Keras: each hash layer's input replaced by its
        codes (with what they travel with), routed, copied to the device."""
        (x, y, sw), jobs = parts
        # Layers drawing fresh rows per key: their keys' words, written into
        # the packed array by `pack_groups`.
        words = [[KeyWords(j[0])] if w else [] for j, w in zip(jobs, self.words)]
        if self.route == "locality":
            t0 = time.perf_counter()
            perm = self._route(jobs, codes)
            self._add("route_s", time.perf_counter() - t0)
            if perm is not None:
                x, y, sw, codes, segments = _permuted(perm, x, y, sw, codes, segments)
                words = [[KeyWords(a.keys[perm]) for a in w] for w in words]
        packs = []  # (path, blocks, replicas) of the inputs packed below
        for group, replicas in self.groups:
            blocks = [
                b for f in group for b in self._blocks(f, codes, segments) + words[f]
            ]
            path = self.feeds[group[0]].keys.find(x)
            if len(blocks) == 1:
                x = replace_at(x, path, blocks[0])
            else:
                packs.append((path, blocks, replicas))
        if packs:
            packed = pack_groups([(blocks, r) for _, blocks, r in packs])
            for (path, _, _), array in zip(packs, packed):
                x = replace_at(x, path, array)
        if self.copy_batch is not None:
            x, y, sw = self.copy_batch((x, y, sw))
        return x, y, sw

    def _blocks(self, f_idx, codes, segments):
        """Feed ``f_idx``'s arrays: its codes, then what they travel with."""
        c = codes[f_idx]
        layout = self.layouts[f_idx]
        if layout is None:
            return [c]
        channel = layout[1]
        if channel == "segments":
            return [c, segments[f_idx]]
        # After routing: a slot depends on which device holds the id.
        name = f"prefetch: layer '{self.feeds[f_idx].layer.name}'"
        return [c, channel.slots(rows_of_codes(c), name)]

    def _route(self, jobs, codes):
        owners, cost = [], []
        r = self.replicas
        for feed, (keys, w), c in zip(self.feeds, jobs, codes):
            layer = feed.layer
            rows = keys if c is None else rows_of_codes(c)
            rows = np.asarray(rows).astype(np.int64)
            ok = (rows >= 0) & (rows < layer.num_rows)
            if w is not None:
                ok &= np.asarray(w).reshape(rows.shape) != 0
            rps = routing_lib.rows_per_shard(layer.num_rows, r)
            owners.append(np.where(ok, rows // rps, -1))
            cost.append(routing_lib.remote_id_bytes(layer.output_dim))
        if not owners:
            return None
        perm = routing_lib.locality_assignment(owners, r, cost)
        before = routing_lib.exchanged_bytes(owners, r, cost)
        after = routing_lib.exchanged_bytes(owners, r, cost, perm)
        with self.cond:
            self.stats["routed_batches"] += 1
            self.stats["bytes_unrouted"] += before
            self.stats["bytes_routed"] += after
        return perm

    def _add(self, name, value):
        with self.cond:
            self.stats[name] += value


def _counters(feeds):
    """Each feed's layer step counter (None where it cannot be read)."""
    out = []
    for feed in feeds:
        it = getattr(feed.layer, "sparse_iterations", None)
        try:
            out.append(int(keras.ops.convert_to_numpy(it)))
        except Exception:  # noqa: BLE001 - absent, or purged by a JAX fit
            out.append(None)
    return out


def _feed_array(x, place, feed):
    """The array of ``x`` at a feed's `ModelInput`; errors name the layer."""
    try:
        return array_at(x, place.find(x))
    except ValueError as e:
        raise ValueError(f"prefetch: layer '{feed.layer.name}': {e}") from None


def _permuted(perm, x, y, sw, codes, segments):
    """The batch's samples (and codes, segments) in the order ``perm``."""

    def take(a):
        a = np.asarray(a) if a is not None else a
        if a is None or a.ndim == 0 or a.shape[0] != perm.shape[0]:
            return a
        return a[perm]

    x = tree.map_structure(take, x)
    y = tree.map_structure(take, y) if y is not None else None
    sw = tree.map_structure(take, sw) if sw is not None else None
    codes = [None if c is None else take(c) for c in codes]
    segments = [None if g is None else take(g) for g in segments]
    return x, y, sw, codes, segments


def _close_quietly(iterator):
    """Closes a stopped pass's iterator (a generator runs its ``finally``)."""
    close = getattr(iterator, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 - the pass is over either way
            pass


def _lanes(feeds):
    """(lane of each feed, its position in the lane, size of each lane).

    A lane is one hash table: layers normally own their table, but layers
    given the same table object must share its call order.
    """
    lane, pos, size, ids = [], [], [], {}
    for feed in feeds:
        table = getattr(feed.layer, "table", None) if feed.kind == "hash" else None
        key = id(table) if table is not None else ("feed", len(lane))
        if key not in ids:
            ids[key] = len(size)
            size.append(0)
        lane.append(ids[key])
        pos.append(size[ids[key]])
        size[ids[key]] += 1
    return lane, pos, size


class _Batch:
    """Work state of one batch inside a pass (guarded by the pass's lock)."""

    def __init__(self, seq, parts, err, todo):
        self.seq = seq
        self.parts = parts  # ((x, y, sw), jobs) from prepare_parallel
        self.err = err
        self.todo = todo  # hash feed indices whose table call has not started
        self.running = 0  # table calls in progress
        self.codes = None if parts is None else [None] * len(parts[1])
        self.segments = None if parts is None else [None] * len(parts[1])
        self.finishing = False


class _Pass:
    """One pass over the source: a feeder thread, workers, a reorder buffer.

    Work is split into units that any worker may run: ``prep`` (convert one
    batch's inputs), ``table`` (one layer's table call for one batch) and
    ``finish`` (encode and route a batch whose table calls are done). Each
    layer has its own turn counter, so the table calls of a layer run in
    batch order while different layers (independent tables) of the same or
    of consecutive batches run on different threads at once.
    """

    def __init__(self, engine, iterator, num_batches):
        self.e = engine
        self.iterator = iterator
        self.num_batches = num_batches
        self.cond = engine.cond
        self.stop_flag = False
        self.inq = collections.deque()  # (seq, batch) read, not yet prepared
        self.fed_all = False  # the feeder has put its last batch
        self.slots = threading.Semaphore(engine.capacity)
        self.results = {}
        self.batches = {}  # seq -> _Batch, prepared and not yet finished
        # Layers sharing one table form one lane; a lane's calls run in
        # (batch, feed) order: ticket = batch * lane size + position.
        self.lane, self.lane_pos, self.lane_size = _lanes(engine.feeds)
        self.turn = [0] * len(self.lane_size)  # per lane: next ticket to run
        # Per lane (table): undo records of its calls, for saves that must
        # show it as of the last trained step (`lookahead`).
        # The arrays of their records are recycled across passes.
        while len(engine.record_buffers) < len(self.lane_size):
            engine.record_buffers.append(lookahead.RecordBuffers())
        self.journals = [lookahead.Journal(b) for b in engine.record_buffers]
        self.unit_s = [0.0] * len(engine.feeds)  # per layer: running mean time
        self.next = 0  # next sequence number handed out
        self.total = None  # batches in this pass, once known
        self.failed_seq = float("inf")  # first failed batch
        self.pending = {}  # seq -> {feed index: fresh keys}
        # Each layer's step count when this pass's first batch trains: the
        # engine's count (read when the stage was made, then advanced by the
        # batches each pass trained), else read now. A pass starts inside a
        # fit, where a read is not reliable: JAX has purged the variables
        # (unreadable: rollback erases all), and a TensorFlow step in flight
        # may already have advanced the counter it reads.
        now = None
        self.iter0 = list(engine.base)
        for i, base in enumerate(self.iter0):
            if base is None:
                now = now or _counters(engine.feeds)
                self.iter0[i] = now[i]
        self.workers = []

    def start(self):
        feeder = threading.Thread(
            target=self._feed, name="ks-prefetch-feeder", daemon=True
        )
        self.workers = [feeder] + [
            threading.Thread(target=self._work, name=f"ks-prefetch-{i}", daemon=True)
            for i in range(self.e.threads)
        ]
        for t in self.workers:
            t.start()

    def exhausted(self):
        total = self.total if self.total is not None else self.num_batches
        return total is not None and self.next >= total

    def stop(self):
        """Stops the pass's threads; returns once no worker runs a unit.

        The feeder may be blocked inside the source's ``next()``, which
        Python cannot interrupt: it is a daemon thread and is not waited
        for; it drops the batch, closes the source's iterator and exits as
        soon as ``next()`` returns.
        """
        with self.cond:
            self.stop_flag = True
            self.cond.notify_all()
        for _ in range(self.e.threads + 1):
            self.slots.release()
        if not self.workers:
            return
        me = threading.current_thread()
        feeder, workers = self.workers[0], self.workers[1:]
        # Workers finish their current unit (a table call, a conversion)
        # first, so that a rollback after `stop` sees every table call. The
        # timeout only guards against a finalizer run by a thread that holds
        # the lock they wait for.
        for t in workers:
            if t is not me:
                t.join(timeout=10.0)
        if feeder is not me:
            feeder.join(timeout=2 * _POLL)
            if not feeder.is_alive():
                _close_quietly(self.iterator)

    # ---------------------------------------------------------------- feeder
    def _feed(self):
        n = 0
        it = None
        try:
            limit = self.num_batches
            it = iter(self.iterator)
            while self._keep_feeding() and (limit is None or n < limit):
                while not self.slots.acquire(timeout=_POLL):
                    if self.stop_flag:
                        return
                if self.stop_flag:
                    return
                try:
                    batch = next(it)
                except StopIteration:
                    self.slots.release()
                    break
                with self.cond:
                    if self.stop_flag:
                        return
                    self.inq.append((n, batch))
                    self.cond.notify_all()
                n += 1
        except BaseException as err:  # noqa: BLE001 - surfaced on next batch
            with self.cond:
                self.results[n] = (None, err)
                self.failed_seq = min(self.failed_seq, n)
                self.cond.notify_all()
            n += 1
        finally:
            with self.cond:
                if self.total is None:
                    self.total = n
                self.fed_all = True
                self.cond.notify_all()
            if self.stop_flag:
                _close_quietly(it if it is not None else self.iterator)

    def _keep_feeding(self):
        # Batches after a failed one are never served: stop reading, so that
        # the pass's threads end even if nobody closes the stage.
        return not self.stop_flag and self.failed_seq == float("inf")

    # ---------------------------------------------------------------- worker
    def _work(self):
        while True:
            with self.cond:
                unit = self._claim()
                while unit is None:
                    if self.stop_flag or (
                        self.fed_all and not self.inq and not self.batches
                    ):
                        return
                    self.cond.wait(_POLL)
                    unit = self._claim()
            kind = unit[0]
            if kind == "prep":
                self._run_prep(*unit[1:])
            elif kind == "table":
                self._run_table(*unit[1:])
            else:
                self._run_finish(unit[1])

    def _claim(self):
        """The next unit to run (caller holds the lock), or None.

        Preparing comes first (cheap, and it makes the next batch's table
        calls runnable); then the oldest batch with work: its finish when all
        its table calls are done, else a table call whose layer's turn has
        come, the slowest layer first so that long calls start early.
        """
        if self.stop_flag:
            return None
        if self.inq:
            return ("prep",) + self.inq.popleft()
        for seq in sorted(self.batches):
            b = self.batches[seq]
            if b.finishing:
                continue
            if not b.todo and not b.running:
                b.finishing = True
                return ("finish", b)
            ready = [
                f for f in b.todo if self.turn[self.lane[f]] == self._ticket(f, seq)
            ]
            if not ready:
                continue
            if b.err is not None or seq >= self.failed_seq:
                # No table call after a failure: pass the layers' turns on.
                for f in ready:
                    b.todo.discard(f)
                    self.turn[self.lane[f]] += 1
                self.cond.notify_all()
                return self._claim()
            f = max(ready, key=lambda i: self.unit_s[i])
            b.todo.discard(f)
            b.running += 1
            return ("table", b, f)
        return None

    def _ticket(self, f, seq):
        """The lane ticket of feed ``f``'s table call for batch ``seq``."""
        return seq * self.lane_size[self.lane[f]] + self.lane_pos[f]

    def _run_prep(self, seq, batch):
        t0 = time.perf_counter()
        parts = err = None
        try:
            parts = self.e.prepare_parallel(batch)
        except BaseException as exc:  # noqa: BLE001
            err = exc
        todo = set()
        if parts is not None:
            todo = {i for i, f in enumerate(self.e.feeds) if f.kind == "hash"}
        with self.cond:
            if err is not None:
                self.failed_seq = min(self.failed_seq, seq)
                # Its layers' turns still pass through it (without calls).
                todo = {i for i, f in enumerate(self.e.feeds) if f.kind == "hash"}
            self.batches[seq] = _Batch(seq, parts, err, todo)
            self.e.stats["prepare_s"] += time.perf_counter() - t0
            self.cond.notify_all()

    def _run_table(self, b, f):
        t0 = time.perf_counter()
        codes = fresh = segments = err = None
        journal = self.journals[self.lane[f]]
        journal.seq = b.seq  # this worker holds the lane's turn
        try:
            codes, fresh, segments = self.e.table_call(f, b.parts[1][f], journal)
        except BaseException as exc:  # noqa: BLE001
            err = exc
        dt = time.perf_counter() - t0
        with self.cond:
            b.codes[f] = codes
            b.segments[f] = segments
            if fresh is not None:
                self.pending.setdefault(b.seq, {})[f] = fresh
            if err is not None and b.err is None:
                b.err = err
                self.failed_seq = min(self.failed_seq, b.seq)
            b.running -= 1
            self.turn[self.lane[f]] += 1
            u = self.unit_s[f]
            self.unit_s[f] = dt if not u else 0.8 * u + 0.2 * dt
            self.e.stats["table_s"] += dt
            self.e.stats["prepare_s"] += dt
            self.cond.notify_all()

    def _run_finish(self, b):
        t0 = time.perf_counter()
        out, err = None, b.err
        if err is None and b.seq > self.failed_seq:
            err = RuntimeError("an earlier batch failed")
        if err is None:
            try:
                out = self.e.finish(b.parts, b.codes, b.segments)
            except BaseException as exc:  # noqa: BLE001
                err = exc
        with self.cond:
            del self.batches[b.seq]
            self.results[b.seq] = (out, err)
            self.e.stats["prepare_s"] += time.perf_counter() - t0
            self.cond.notify_all()

    # -------------------------------------------------------------- consumer
    def get(self, index):
        """The prepared batch ``index`` (must be ``self.next``)."""
        t0 = time.perf_counter()
        with self.cond:
            while True:
                if self.e.ordered:
                    key = index if index in self.results else None
                else:
                    key = min(self.results) if self.results else None
                if key is not None:
                    break
                if self.total is not None and index >= self.total:
                    raise IndexError(
                        f"prefetch: batch {index} requested; the source "
                        f"yielded {self.total} batches"
                    )
                if self.stop_flag or self.e.closed:
                    raise RuntimeError("prefetch: the stage is closed")
                if not any(t.is_alive() for t in self.workers):
                    raise RuntimeError("prefetch: the worker threads died")
                self.cond.wait(_POLL)
            out, err = self.results.pop(key)
            self.next += 1
            self.e.stats["wait_s"] += time.perf_counter() - t0
            self.e.stats["batches"] += 1
        self.slots.release()
        if err is not None:
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise err
            import traceback

            trace = "".join(traceback.format_exception(err)).rstrip()
            error = PrefetchError(
                f"prefetch: preparing batch {key} failed in a worker thread: "
                f"{type(err).__name__}: {err}\n\nWorker traceback:\n{trace}"
            )
            # Keras' traceback filtering re-raises `from None`, which drops
            # `__cause__`; `.original` keeps the worker's exception.
            error.original = err
            # Held in this frame's locals, the error (whose traceback holds
            # this frame) would form a cycle that keeps the failing ``fit``'s
            # frames, Keras' callback thread pool among them, until the
            # garbage collector runs.
            try:
                raise error from err
            finally:
                del error, err
        # Trim the bookkeeping of batches surely dispatched long ago.
        for old in [s for s in self.pending if s < key - 64]:
            del self.pending[old]
        for journal in self.journals:
            journal.trim(key - lookahead.KEEP_SERVED)
        return out

    def untrained_calls(self, layer, done):
        """Undo records of the calls ``layer``'s table got in this pass for
        batches not trained yet, ``done`` being the layer's step counter."""
        f_idx = next((i for i, f in enumerate(self.e.feeds) if f.layer is layer), None)
        if f_idx is None or not self.e.insert:
            return []
        if self.iter0[f_idx] is None:
            raise RuntimeError(
                f"Layer '{layer.name}': cannot save the hash table as of its "
                "last trained step: its step counter could not be read when "
                "the prefetch stage's pass began, so the batches it mapped "
                "ahead cannot be told from the trained ones. Nothing was saved."
            )
        first = done - self.iter0[f_idx]
        return self.journals[self.lane[f_idx]].since(first, layer.name)


# -------------------------------------------------------------------- stage
class PrefetchStage(keras.utils.PyDataset):
    """The object `prefetch` returns: a `keras.utils.PyDataset`.

    ``len(stage)`` is the number of batches per pass when known (else
    ``num_batches`` is None and ``fit`` needs ``steps_per_epoch``). Use it as
    a context manager, or call ``close()``; it also closes on garbage
    collection and after ``passes`` complete passes when ``passes`` is set.
    """

    def __init__(self, engine, model, hash_layers, passes):
        super().__init__(workers=1, use_multiprocessing=False)
        self._engine = engine
        self._model = model
        self._layers = hash_layers
        self._passes_left = passes
        self._peeked = []
        self._served = []
        self._in_epoch = False
        self._active = False
        self._activate()
        self._finalizer = weakref.finalize(
            self, _finalize, engine, list(hash_layers), weakref.ref(model)
        )

    # ------------------------------------------------------------ lifecycle
    def _activate(self):
        engine = self._engine
        layouts = {
            id(f.layer): (layout, share, words)
            for f, layout, share, words in zip(
                engine.feeds, engine.layouts, engine.shares, engine.words
            )
        }
        forms = {id(layer): PreparedForm(*layouts[id(layer)]) for layer in self._layers}
        for layer in self._layers:  # refuse before holding any layer
            if layer.prepared_form not in (None, forms[id(layer)]):
                layer.hold_for_stage(forms[id(layer)])  # raises, naming the layer
        flipped = False
        for layer in self._layers:
            flipped |= layer.hold_for_stage(forms[id(layer)])
        if engine.insert:
            lookahead.install(engine, self._layers, self._model)
        self._active = True
        if flipped:
            _reset_model_functions(self._model)

    def close(self):
        """Stops the workers and restores the layers' raw-key path."""
        if self._finalizer.alive:
            self._finalizer()
        self._active = False
        self._peeked.clear()

    @property
    def closed(self):
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ------------------------------------------------------------ PyDataset
    @property
    def num_batches(self):
        return self._engine.source.num_batches

    def __len__(self):
        n = self.num_batches
        if n is None:
            raise TypeError("prefetch: the number of batches is unknown")
        return n

    def __getitem__(self, index):
        """The next prepared batch of the pass; ``index`` is not used.

        The stage serves its source's order (Keras' ``shuffle`` does not
        apply; shuffle in the source). Requests made outside an epoch (the
        TensorFlow adapter peeks at 2 batches to infer the tensor specs) read
        ahead: those batches are served again, first, once the epoch begins.
        """
        if self.closed:
            raise RuntimeError(
                "prefetch: this stage is closed; create a new one with "
                "keras_sparse.data.prefetch(...)"
            )
        if self._in_epoch and self._peeked:
            return self._peeked.pop(0)
        engine = self._engine
        p = engine._pass
        if p is None or p.exhausted():
            if p is not None:
                engine.end_pass(complete=True)
            p = engine.start_pass()
        batch = self._format(*p.get(p.next))
        if not self._in_epoch:
            self._peeked.append(batch)
        else:
            self._served.append(batch)
        return batch

    def on_epoch_begin(self):
        self._in_epoch = True
        self._served = []

    @staticmethod
    def _format(x, y, sw):
        if y is None and sw is None:
            return (x,)
        if sw is None:
            return (x, y)
        return (x, y, sw)

    def on_epoch_end(self):
        self._in_epoch = False
        if _called_from_reset():
            # Keras' `_symbolic_build` took a batch to build the model, then
            # `EpochIterator.reset()`: that batch was not trained; serve it
            # again first so that training sees every batch once, in order.
            self._peeked[:0] = self._served
            self._served = []
            return
        self._served = []
        p = self._engine._pass
        if p is not None and p.exhausted():
            self._engine.end_pass(complete=True)
            if self._passes_left is not None:
                self._passes_left -= 1
                if self._passes_left <= 0:
                    self.close()

    @property
    def replicas(self):
        """Replicas samples are routed to (None without routing)."""
        return self._engine.replicas if self._engine.route else None

    # ---------------------------------------------------------------- stats
    def stats(self):
        """Counters: batches, table/route/prepare seconds, routed bytes."""
        with self._engine.cond:
            s = dict(self._engine.stats)
        n = max(1, s["routed_batches"])
        s["bytes_unrouted_per_step"] = s["bytes_unrouted"] / n
        s["bytes_routed_per_step"] = s["bytes_routed"] / n
        s["bytes_saved_fraction"] = (
            1.0 - s["bytes_routed"] / s["bytes_unrouted"]
            if s["bytes_unrouted"]
            else 0.0
        )
        return s


def _called_from_reset():
    """True when Keras' `EpochIterator.reset` ends the epoch (Keras 3 detail)."""
    import sys

    frame = sys._getframe(1)
    for _ in range(6):
        frame = frame.f_back
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "reset" and "epoch_iterator" in code.co_filename:
            return True
    return False


def _reset_model_functions(model):
    if model is None:
        return
    for name in ("train_function", "test_function", "predict_function"):
        if hasattr(model, name):
            setattr(model, name, None)


def _finalize(engine, layers, model_ref):
    engine.shutdown()
    lookahead.remove(engine, layers)
    flipped = False
    for layer in layers:
        flipped |= layer.release_from_stage()
    if flipped:
        _reset_model_functions(model_ref())


def _default_replicas():
    dist = keras.distribution.distribution()
    if dist is None:
        return None
    mesh = getattr(dist, "device_mesh", None)
    if mesh is None:
        return None
    axis = getattr(dist, "batch_dim_name", None)
    if axis in tuple(mesh.axis_names):
        return int(mesh.shape[list(mesh.axis_names).index(axis)])
    return int(np.prod(mesh.shape))


def _feed_layout(layer, dedup, bucket):
    """What a hash layer's codes travel with: None or ``(replicas, channel)``.

    A row-sharded layer with compact exchange buffers gets its ids' exchange
    slots (``bucket``; channel: its `ExchangeBuckets`). Other sharded layers
    get nothing: their lookups do not use segments, and full-size buffers or
    column sharding need no packing. Unsharded layers get their segments
    (``dedup``; channel "segments"), which number a batch's distinct rows
    over the whole batch the step sees; a multi-process JAX run assembles its
    global batch from per-process parts, whose numbers would be local, so it
    gets none.
    """
    if keras.backend.backend() != "jax":
        return (1, "segments") if dedup else None
    import jax

    from keras_sparse.sharding import keras_integration

    if jax.process_count() > 1:
        return None
    buckets = keras_integration.exchange_buckets(layer)
    if buckets is not None:
        return (buckets.devices, buckets) if bucket else None
    if keras_integration.route(layer) is not None or not dedup:
        return None
    return (_default_replicas() or 1, "segments")


def _shares(feeds, layouts, words=None):
    """``(groups, shares)``: how hash layers reading one model input share it.

    ``groups``: ``(feed indices, replicas)`` per model input feeding hash
    layers, ``replicas`` what its blocks are packed for. ``shares``: per
    feed, None when the layer reads its input alone, else the
    ``(replicas, start, count, blocks)`` of `take_blocks`: the layer's
    ``count`` blocks (codes, or codes and segments) from ``start`` among the
    input's ``blocks``. Every layer of a group must use one replica count.
    """
    groups, shares = [], [None] * len(feeds)
    for group in input_groups(feeds):
        counts = [
            (1 if layouts[i] is None else 2) + (2 if words and words[i] else 0)
            for i in group
        ]
        replicas = {layouts[i][0] for i in group if layouts[i] is not None}
        if len(replicas) > 1:
            names = ", ".join(f"'{feeds[i].layer.name}'" for i in group)
            raise ValueError(
                f"prefetch: layers {names} read one model input but their "
                f"prepared inputs split over different replica counts "
                f"{sorted(replicas)}; give them separate inputs."
            )
        local = replicas.pop() if replicas else 1
        groups.append((group, local))
        if len(group) == 1:
            continue
        # Each process packs its own batch; JAX joins them process-major.
        total = local * _process_count()
        start = 0
        for i, count in zip(group, counts):
            shares[i] = (total, start, count, sum(counts))
            start += count
    return groups, shares


def _has_store(layer):
    return getattr(layer, "row_tier", None) is not None


def _process_count():
    if keras.backend.backend() != "jax":
        return 1
    import jax

    return jax.process_count()


def prefetch(
    source,
    model,
    *,
    threads=2,
    capacity=4,
    route=None,
    batch_size=None,
    deterministic=True,
    training=True,
    replicas=None,
    feature_map=None,
    y=None,
    sample_weight=None,
    steps=None,
    shuffle=False,
    seed=None,
    passes=None,
    transfer="auto",
    dedup=True,
    bucket=True,
):
    """Wraps ``source`` into a prefetching input stage for ``model``.

    Args:
        source: a dict/tuple/array of NumPy arrays (with ``batch_size``; a
            ``(x, y)`` or ``(x, y, sample_weight)`` tuple, or ``x`` with the
            ``y=``/``sample_weight=`` arguments), a ``tf.data.Dataset``, a
            ``keras.utils.PyDataset``, a torch ``DataLoader``, an iterable or
            generator of batches, or a callable returning such an iterable
            (needed for several epochs from a generator).
        model: the Keras model the batches are for.
        threads: worker threads. One layer's table calls run in batch
            order; different layers' calls run on different threads at once.
        capacity: most batches read and not yet consumed (bounds memory).
        route: None or ``"locality"`` (see `keras_sparse.data.routing`).
        batch_size: batch size for in-memory arrays.
        deterministic: hand batches out in order. False is honored only
            when no table is mutated (``training=False``).
        training: True for ``fit`` (keys are inserted), False for
            ``evaluate``/``predict`` (read-only lookups).
        replicas: replicas for ``route="locality"`` (default: the batch axis
            of the active `keras.distribution`).
        feature_map: ``{layer_name: input_key}`` for subclassed models.
        y: labels, for in-memory arrays.
        sample_weight: sample weights, for in-memory arrays.
        shuffle: shuffle in-memory arrays each pass.
        seed: seed of that shuffle.
        steps: batches per pass for sources without a length.
        passes: close automatically after this many complete passes.
        transfer: copy prepared batches to the device in the workers (JAX
            without a distribution, PyTorch; see `keras_sparse.data.transfer`).
            ``"auto"``: only when the default device is an accelerator.
        dedup: also number each batch's distinct rows per layer in the
            workers (unique rows + inverse), so the step's sparse update
            skips its sort (see `keras_sparse.layers.hash.prepared_inputs`).
            Results are identical either way. Off in multi-process JAX runs.
        bucket: for a row-sharded layer with compact exchange buffers (a
            ``row_exchange_slack``), pack its ids into their owners' buffers
            in the workers (`keras_sparse.sharding.exchange_buckets`), so the
            step skips the packing and its overflow check; an overflowing
            buffer raises in the worker, before the step. Results are
            identical either way.

    Returns:
        A `PrefetchStage` (a `keras.utils.PyDataset`); call ``stats()`` for
        its counters and ``close()`` (or use ``with``) when done.

    Example:

    >>> import numpy as np, keras, keras_sparse as ks
    >>> from keras_sparse.layers import DistributedHashEmbedding
    >>> keys = keras.Input((2,), dtype="int32", name="keys")
    >>> emb = DistributedHashEmbedding(4, capacity=64, combiner="sum",
    ...                                optimizer="adagrad")(keys)
    >>> model = keras.Model(keys, keras.layers.Dense(1)(emb))
    >>> model.compile("sgd", "mse")
    >>> x, y = np.arange(64).reshape(32, 2), np.ones((32, 1))
    >>> with ks.data.prefetch((x, y), model, batch_size=8) as stage:
    ...     _ = model.fit(stage, epochs=1, verbose=0)
    >>> stage.stats()["batches"]
    4
    """
    if threads < 1 or capacity < 1:
        raise ValueError("prefetch: `threads` and `capacity` must be >= 1")
    if route not in (None, "locality"):
        raise ValueError(f"prefetch: route must be None or 'locality'; got {route!r}")
    if route is not None and not training:
        raise ValueError(
            "prefetch: route='locality' permutes samples; it is for training "
            "stages only (training=True)."
        )
    if route is not None:
        replicas = replicas or _default_replicas()
        if not replicas:
            raise ValueError(
                "prefetch: route='locality' needs `replicas` (or an active "
                "keras.distribution with a batch axis)."
            )
    src = make_source(
        source, y=y, sample_weight=sample_weight, batch_size=batch_size,
        steps=steps, shuffle=shuffle, seed=seed,
    )  # fmt: skip
    feeds = plan(model, feature_map)
    if feature_map is None:
        check_sole_readers(model, feeds)
    hash_layers = [f.layer for f in feeds if f.kind == "hash"]
    for layer in hash_layers:
        if not layer.built:
            layer.build()
        if getattr(layer.table, "num_shards", None) is not None:
            raise ValueError(
                f"prefetch: layer '{layer.name}' is key-sharded (a table shard "
                "per device, mapped inside the step on its owner); a prefetch "
                "stage maps keys in one host table, so the two do not combine "
                "yet. Train it without the stage, or plan the layer with "
                "another strategy."
            )
        if _has_store(layer) and len(table_users.users(layer)) > 1:
            # Its undo records and row moves would mix with the other's.
            raise ValueError(
                f"prefetch: layer '{layer.name}' has a row store (`store=`) "
                "and shares its table with another layer; give it a table of "
                "its own, or train it without the stage."
            )
    copy_batch = batch_copier(transfer)
    insert = bool(training)
    ordered = bool(deterministic) or (insert and bool(hash_layers))
    engine = _Engine(
        feeds, src, int(threads), int(capacity), insert, ordered, route, replicas
    )
    engine.copy_batch = copy_batch
    engine.layouts = [
        _feed_layout(f.layer, dedup, bucket) if f.kind == "hash" else None
        for f in feeds
    ]
    # Layers drawing fresh rows per key get each position's key words (two
    # int32 blocks), in inference stages too: one layout per layer. So do
    # layers with a row store: read-only steps read keys without a row
    # from the store.
    engine.words = [
        (
            (layout[0] if layout else 1) * _process_count()
            if f.kind == "hash"
            and (f.layer.keys_drawn_per_key() or _has_store(f.layer))
            else 0
        )
        for f, layout in zip(feeds, engine.layouts)
    ]
    engine.groups, engine.shares = _shares(feeds, engine.layouts, engine.words)
    return PrefetchStage(engine, model, hash_layers, passes)
