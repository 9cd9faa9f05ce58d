"""Which data-parallel replicas one process's batches go to.

In a multi-process JAX run each process feeds its part of every global
batch, and Keras splits that part over the process's own replicas; a
`route="locality"` stage can only place samples among those, so it routes
over them (`keras_sparse.data.routing.locality_assignment`'s ``local``).
"""

import keras
import numpy as np


def process_layout():
    """``(process index, process count)``; ``(0, 1)`` off JAX."""
    if keras.backend.backend() != "jax":
        return 0, 1
    import jax

    return jax.process_index(), jax.process_count()


def local_replicas(replicas):
    """This process's replicas among ``replicas``, in the order its batch's
    blocks go to them; None in a single process (all of them).

    Under a `keras.distribution` whose batch axis has ``replicas`` positions:
    the positions holding this process's devices, ascending (a process's part
    of a global batch fills its positions in order). Otherwise the ``p``-th
    of ``P`` equal blocks of positions.
    """
    me, count = process_layout()
    if count <= 1:
        return None
    local = _mesh_positions(replicas, me)
    if local is not None:
        return local
    if replicas % count:
        raise ValueError(
            f"prefetch: route='locality' across {count} processes needs "
            f"`replicas` to be a multiple of {count}; got {replicas}."
        )
    per = replicas // count
    return tuple(range(me * per, (me + 1) * per))


def _mesh_positions(replicas, me):
    """Positions on the active distribution's batch axis holding devices of
    process ``me``; None without a mesh whose batch axis has ``replicas``."""
    dist = keras.distribution.distribution()
    mesh = getattr(dist, "device_mesh", None)
    if mesh is None:
        return None
    names = list(mesh.axis_names)
    axis = getattr(dist, "batch_dim_name", None)
    devices = np.asarray(mesh.devices, dtype=object)
    if axis in names:
        devices = np.moveaxis(devices, names.index(axis), 0)
        devices = devices.reshape(devices.shape[0], -1)
    else:  # the batch is split over every device of the mesh
        devices = devices.reshape(-1, 1)
    if devices.shape[0] != replicas:
        return None
    return tuple(
        i for i, row in enumerate(devices) if any(_process(d) == me for d in row)
    )


def _process(device):
    """The process holding a mesh device (a JAX device or its ``"cpu:3"``)."""
    index = getattr(device, "process_index", None)
    if index is not None:
        return index
    import jax

    for d in jax.devices():
        if f"{d.platform}:{d.id}" == str(device):
            return d.process_index
    return None
