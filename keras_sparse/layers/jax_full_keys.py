"""Keeps 64-bit keys whole through ``model.fit`` on JAX without x64.

Without ``jax_enable_x64`` JAX stores integers in 32 bits: an int64 key array
handed to a compiled step is wrapped to its low 32 bits before any layer sees
it, so keys ``k`` and ``k + 2**32`` would share a row. The key->row mapping of
`DistributedHashEmbedding` runs on the host anyway (a host callback inside
the step), so the full keys only have to reach the host, not the device.

On import (JAX backend only) this module wraps the JAX trainer's ``fit``,
``evaluate``, ``predict`` and ``*_on_batch`` methods. While one runs on a model
with hash layers, every batch the data adapter yields (after Keras' own
shuffling and splitting, before the transfer to the device) is inspected: the
int64/uint64 key arrays feeding each hash layer are pushed, unchanged, onto
that layer's host-side queue. The step still receives the (truncated) arrays,
so shapes, tracing and the compiled program are exactly those of plain Keras.
When the layer's host mapping runs for a batch it pops its queue and uses the
full keys, after checking that their low 32 bits equal what the step received
(steps run in order, so the queue is FIFO; an abandoned look-ahead batch is
recognised by that check and dropped). Cost: one host reference per batch and
one O(n) comparison per layer per step. The queues themselves, and the
layer side that takes keys back, are `keras_sparse.layers.jax_key_queue`.

Models where the feeding input cannot be found (subclassed models, a layer
fed by another layer) cannot be served this way; for them a batch whose int64
keys do not fit in 32 bits raises a clear error instead of training on
collided keys. ``keras_sparse.data.prefetch`` (which maps keys on the host)
and ``jax_enable_x64`` are the alternatives.
"""

import contextlib
import contextvars
import functools
import threading
import warnings
import weakref
from typing import NamedTuple

import numpy as np

from keras_sparse.layers.hash import serving_state
from keras_sparse.layers.hash import string_keys
from keras_sparse.layers.jax_key_queue import CALL_QUEUES
from keras_sparse.layers.jax_key_queue import KeyQueue
from keras_sparse.layers.jax_key_queue import key_queue
from keras_sparse.layers.row_storage import cache_batches
from keras_sparse.layers.row_storage import cache_jax_processes

_ACTIVE = contextvars.ContextVar("keras_sparse_full_keys_model", default=None)
_BUILDING = contextvars.ContextVar("keras_sparse_symbolic_build", default=False)
_INT32 = np.iinfo(np.int32)
_install_lock = threading.Lock()
_installed = False
_feeds_cache = weakref.WeakKeyDictionary()
_ours_cache = weakref.WeakKeyDictionary()


def _needs_full_keys():
    import jax

    return not jax.config.jax_enable_x64


class _ModelFeeds(NamedTuple):
    hash_feeds: list  # feeds of the hash layers whose keys get queued
    problem: str  # why the hash layers' inputs cannot be found, or None
    has_hash: bool
    fixed_layers: list  # (name, ModelInput) read by fixed-vocabulary layers
    cached: list  # (CacheRows, ModelInput): tables with cache_rows

    @property
    def active(self):
        return self.has_hash or bool(self.fixed_layers) or bool(self.cached)


def _feeds(model):
    """The `_ModelFeeds` of ``model`` (cached)."""
    cached = _feeds_cache.get(model)
    if cached is not None:
        return cached
    from keras_sparse.layers.model_feeds import plan

    try:
        feeds = [f for f in plan(model) if f.kind == "hash"]
        problem = None
    except ValueError as e:
        feeds, problem = [], str(e)
    has_hash = _has_hash_layers(model)
    result = _ModelFeeds(
        feeds,
        problem if has_hash else None,
        has_hash,
        _fixed_layers(model),
        cache_batches.feeds(model),
    )
    _feeds_cache[model] = result
    return result


def _has_hash_layers(model):
    from keras_sparse.layers.model_feeds import is_hash_layer

    return any(
        is_hash_layer(layer)
        for layer in model._flatten_layers(include_self=False, recursive=True)
    )


def _fixed_layers(model):
    """``[(layer name, ModelInput)]``: the model inputs that fixed-vocabulary
    layers (ids < 2**31) read directly. Inputs reaching them through other
    layers are not followed (those layers decide what the ids become)."""
    from keras import tree

    from keras_sparse.layers.model_feeds import is_fixed_layer
    from keras_sparse.layers.model_feeds import model_inputs

    layers = [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if is_fixed_layer(layer)
    ]
    if not layers:
        return []
    inputs = model_inputs(model)
    fed = []
    for layer in layers:
        for node in getattr(layer, "_inbound_nodes", []):
            if not node.arguments.args:
                continue
            for t in tree.flatten(node.arguments.args[0]):
                if id(t) in inputs:
                    fed.append((layer.name, inputs[id(t)]))
    return fed


def _check_ids_fit(model, x, fixed_layers):
    """Refuses int64 ids beyond int32 that fixed-vocabulary layers read: the
    step would see them wrapped to 32 bits (``2**32 + 5`` as 5) and train
    that row."""
    from keras_sparse.layers.model_feeds import array_at

    for name, model_input in fixed_layers:
        try:
            a = array_at(x, model_input.find(x))
        except (ValueError, KeyError, IndexError, TypeError):
            continue  # not in this batch: Keras reports that itself
        first = _first_beyond_int32(a)
        if first is not None:
            wrapped = (first + 2**31) % 2**32 - 2**31
            raise ValueError(
                f"Model '{model.name}': id {first} ({a.dtype}) for layer "
                f"'{name}' is beyond the int32 range. JAX without "
                f"`jax_enable_x64` would wrap it to {wrapped} in the compiled "
                "step and train that row, so the step is not run. Ids of "
                "AllToAllDenseEmbedding / EmbeddingCollection must lie in "
                "[0, input_dim)."
            )


def _is_wide(a):
    return isinstance(a, np.ndarray) and a.dtype in (np.int64, np.uint64)


def _check_fits_int32(model, x, problem):
    from keras import tree

    for a in tree.flatten(x):
        if _is_wide(a) and a.size:
            if a.dtype == np.uint64 or a.min() < _INT32.min or a.max() > _INT32.max:
                raise ValueError(
                    f"Model '{model.name}': int64 keys beyond the int32 range "
                    "reach a DistributedHashEmbedding, but JAX (without "
                    "`jax_enable_x64`) would truncate them to 32 bits and "
                    "keras_sparse cannot tell which input feeds the layer "
                    f"({problem}). Use `keras_sparse.data.prefetch(data, "
                    "model, feature_map=...)`, or enable x64 with "
                    "`jax.config.update('jax_enable_x64', True)` before "
                    "building the model."
                )


def _first_beyond_int32(a):
    """The first value of a wide NumPy array outside int32, or None."""
    if not _is_wide(a) or not a.size:
        return None
    bad = a > _INT32.max
    if a.dtype != np.uint64:
        bad |= a < _INT32.min
    return int(a[bad].reshape(-1)[0]) if bad.any() else None


def _check_declared_int32(layer, keys):
    first = _first_beyond_int32(keys)
    if first is not None:
        raise ValueError(
            f"Layer '{layer.name}': key {first} is beyond the int32 range, but "
            "the layer declares key_dtype='int32' (keys in [-2**31, 2**31)). "
            "JAX without `jax_enable_x64` would wrap it to 32 bits in the "
            "compiled step, so the step is not run. Use key_dtype='int64' "
            "(the default) for wider keys."
        )


def note_batch(model, batch, queue=True, queues=None):
    """Queues the full keys of one batch (``(x, ...)`` as Keras yields it)
    and refuses ids that fixed-vocabulary layers would see wrapped.
    ``queue=False``: the checks only (a batch that reaches no step).
    ``queues``: a dict ``id(layer) -> KeyQueue`` to queue into instead of
    the layers' own (a direct call's, see `CALL_QUEUES`)."""
    from keras_sparse.layers.model_feeds import array_at
    from keras_sparse.layers.model_feeds import split_batch

    model_feeds = _feeds(model)
    if not model_feeds.active:
        return
    x, _, _ = split_batch(batch)
    if model_feeds.cached and cache_batches.needed():
        # Inside fit or train_on_batch (not fit's validation): training.
        cache_batches.check_batch(x, model_feeds.cached, serving_state.hidden())
    if model_feeds.problem is not None:
        _check_fits_int32(model, x, model_feeds.problem)
        return
    for feed in model_feeds.hash_feeds:
        if feed.layer.prepared_form is not None:
            continue  # a prefetch stage already mapped these keys
        try:
            keys = array_at(x, feed.keys.find(x))
        except ValueError as e:
            # Without queued keys the layer would map truncated ones: refuse
            # wide keys, as for models whose feeding inputs are unknown.
            _check_fits_int32(model, x, f"layer '{feed.layer.name}': {e}")
            continue
        if not _is_wide(keys):
            continue
        if feed.layer.key_dtype == "int32":
            # Declared 32-bit: the step's keys are exact, nothing to queue
            # (compiled inference reads the serving map, not the queue).
            _check_declared_int32(feed.layer, keys)
            continue
        if queue:
            q = (
                key_queue(feed.layer)
                if queues is None
                else queues.setdefault(id(feed.layer), KeyQueue())
            )
            q.append(keys.reshape(-1).view(np.int64))
    if model_feeds.fixed_layers:
        _check_ids_fit(model, x, model_feeds.fixed_layers)


def _clear_queues(model):
    for feed in _feeds(model).hash_feeds:
        key_queue(feed.layer).clear()


def _noting(model, iterator):
    for batch in iterator:
        note_batch(model, batch, queue=not _BUILDING.get())
        yield batch


def _wrap_symbolic_build(cls):
    """Keras builds an unbuilt model from the first batch of a fresh
    iterator, then restarts it: that batch reaches no step, so its keys
    are checked but not queued (a stale head entry would cost every later
    step a mismatched check). The check still refuses bad ids there, before
    Keras hands the variables to the training loop."""
    original = cls._symbolic_build

    @functools.wraps(original)
    def _symbolic_build(self, *args, **kwargs):
        token = _BUILDING.set(True)
        try:
            return original(self, *args, **kwargs)
        finally:
            _BUILDING.reset(token)

    cls._symbolic_build = _symbolic_build


@contextlib.contextmanager
def _active(model):
    """Marks ``model`` as the one whose batches are noted (nests safely)."""
    if not _needs_full_keys() or not _feeds(model).active:
        yield
        return
    outer = _ACTIVE.get()
    token = _ACTIVE.set(model)
    if outer is not model:
        _clear_queues(model)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        if outer is not model:
            _clear_queues(model)


# ------------------------------------------------------------- installing
def _precheck(model, args, kwargs):
    """Fails before Keras takes the model's state when in-memory data is bad.

    An exception raised from inside a JAX step (where batches are pulled)
    would leave the model's variables detached; arrays given directly can be
    checked up front. Other sources are checked batch by batch.
    """
    model_feeds = _feeds(model)
    if model_feeds.cached:  # across JAX processes: their copies are equal
        cache_batches.check_copies(model_feeds.cached)
    x = args[0] if args else kwargs.get("x")
    validation = kwargs.get("validation_data")
    for data in (x, validation[0] if isinstance(validation, tuple) else None):
        if not isinstance(data, (np.ndarray, dict, list, tuple)):
            continue
        if model_feeds.problem is not None:
            _check_fits_int32(model, data, model_feeds.problem)
            continue
        # Up front: a batch refused inside Keras's JAX loop would leave the
        # model's variables detached.
        if model_feeds.fixed_layers:
            _check_ids_fit(model, data, model_feeds.fixed_layers)
        if model_feeds.cached and cache_batches.needed():
            # The range (across processes each batch's, all checking alike).
            if not cache_jax_processes.active():
                cache_batches.check_batch(data, model_feeds.cached, False)
        for feed in model_feeds.hash_feeds:
            if feed.layer.key_dtype != "int32":
                continue
            from keras_sparse.layers.model_feeds import array_at

            try:
                keys = array_at(data, feed.keys.find(data))
            except (ValueError, KeyError, IndexError, TypeError):
                continue
            if _is_wide(keys):
                _check_declared_int32(feed.layer, keys)


_TRUNCATION_WARNING = "Explicitly requested dtype int64 requested in asarray"


def _wide_inputs_all_ours(model):
    """True when each int64/uint64 input of a functional ``model`` is read
    only by keras_sparse layers (which get its full keys, or refuse ids
    beyond int32): JAX's truncation warning about them is then moot."""
    from keras import tree

    cached = _ours_cache.get(model)
    if cached is not None:
        return cached
    wide = {
        id(t)
        for t in tree.flatten(getattr(model, "inputs", None) or [])
        if str(getattr(t, "dtype", "")) in ("int64", "uint64")
    }
    ours = bool(wide)
    for layer in model._flatten_layers(include_self=False, recursive=True):
        for node in getattr(layer, "_inbound_nodes", []):
            args = tree.flatten((node.arguments.args, node.arguments.kwargs))
            if any(id(t) in wide for t in args) and not hasattr(
                layer, "keras_sparse_kind"
            ):
                ours = False
    _ours_cache[model] = ours
    return ours


@contextlib.contextmanager
def _truncation_warning_moot(model):
    """Hides JAX's int64 truncation warning while ``model`` runs, when every
    wide input goes to keras_sparse layers (see `_wide_inputs_all_ours`)."""
    try:
        moot = _wide_inputs_all_ours(model)
    except (AttributeError, TypeError, ValueError):
        moot = False  # not a functional model: keep JAX's warning
    if not moot:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRUNCATION_WARNING)
        yield


def _wrap_method(cls, name):
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        string_keys.check(self, args[0] if args else kwargs.get("x"))
        with _active(self), _truncation_warning_moot(self):
            if _ACTIVE.get() is self:
                _precheck(self, args, kwargs)
            try:
                return original(self, *args, **kwargs)
            except Exception as e:
                error = step_error(self, e)
                if error is None:
                    raise
                raise error from e

    setattr(cls, name, wrapper)


def step_error(model, error):
    """The exception a hash layer's table raised inside a compiled step,
    when ``error`` is JAX's wrapper of it (``JaxRuntimeError``); else None.

    JAX reports a callback's exception as a runtime error whose text holds
    the traceback (a ``ValueError`` from the C++ dispatch path, which steps
    with in-place callbacks take); the user should see the original type
    (e.g. `TableFullError`) and message, which name the layer.
    """
    wrapped = type(error).__name__ == "JaxRuntimeError" or (
        isinstance(error, ValueError)
        and "Error when calling buffer callback" in str(error)
    )
    if not wrapped:
        return None
    for layer in model._flatten_layers(include_self=False, recursive=True):
        failures = layer.__dict__.get("_ks_step_failures")
        if failures is not None and failures.first is not None:
            return failures.error()
    return None


def _wrap_on_batch(cls, name):
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        string_keys.check(self, args[0] if args else kwargs.get("x"))
        with _active(self), _truncation_warning_moot(self):
            if _ACTIVE.get() is self:
                note_batch(self, (args[0] if args else kwargs.get("x"),))
            return original(self, *args, **kwargs)

    setattr(cls, name, wrapper)


def _has_host_wide_keys(inputs):
    from keras import tree

    return any(_is_wide(a) for a in tree.flatten(inputs))


def _wrap_functional_call(cls):
    """Direct calls ``model(x)`` with NumPy int64 keys: the model converts
    them to JAX's int32 before any layer runs, so queue their full keys as
    ``fit`` does; the hash layers' host mapping (eager) restores them."""
    original = cls.call

    @functools.wraps(original)
    def call(self, inputs, *args, **kwargs):
        active = _ACTIVE.get()
        if active is self or not _has_host_wide_keys(inputs):
            return original(self, inputs, *args, **kwargs)
        if active is not None:
            # Another model's fit/evaluate/predict owns the queues (maybe of
            # shared layers): leave them alone, and refuse keys that would
            # be truncated rather than map them wrong.
            _check_fits_int32(
                self,
                inputs,
                f"model '{active.name}' is running fit/evaluate/predict, "
                "whose queued keys a nested call must not disturb",
            )
            return original(self, inputs, *args, **kwargs)
        with _direct_call(self) as queues, _truncation_warning_moot(self):
            if queues is not None:
                _precheck(self, (inputs,), {})
                note_batch(self, (inputs,), queues=queues)
            return original(self, inputs, *args, **kwargs)

    cls.call = call


@contextlib.contextmanager
def _direct_call(model):
    """Marks ``model`` active for one direct call in this thread and yields
    the call's own key queues (None when it needs none). The trainer's
    queues are neither read nor cleared."""
    if not _needs_full_keys() or not _feeds(model).active:
        yield None
        return
    queues = {}
    active, call_queues = _ACTIVE.set(model), CALL_QUEUES.set(queues)
    try:
        yield queues
    finally:
        CALL_QUEUES.reset(call_queues)
        _ACTIVE.reset(active)


def _wrap_epoch_iterator(cls):
    original = cls._get_iterator

    @functools.wraps(original)
    def _get_iterator(self):
        model = _ACTIVE.get()
        adapter = self.data_adapter
        if model is not None and not getattr(adapter, "_ks_noting", False):
            inner = adapter.get_jax_iterator
            adapter.get_jax_iterator = lambda: _noting(model, inner())
            adapter._ks_noting = True
        return original(self)

    cls._get_iterator = _get_iterator


def install():
    """Wraps the JAX trainer once (idempotent; no-op on other backends)."""
    global _installed
    import keras

    if keras.backend.backend() != "jax":
        return
    with _install_lock:
        if _installed:
            return
        from keras.src.backend.jax import trainer as jax_trainer

        for name in ("fit", "evaluate", "predict"):
            _wrap_method(jax_trainer.JAXTrainer, name)
        for name in ("train_on_batch", "test_on_batch", "predict_on_batch"):
            _wrap_on_batch(jax_trainer.JAXTrainer, name)
        _wrap_epoch_iterator(jax_trainer.JAXEpochIterator)
        _wrap_symbolic_build(jax_trainer.JAXTrainer)
        from keras.src.models.functional import Functional

        _wrap_functional_call(Functional)
        from keras_sparse.layers.hash import jax_step_mapping

        jax_step_mapping.watch_remat()
        _installed = True
