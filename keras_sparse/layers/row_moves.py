"""A training step's row moves between a hash layer's variables and its store.

`move_rows` runs inside the step, before the lookup: it reads the fresh
rows as they are (the evicted keys' last values), hands them to the host
(`keras_sparse.layers.row_tier.RowTier.move`: write-backs, then store
reads) and writes the rows the store filled into the table and slot
variables. The host hop is a direct call in eager steps, in a compiled
JAX step an in-place buffer callback where the caller's mapping uses one
(one CPU device, one call a step) and an ordered ``io_callback`` elsewhere,
and a ``tf.numpy_function`` in a TensorFlow graph; only ``n`` rows per step
cross it (n: the batch's positions), whatever the table's size.
"""

import keras
import numpy as np
from keras import ops

from keras_sparse.backend_utils import is_symbolic
from keras_sparse.layers.row_storage import cache_jax_processes
from keras_sparse.ops import backend_module


def move_rows(layer, rows, fresh, route="io_callback", rounds=None):
    """Bool ``[n]``: the fresh positions of flat ``rows`` whose rows the
    layer's store filled (their values and slots are written; the others
    are for the caller to initialize). ``route``: how a compiled JAX step
    reaches the host, "io_callback" or "cpu_buffers" (an in-place buffer
    callback, for a layer called once by a step on one CPU device; see
    `keras_sparse.layers.hash.jax_step_mapping.choose_route`).
    ``rounds``: ``(Rounds, step, replica)`` of a TensorFlow strategy whose
    replicas move the same rows, once for all
    (`keras_sparse.layers.row_storage.cache_replicas`); ``(Rounds, step)``
    of a JAX mesh over several processes, once per process
    (`keras_sparse.layers.row_storage.cache_jax_processes`)."""
    tier = layer.row_tier
    variables = {"table": layer.embeddings, **layer.slots}
    safe = ops.where(fresh, rows, ops.zeros_like(rows))
    # Read only: no gradient flows through the moves.
    before = {
        name: ops.stop_gradient(ops.take(var, safe, axis=0))
        for name, var in variables.items()
    }
    names = list(before)

    def host(step_rows, step_fresh, *values):
        filled, fills = tier.move(
            np.asarray(step_rows),
            np.asarray(step_fresh),
            {name: np.asarray(v) for name, v in zip(names, values)},
        )
        return (filled,) + tuple(fills[name] for name in names)

    args = [rows, fresh] + [before[name] for name in names]
    if rounds is not None:  # every replica asks; the first moves the rows
        once = _once(host, rounds[0])
        if keras.backend.backend() == "jax":
            filled, *fills = cache_jax_processes.each_device(
                once, _jax_shapes(args), *args, *rounds[1:]
            )
        else:
            filled, *fills = _tf_hop(once, args, list(rounds[1:]))
    elif not is_symbolic(rows):
        out = host(*(ops.convert_to_numpy(a) for a in args))
        filled, *fills = (ops.convert_to_tensor(x) for x in out)
    elif route == "cpu_buffers" and keras.backend.backend() == "jax":
        filled, *fills = _jax_buffer_hop(host, args)
    else:
        filled, *fills = _HOPS[keras.backend.backend()](host, args)
    _write_rows(variables, rows, filled, dict(zip(names, fills)))
    return filled


def _jax_shapes(args):
    """The results of a JAX hop of ``args`` (rows, fresh, rows' values):
    the filled flags and the filled rows' values."""
    import jax

    shapes = [jax.ShapeDtypeStruct(args[1].shape, "bool")]
    return shapes + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args[2:]]


def _jax_hop(host, args):
    import jax

    return jax.experimental.io_callback(host, _jax_shapes(args), *args, ordered=True)


def _jax_buffer_hop(host, args):
    """`_jax_hop` by an in-place buffer callback: no host copies and no
    ordering token, so the step keeps JAX's fast dispatch (an ordered
    ``io_callback`` costs milliseconds a step). Declared free of side
    effects, as the hash layer's mapping callback is (the step consumes
    the filled rows, so the callback runs once per step, in step order),
    except where Keras rematerializes the call."""

    from keras_sparse.layers.hash.jax_step_mapping import buffer_callback_or_none
    from keras_sparse.layers.hash.jax_step_mapping import rematerializing

    shapes = _jax_shapes(args)

    def callback(ctx, outputs, *inputs):
        got = host(*(np.asarray(x) for x in inputs))
        for out, value in zip(outputs, got):
            np.asarray(out)[...] = value

    hop = buffer_callback_or_none()(callback, shapes, has_side_effect=rematerializing())
    return hop(*args)


def _once(host, rounds):
    """``host`` taking the step and the replica's number last, run once
    per round."""

    def replicated(*args):
        *values, step, replica = args
        return rounds.run("move", replica, step, lambda: host(*values))

    return replicated


def _tf_hop(host, args, extra=()):
    import tensorflow as tf

    dtypes = [tf.bool] + [a.dtype for a in args[2:]]
    out = tf.numpy_function(host, list(args) + list(extra), dtypes, stateful=True)
    for x, a in zip(out, args[1:]):
        x.set_shape(a.shape)
    return out


_HOPS = {"jax": _jax_hop, "tensorflow": _tf_hop}


def _write_rows(variables, rows, filled, fills):
    """``variable[rows[filled]] = values[filled]`` for each variable, in
    place where the backend allows (the cost is the filled rows, not the
    table)."""
    backend = keras.backend.backend()
    if backend == "jax":
        # A reset whose backward passes the table's "gradient" through: a
        # plain scatter would zero the filled rows in the updated table the
        # lookup's backward hands back.
        state = {name: var.value for name, var in variables.items()}
        new = backend_module().reset_rows(state, rows, filled, fills)
        for name, var in variables.items():
            var.assign(new[name])
        return
    for name, variable in variables.items():
        values = ops.cast(fills[name], variable.dtype)
        if backend == "tensorflow":
            import tensorflow as tf

            tf_var = variable.value
            if not isinstance(tf_var, tf.Variable):
                tf_var = variable._value
            index = tf.boolean_mask(rows, filled)
            # scatter_update: the form a mirrored variable takes in a
            # replica's step (each replica writes its own copy).
            tf_var.scatter_update(
                tf.IndexedSlices(tf.boolean_mask(values, filled), index)
            )
        else:
            import torch

            with torch.no_grad():
                variable.value[rows[filled].long()] = values[filled]


def read_stored(layer, keys, rows):
    """``(found, values)`` of a read-only call: flat bool ``found`` where a
    key without a row in the table (``rows`` -1) is held by the layer's
    store, and ``[n, dim]`` its stored vector there (zeros elsewhere). The
    store is only read: inference never moves rows."""
    # Placements whose keys live on other processes read their owners'
    # stores themselves (PyTorch key sharding).
    owners = getattr(getattr(layer, "placement", None), "read_stored", None)
    if owners is not None:
        return owners(layer, keys, rows)
    tier = layer.row_tier
    flat = ops.reshape(keys, (-1,))
    dtype = layer.embeddings.dtype

    def host(step_keys, step_rows):
        step_keys = np.asarray(step_keys).reshape(-1)
        # The keys this call's mapping used (whole 64-bit keys on JAX
        # without x64, which the step itself sees truncated).
        full, tier.read_keys = tier.read_keys, None
        if (
            full is None
            or full.shape != step_keys.shape
            or not np.array_equal(full.astype(step_keys.dtype), step_keys)
        ):
            full = layer.full_keys(step_keys)
        full = np.asarray(full, np.int64).reshape(-1)
        return tier.read_missing(full, np.asarray(step_rows), dtype)

    return _read_hop(layer, host, flat, rows)


def read_stored_words(layer, words, rows):
    """`read_stored` for the prepared inputs of `keras_sparse.data.prefetch`:
    the keys come as int32 ``[n, 2]`` (high, low) words (`split_words`)."""
    tier = layer.row_tier
    dtype = layer.embeddings.dtype

    def host(step_words, step_rows):
        pairs = np.asarray(step_words).astype(np.int64).reshape(-1, 2)
        keys = (pairs[:, 0] << 32) | (pairs[:, 1] & 0xFFFFFFFF)
        return tier.read_missing(keys, np.asarray(step_rows), dtype)

    return _read_hop(layer, host, words, rows)


def _read_hop(layer, host, keys, rows):
    """``host(keys, rows) -> (found, values)`` run on the host: directly
    in eager calls, else by a host callback of the step."""
    dim = layer.output_dim
    dtype = layer.embeddings.dtype
    if not is_symbolic(rows):
        out = host(ops.convert_to_numpy(keys), ops.convert_to_numpy(rows))
        return tuple(ops.convert_to_tensor(x) for x in out)
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        shapes = [
            jax.ShapeDtypeStruct(rows.shape, "bool"),
            jax.ShapeDtypeStruct(tuple(rows.shape) + (dim,), dtype),
        ]
        return tuple(jax.experimental.io_callback(host, shapes, keys, rows))
    import tensorflow as tf

    found, values = tf.numpy_function(host, [keys, rows], [tf.bool, dtype])
    found.set_shape(rows.shape)
    values.set_shape(tuple(rows.shape) + (dim,))
    return found, values
