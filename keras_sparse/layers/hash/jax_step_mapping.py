"""How a compiled JAX step reaches a `DistributedHashEmbedding`'s hash table.

The key->row map is Python state (a NumPy or CuPy `HashTable`), so inside
``jax.jit`` it is reached through a callback that returns ``(rows, fresh)``.

* In-place buffer callback (``jax.experimental.buffer_callback``), used when
  the step runs on one device (no Keras distribution active): XLA hands the
  callback its own key buffer and the output buffers. On a CPU table with the
  step on the CPU the keys are read and the rows written in place, without
  the host copies and the token ordering of ``io_callback``, and XLA may run
  the callbacks of different layers concurrently. On a GPU table
  with the step on the same GPU the buffers are wrapped as CuPy arrays and
  the table runs on XLA's stream, so the keys stay on the device (see
  `GPU_BUFFERS_IN_STEP` and `gpu_buffers_work`).
* Ordered ``io_callback`` otherwise: under a distribution the step is
  partitioned across devices and a side-effecting custom call needs a
  placement, which only ``io_callback`` gives (it runs once, on one device,
  with the batch gathered); for a CPU table feeding a GPU step; and for a
  layer a functional model calls more than once (its calls keep their
  order).

Steps run in order either way: each training step consumes the state the
previous one produced, and each callback belongs to one layer's table. The
in-place callbacks are declared free of side effects, so that JAX keeps its
C++ dispatch fast path for the step (see `rows_in_step`).
"""

from __future__ import annotations

import contextvars
import functools
import threading
import warnings

import keras
import numpy as np

from keras_sparse.layers.hash import table_users

# False forces the io_callback route everywhere: the escape hatch for a step
# that is partitioned across devices without a Keras distribution (a
# hand-written ``jax.jit`` with shardings), which the in-place route cannot
# detect and XLA then refuses ("Side-effect HLO must have sharding").
IN_PLACE_CALLBACKS = True

# The GPU-buffer variant of the in-step callback (CuPy table on XLA's stream),
# used where a one-time probe (`gpu_buffers_work`) shows that CuPy can read
# and write XLA's buffers on its stream in this process; False keeps GPU
# tables on the io_callback route (keys through the host).
GPU_BUFFERS_IN_STEP = True

_PROBE = {}  # "result": the probe's verdict in this process
_PROBE_LOCK = threading.Lock()


def buffer_callback_or_none():
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError:  # jax < 0.7: no in-place callbacks
        return None
    return buffer_callback


def _single_device_step():
    """True when the traced step runs on one device (no Keras distribution)."""
    return keras.distribution.distribution() is None


def _step_platform():
    import jax

    return jax.default_backend()


def _xla_stream(ctx):
    """The CUDA stream XLA runs the step on (a seam for the CUDA emulation)."""
    return ctx.stream


class _StreamHandle:
    """A raw stream pointer offered through the CUDA stream protocol."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


_STREAMS = {}  # XLA's stream pointer -> the CuPy stream wrapping it


def _cupy_stream(ctx):
    """XLA's stream of this step as a CuPy stream (one object per pointer).

    ``Stream.from_external`` where CuPy has it (CuPy 14 deprecates
    ``ExternalStream``, and a deprecation raised inside a callback would
    abort the step under ``-W error``), else ``ExternalStream``.
    """
    import cupy as cp

    ptr = int(_xla_stream(ctx))
    stream = _STREAMS.get(ptr)
    if stream is None:
        try:
            stream = cp.cuda.Stream.from_external(_StreamHandle(ptr))
        except (AttributeError, TypeError):  # CuPy < 14
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = cp.cuda.ExternalStream(ptr)
        _STREAMS[ptr] = stream
    return stream


def calls_per_step(layer):
    """How many calls of ``layer``'s table a step of its functional model
    makes (at least 1): the layer's own calls, those of the
    `HashEmbeddingCollection`s it is a field of, and the same for every
    other layer given the same table object."""
    calls = 0
    for user in table_users.users(layer):
        calls += len(getattr(user, "_inbound_nodes", ()))
        for owner in user.__dict__.get("_ks_hash_collections", ()):
            collection = owner()
            if collection is not None:
                calls += max(len(getattr(collection, "_inbound_nodes", ())), 1)
    return max(calls, 1)


def _called_once(layer):
    """False for a layer shared by several inputs of a functional model."""
    return calls_per_step(layer) <= 1


def choose_route(layer):
    """``"cpu_buffers"``, ``"gpu_buffers"`` or ``"io_callback"`` for ``layer``."""
    if (
        not IN_PLACE_CALLBACKS
        or buffer_callback_or_none() is None
        or not _single_device_step()
        # In-place callbacks are unordered (XLA may run those of different
        # layers concurrently); two calls of one table in a step must keep
        # their program order, which the ordered io_callback guarantees.
        or not _called_once(layer)
    ):
        return "io_callback"
    platform = _step_platform()
    if layer.table.device == "cpu" and platform == "cpu":
        return "cpu_buffers"
    if layer.table.device == "gpu" and platform == "gpu" and GPU_BUFFERS_IN_STEP:
        if gpu_buffers_work():
            return "gpu_buffers"
    return "io_callback"


def _probe_gpu_buffers():
    """A compiled step whose callback reads its input and writes its output
    through CuPy on XLA's stream, with a host read in between (as a table
    call has); True when the step sees the right values."""
    import cupy as cp
    import jax

    # A fresh offset per probe: an output buffer that the callback failed to
    # write may still hold an earlier probe's (right) answer, reused memory.
    offset = int(np.random.default_rng().integers(1, 1 << 20))

    def callback(ctx, out, x):
        with _cupy_stream(ctx):
            keys = cp.asarray(x)
            # A host read of the step's data: waits for its earlier work.
            live = int((keys > offset).sum())
            cp.asarray(out)[...] = keys * 2 + live

    step = buffer_callback_or_none()(
        callback, jax.ShapeDtypeStruct((8,), np.int32), has_side_effect=True
    )
    x = np.arange(-3, 5, dtype=np.int32) + np.int32(offset)
    # Evaluated now even when called while a step is being traced.
    with jax.ensure_compile_time_eval():
        got = np.asarray(jax.jit(lambda v: step(v + 1) - 1)(x))
    return bool(np.array_equal(got, (x + 1) * 2 + int((x + 1 > offset).sum()) - 1))


def gpu_buffers_work():
    """Whether the GPU-buffer route works here (probed once per process).

    On failure GPU tables keep the io_callback route and a warning says why.
    """
    with _PROBE_LOCK:
        if "result" not in _PROBE:
            try:
                ok, why = _probe_gpu_buffers(), "it computed wrong values"
            except Exception as e:  # noqa: BLE001  (any failure: fall back)
                ok, why = False, f"{type(e).__name__}: {e}"
            if not ok:
                warnings.warn(
                    "keras_sparse: GPU hash tables cannot use XLA's buffers "
                    f"in compiled JAX steps here ({why}); they use the "
                    "io_callback route instead (keys through the host).",
                    RuntimeWarning,
                    stacklevel=2,
                )
            _PROBE["result"] = ok
        return _PROBE["result"]


class StepFailures:
    """The first error a layer's table raised inside a compiled step.

    One record per layer, whatever route reached the table: later steps
    refuse to touch it (`_failing_once`, the key-sharded callbacks), and
    ``fit`` / ``evaluate`` / ``predict`` re-raise the error itself in place
    of JAX's wrapper (`keras_sparse.layers.jax_full_keys.step_error`).
    """

    def __init__(self, name):
        self.name = name
        self.first = None

    def record(self, error):
        if self.first is None:
            self.first = error
        return np.int32(1)

    def error(self):
        """A fresh copy of the first error (it may be raised on several
        devices, or again after JAX wrapped it)."""
        first = self.first
        try:
            return type(first)(str(first))
        except Exception:  # noqa: BLE001  (an exception type with other args)
            return RuntimeError(f"{type(first).__name__}: {first}")


def step_failures(layer):
    """``layer``'s `StepFailures` (created on first use)."""
    failures = layer.__dict__.get("_ks_step_failures")
    if failures is None:
        failures = layer.__dict__["_ks_step_failures"] = StepFailures(layer.name)
    return failures


def _failing_once(layer, callback):
    """``callback`` made final on its first failure: once a step's table call
    raised, later steps of ``layer`` raise the same error without touching
    the table.

    The failed step's model state is lost (Keras donates it), and on a GPU
    JAX reports the error only when a result is read, by which time the
    steps queued after it may have run their callbacks; this keeps the table
    as the last good step left it.
    """

    failures = step_failures(layer)

    def guarded(*args):
        first = failures.first
        if first is not None:
            raise RuntimeError(
                f"Layer '{layer.name}': an earlier compiled step failed in its "
                f"table call and the model's state from that step on is lost; "
                f"the table was left as the last good step had it. First "
                f"error: {type(first).__name__}: {first}"
            )
        try:
            return callback(*args)
        except Exception as e:
            failures.record(e)
            raise

    return guarded


# For the callbacks of other layers' tables (a table with `cache_rows`).
final_on_failure = _failing_once

_IN_REMAT = contextvars.ContextVar("keras_sparse_in_remat", default=False)


def watch_remat():
    """Marks the calls Keras rematerializes (layers built under a
    ``RematScope``, and everything they call), so that `rematerializing`
    sees them when the step is traced. Installed once, by
    `keras_sparse.layers.jax_full_keys.install`."""
    try:
        from keras.src.ops.operation import Operation
    except ImportError:  # a Keras without rematerialization
        return
    original = getattr(Operation, "rematerialized_call", None)
    if original is None:
        return

    @functools.wraps(original)
    def rematerialized_call(self, layer_call, *args, **kwargs):
        call = original(self, layer_call, *args, **kwargs)

        @functools.wraps(call)
        def marked(*call_args, **call_kwargs):
            token = _IN_REMAT.set(True)
            try:
                return call(*call_args, **call_kwargs)
            finally:
                _IN_REMAT.reset(token)

        return marked

    Operation.rematerialized_call = rematerialized_call


def rematerializing():
    """True while Keras traces a rematerialized call (its forward pass may
    run again in the backward pass), or inside an active ``RematScope``."""
    if _IN_REMAT.get():
        return True
    try:
        from keras.src.backend.common.remat import get_current_remat_mode
    except ImportError:  # a Keras without rematerialization
        return False
    return get_current_remat_mode() is not None


def rows_in_step(owner, route, keys, use, n, host_rows, gpu_rows, words=False):
    """Flat ``(rows int32 [n], fresh bool [n])`` of traced ``keys``/``use``
    by one callback of ``route`` (see `choose_route`), final on its first
    failure (recorded on ``owner``); with ``words``, also each position's
    key's high 32-bit word (int32 ``[n]``, the full key's: on JAX without
    x64 only the host has it).

    ``host_rows(keys, use, out)`` (NumPy) and ``gpu_rows(keys, use, out)``
    (CuPy, on XLA's stream) write the rows, fresh flags (and high words)
    into ``out``.
    """
    import jax

    result_types = (
        jax.ShapeDtypeStruct((n,), np.int32),
        jax.ShapeDtypeStruct((n,), np.bool_),
    ) + ((jax.ShapeDtypeStruct((n,), np.int32),) if words else ())
    if route == "io_callback":
        from jax.experimental import io_callback

        def host_callback(k, u):
            out = (np.empty(n, np.int32), np.empty(n, bool))
            out += (np.empty(n, np.int32),) if words else ()
            host_rows(np.asarray(k), np.asarray(u), out)
            return out

        return io_callback(
            _failing_once(owner, host_callback), result_types, keys, use, ordered=True
        )

    if route == "cpu_buffers":

        def callback(ctx, outputs, k, u):
            out = tuple(np.asarray(o) for o in outputs)
            host_rows(np.asarray(k), np.asarray(u), out)

    else:

        def callback(ctx, outputs, k, u):
            import cupy as cp

            # CuPy work (kernels, copies, the few size reads) goes on the
            # stream XLA runs this step on, so it sees the keys written
            # before and finishes before the rows are read.
            with _cupy_stream(ctx):
                out = tuple(cp.asarray(o) for o in outputs)
                gpu_rows(cp.asarray(k), cp.asarray(u), out)

    # Declared free of side effects on purpose: an effect makes JAX
    # dispatch every step through its Python path (no C++ fast path for
    # executables with effects), 2-5 ms per step of host time, which a GPU
    # step that is otherwise host bound pays in full. The table update is
    # still made once per step: the rows are always consumed (the gather),
    # a step runs once, and steps run in order (each takes the state the
    # previous one donated). Only a field whose output reaches no result of
    # the step is pruned, and it then inserts nothing, as it needs no rows.
    # Where Keras rematerializes (`watch_remat`) the backward pass would
    # recompute the rows by calling the table again: there the effect stays,
    # and JAX then keeps the callback's output instead of recomputing it. A
    # hand-written jax.checkpoint around a hash layer is not detected.
    mapper = buffer_callback_or_none()(
        _failing_once(owner, callback),
        result_types,
        has_side_effect=rematerializing(),
    )
    return mapper(keys, use)


def map_in_step(layer, keys, use, insert, n, words=False):
    """Flat ``(rows int32 [n], fresh bool [n])`` of traced ``keys``/``use``,
    and with ``words`` the keys' high words (see `rows_in_step`).

    ``layer`` provides ``_map_step_keys(keys, use, insert, out=None)``
    (NumPy, the high bits JAX dropped restored) and ``_gpu_rows(keys, use,
    insert, out=None)`` (CuPy); both write into ``out`` when given (the
    high words too when it has three arrays).
    """

    def host_rows(k, u, out):
        layer._map_step_keys(k, u, insert, out)

    def gpu_rows(k, u, out):
        layer._gpu_rows(k, u, insert, out)

    route = choose_route(layer)
    return rows_in_step(layer, route, keys, use, n, host_rows, gpu_rows, words)
