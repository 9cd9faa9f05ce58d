"""The object `keras_sparse.data.prefetch` returns (`PrefetchStage`, a
`keras.utils.PyDataset`) and its lifecycle.

While a stage is open, its hash layers are in "prepared inputs" mode (a
per-layer counter; the model's cached train/test/predict functions are reset
so they retrace) and *only* prepared inputs may reach them; ``close()`` (or
leaving the ``with`` block, or garbage collection) restores the raw-key path
and resets the cached functions again. Use one stage per data set (e.g.
``validation_data=prefetch(val, model, training=False)``).

The stage serves its engine's passes in order (`keras_sparse.data.prefetch_engine`);
batches Keras reads outside an epoch (the TensorFlow adapter's peek, the
batch of Keras' symbolic build) are served again, first, when the epoch
begins.
"""

import weakref

import keras

from keras_sparse.data import lookahead
from keras_sparse.layers.hash.prepared_inputs import PreparedForm


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
