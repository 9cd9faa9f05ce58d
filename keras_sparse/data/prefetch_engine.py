"""The prefetch stage's engine: its threads, queues and sequencer, and the
per-batch work (table calls, encoding, routing) its workers run
(`keras_sparse.data.prefetch`)."""

import threading
import time

import keras
import numpy as np
from keras import tree

from keras_sparse.data import cache_ahead
from keras_sparse.data import routing as routing_lib
from keras_sparse.data.prefetch_pass import Pass
from keras_sparse.data.prefetch_pass import counters
from keras_sparse.data.untrained import undo_since
from keras_sparse.data.untrained import undo_untrained
from keras_sparse.layers.hash.prepared_inputs import KeyWords
from keras_sparse.layers.hash.prepared_inputs import host_segments
from keras_sparse.layers.hash.prepared_inputs import pack_groups
from keras_sparse.layers.hash.prepared_inputs import rows_of_codes
from keras_sparse.layers.hash.prepared_inputs import segment_scratch
from keras_sparse.layers.model_feeds import array_at
from keras_sparse.layers.model_feeds import replace_at
from keras_sparse.layers.model_feeds import split_batch


class Engine:
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
        # The replicas this process's batches go to (None: all of them).
        self.local_replicas = None
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
        self.base = counters(feeds)
        self.copy_batch = None  # host -> device copy (`transfer.batch_copier`)
        # Per feed: None (codes alone) or ``(replicas, channel)``, what the
        # codes travel with (`prepared_inputs`): "segments" or the
        # `ExchangeBuckets` of a row-sharded layer. See `feed_layouts`.
        self.layouts = [None] * len(feeds)
        # Per feed: 0, or the replicas its key words are packed for.
        self.words = [0] * len(feeds)
        # Per feed: None, or ``(replicas, start, count, blocks)`` when its
        # model input feeds other hash layers too (`feed_layouts.feed_shares`).
        self.shares = [None] * len(feeds)
        # Hash feeds per model input, and the replicas its blocks are packed
        # for (`feed_layouts.feed_shares`).
        self.groups = []
        self.scratch = {}  # feed index -> `segment_scratch` array
        # Tables with ``cache_rows`` whose training batches are mapped
        # ahead, as Keras receives them (`cache_ahead`).
        self.cached_feeds = []  # set by `prefetch` (it knows the model)

    # ---------------------------------------------------------------- passes
    def start_pass(self):
        self.end_pass(complete=False)
        p = Pass(self, self.source.passes(), self.source.num_batches)
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
        # inside a fit (see `Pass`).
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
        """The batch handed to Keras (each hash layer's input replaced by its
        codes, with what they travel with, routed, copied to the device) and
        the host ids of its tables mapped ahead (`cache_ahead.host_ids`)."""
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
        # Host ids of the tables mapped ahead, read before the device copy.
        ahead = cache_ahead.host_ids(self.cached_feeds, x)
        if self.copy_batch is not None:
            x, y, sw = self.copy_batch((x, y, sw))
        return (x, y, sw), ahead

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
        # Owners count over all R shards; this process's batch goes to its
        # own replicas alone (`local`, None in one process).
        local = self.local_replicas
        perm = routing_lib.locality_assignment(owners, r, cost, local)
        before = routing_lib.exchanged_bytes(owners, r, cost, local=local)
        after = routing_lib.exchanged_bytes(owners, r, cost, perm, local)
        with self.cond:
            self.stats["routed_batches"] += 1
            self.stats["bytes_unrouted"] += before
            self.stats["bytes_routed"] += after
        return perm

    def _add(self, name, value):
        with self.cond:
            self.stats[name] += value


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
