"""One pass of a prefetch stage over its source: the feeder thread, the
workers' units of work and the reorder buffer (`keras_sparse.data.prefetch`)."""

import collections
import threading
import time

import keras

from keras_sparse.data import cache_ahead
from keras_sparse.data import lookahead

_POLL = 0.05


class PrefetchError(RuntimeError):
    """A worker of a prefetch stage failed.

    ``original`` (and ``__cause__``, unless Keras' traceback filtering cleared
    it) is the worker's exception with its traceback; the message embeds the
    formatted worker traceback too (it survives tf.data's re-wrapping).
    """

    original = None


def counters(feeds):
    """Each feed's layer step counter (None where it cannot be read)."""
    out = []
    for feed in feeds:
        it = getattr(feed.layer, "sparse_iterations", None)
        try:
            out.append(int(keras.ops.convert_to_numpy(it)))
        except Exception:  # noqa: BLE001 - absent, or purged by a JAX fit
            out.append(None)
    return out


def close_quietly(iterator):
    """Closes a stopped pass's iterator (a generator runs its ``finally``)."""
    close = getattr(iterator, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 - the pass is over either way
            pass


def lanes(feeds):
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


class Batch:
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


class Pass:
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
        # seq -> (batch, host ids to map ahead (`cache_ahead`), error)
        self.results = {}
        self.batches = {}  # seq -> Batch, prepared and not yet finished
        # Layers sharing one table form one lane; a lane's calls run in
        # (batch, feed) order: ticket = batch * lane size + position.
        self.lane, self.lane_pos, self.lane_size = lanes(engine.feeds)
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
                now = now or counters(engine.feeds)
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
                close_quietly(self.iterator)

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
                self.results[n] = (None, None, err)
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
                close_quietly(it if it is not None else self.iterator)

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
            self.batches[seq] = Batch(seq, parts, err, todo)
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
        out, ahead, err = None, None, b.err
        if err is None and b.seq > self.failed_seq:
            err = RuntimeError("an earlier batch failed")
        if err is None:
            try:
                out, ahead = self.e.finish(b.parts, b.codes, b.segments)
            except BaseException as exc:  # noqa: BLE001
                err = exc
        with self.cond:
            del self.batches[b.seq]
            self.results[b.seq] = (out, ahead, err)
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
            out, ahead, err = self.results.pop(key)
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
        if ahead:
            cache_ahead.map_batch(self.e.cached_feeds, ahead)
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
