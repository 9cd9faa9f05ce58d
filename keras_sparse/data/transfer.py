"""Host -> device copies of prepared batches, done in the stage's workers.

When the model runs on an accelerator, copying each batch to the device is
input-side work like the table calls: done in a worker thread it overlaps
the running step instead of delaying the next one. Keras passes arrays that
are already on the device through unchanged.

Backends:

- JAX, no active `keras.distribution`: ``jax.device_put`` to the default
  device (uncommitted, so the compiled step is the one NumPy inputs get).
  Under a distribution the batch stays in NumPy: Keras splits it
  over the mesh itself (``make_array_from_process_local_data``), and a
  second copy from device arrays would only add work.
- PyTorch: ``torch.as_tensor`` then ``.to(device, non_blocking=True)`` from
  pinned memory, to Keras' torch device.
- TensorFlow: none (Keras feeds a PyDataset through ``tf.data``, which makes
  its own tensors); ``transfer=True`` is accepted and does nothing.

``transfer="auto"`` (the default) copies only when the default device is
not the CPU: on a CPU the "device" is host memory and the copy buys nothing.
"""

import keras
import numpy as np


def _accelerator():
    """True when Keras' backend computes on a GPU/TPU by default."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.default_backend() != "cpu"
    if backend == "torch":
        from keras.src.backend.torch.core import get_device

        return str(get_device()) != "cpu"
    return False


def _jax_copy():
    if keras.distribution.distribution() is not None:
        return None
    import jax

    def copy(a):
        # No device argument: the array lands on the default device but stays
        # *uncommitted*, like a NumPy input. A committed array would change
        # the shardings jit sees and cost extra compilations of the step.
        return jax.device_put(a)

    return copy


def _torch_copy():
    import torch
    from keras.src.backend.torch.core import get_device

    device = torch.device(get_device())
    pin = device.type == "cuda"

    def copy(a):
        t = torch.as_tensor(a)
        if pin:
            t = t.pin_memory()
        return t.to(device, non_blocking=pin)

    return copy


def batch_copier(transfer):
    """A function copying a ``(x, y, sw)`` batch to the device, or None.

    Args:
        transfer: True, False or ``"auto"`` (copy when the default device
            is an accelerator).
    """
    if transfer not in (True, False, "auto"):
        raise ValueError(
            f"prefetch: `transfer` must be True, False or 'auto'; got {transfer!r}"
        )
    if transfer == "auto":
        transfer = _accelerator()
    if not transfer:
        return None
    backend = keras.backend.backend()
    make = {"jax": _jax_copy, "torch": _torch_copy}.get(backend)
    copy = make() if make is not None else None
    if copy is None:
        return None

    def move(a):
        if isinstance(a, np.ndarray) and a.dtype != object:
            return copy(a)
        return a

    def copy_batch(batch):
        return keras.tree.map_structure(move, batch)

    return copy_batch
