"""A table with ``cache_rows`` under a Keras distribution spanning several
JAX processes: a copy of the cache in every process, all equal.

As under torch.distributed (`cache_processes`), each process holds its own
id map, store and copy of the replicated cache variables, started from
identical contents (`cache_processes.shared_seed`, checked by
`cache_processes.check_copies` before ``fit``, ``evaluate`` or ``predict``
takes the model's state). A training step reaches the host through
`each_device`: inside a ``shard_map`` over the whole mesh every device
receives the step's whole global batch of ids (replicated: an all-gather in
the mesh order, the same on every device) and calls the host itself, on
the process that holds it. The first of a process's devices to ask maps the
batch and moves its rows (`cache_replicas.Rounds`), the others get the same
answer; every process maps the same ids in the same order, so every copy
makes the same mapping, fills and write-backs, and each device writes the
filled rows into its own copy of the variables.

Read-only calls (inference) keep the one-process route: their callback
runs on the mesh's first device, whose process's copy equals every other.
"""

import numpy as np

_KEY_PREFIX = "keras_sparse/"


def active():
    """True under a Keras distribution over the devices of several JAX
    processes."""
    import keras

    if keras.backend.backend() != "jax" or _mesh() is None:
        return False
    import jax

    return jax.process_count() > 1


def _mesh():
    import keras

    dist = keras.distribution.distribution()
    mesh = getattr(dist, "device_mesh", None)
    return None if mesh is None else mesh.backend_mesh


def local_devices():
    """How many of the mesh's devices this process holds (the callers of
    each round of host work, `cache_replicas.Rounds`)."""
    import jax

    me = jax.process_index()
    return sum(d.process_index == me for d in _mesh().devices.flat)


def each_device(host, result_types, *args):
    """``host(*args, device)`` on every device of the mesh, each given the
    whole (replicated) traced ``args`` and its own linear position in the
    mesh; its results, the same on every device, as replicated arrays."""
    import jax
    from jax.experimental import io_callback
    from jax.sharding import PartitionSpec as P

    mesh = _mesh()
    axes = tuple(mesh.axis_names)
    result_types = tuple(result_types)

    def body(*values):
        device = jax.lax.axis_index(axes)
        # Unordered: each result feeds the step, which orders what follows;
        # an ordered callback needs one device.
        return tuple(io_callback(host, result_types, *values, device, ordered=False))

    return _shard_map()(
        body,
        mesh=mesh,
        in_specs=tuple(P() for _ in args),
        out_specs=tuple(P() for _ in result_types),
        # Every device computes the same results, which JAX cannot prove.
        check_vma=False,
    )(*args)


def _shard_map():
    import jax

    try:  # jax >= 0.6
        return jax.shard_map
    except AttributeError:  # pragma: no cover - older jax
        from jax.experimental.shard_map import shard_map

        return shard_map


def gather_batch(ids):
    """Every process's ``ids`` (equal shapes: a Keras distribution's local
    batches) concatenated in process order: the global batch, the same in
    every process."""
    from jax.experimental import multihost_utils

    ids = np.asarray(ids)
    return np.asarray(multihost_utils.process_allgather(ids, tiled=True))


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def compare_set(key, value):
    """The value first stored under ``key`` in the processes' key-value
    store (``value`` when this process is first)."""
    client = _client()
    key = _KEY_PREFIX + key
    try:
        client.key_value_set(key, value)
    except Exception:  # noqa: BLE001  (already set by another process)
        pass
    return client.blocking_key_value_get(key, 60_000)


def all_gather_object(key, value):
    """Every process's ``value`` (a JSON-able object), in process order,
    through the processes' key-value store under ``key``."""
    import json

    import jax

    client = _client()
    key = _KEY_PREFIX + key
    client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
    return [
        json.loads(client.blocking_key_value_get(f"{key}/{i}", 300_000))
        for i in range(jax.process_count())
    ]
