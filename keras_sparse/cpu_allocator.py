"""Keeps freed memory in the process for reuse, so CPU steps stop page-faulting.

XLA on a CPU (the JAX backend without an accelerator) runs each compiled
step in one temporary buffer allocated for that step and freed after it.
glibc serves allocations above 32 MiB with fresh pages from the kernel
(``mmap``), and every page faults on its first write: for the 26-table
benchmark (`benchmarks/peers.py`) that is 14,000 faults and ~20 ms of a
55 ms step, on every step. With freed memory kept for reuse the buffer
comes back from the heap already mapped and the step takes ~35 ms.

This changes the allocator of the whole process, so it is opt-in: call
`tune_cpu_allocator` once, before training. The cost is that memory a
program frees stays with the process (its resident size stays at its
peak) instead of returning to the system. TensorFlow and PyTorch
allocate per tensor and gain nothing measurable; PyTorch's threads
slow down slightly on the single shared allocator arena, so use it for
the JAX backend.
"""

import ctypes
import sys

# mallopt(3) parameters of glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# Tuned: never mmap, never trim, one arena (threads' own arenas are mmap'ed
# heaps that are unmapped when they shrink). Defaults: glibc's documented ones.
_TUNED = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: 2**31 - 1, _M_ARENA_MAX: 1}
_DEFAULTS = {_M_MMAP_MAX: 65536, _M_TRIM_THRESHOLD: 128 * 1024, _M_ARENA_MAX: 0}
# madvise(2) advice: back with transparent huge pages; collapse now (Linux 6.1+).
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_HUGE_PAGE = 2 << 20
_SETTINGS = {"huge_pages": False, "tuned": False}


def _mallopt():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).mallopt  # the C library the process runs on
    except (OSError, AttributeError):
        return None


def tune_cpu_allocator(enable=True, huge_pages=None):
    """Makes the C allocator keep freed memory for reuse (Linux, glibc).

    Recommended before training on the JAX backend on a CPU: XLA's
    per-step temporary buffer is then reused instead of being faulted in
    page by page on every step (see BENCHMARKS.md, "Side by side with
    TorchRec"). The setting is process-wide; memory freed later stays
    with the process. ``enable=False`` restores glibc's defaults.

    With ``huge_pages`` (default: as ``enable``), the embedding tables and
    optimizer slots that keras_sparse layers build afterwards on a CPU
    (every backend) are backed by 2 MiB transparent huge pages where the
    kernel allows it (``madvise``), so random row accesses to large tables
    miss the TLB less (`back_with_huge_pages`). PyTorch and TensorFlow
    programs gain nothing from the allocator settings: for them,
    ``tune_cpu_allocator(False, huge_pages=True)`` keeps glibc's defaults
    and asks for the huge pages alone.

    Returns:
        True if the allocator took the settings; False where there is no
        glibc ``mallopt`` (macOS, Windows, musl), which changes nothing
        there (huge pages are still asked for on Linux).

    Example:

    >>> import keras_sparse as ks
    >>> ks.tune_cpu_allocator() in (True, False)
    True
    >>> ks.tune_cpu_allocator(False) in (True, False)
    True
    """
    if huge_pages is None:
        huge_pages = enable
    _SETTINGS["huge_pages"] = bool(huge_pages) and sys.platform.startswith("linux")
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if not enable and not _SETTINGS["tuned"]:
        # Any mallopt call, even of the default values, would end glibc's
        # dynamic mmap threshold: leave an untouched allocator alone.
        return True
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    settings = _TUNED if enable else _DEFAULTS
    # musl and other C libraries may export a mallopt that accepts nothing.
    results = [mallopt(name, value) == 1 for name, value in settings.items()]
    # Partly tuned counts as tuned: disabling must then restore the rest.
    _SETTINGS["tuned"] = enable and any(results)
    return all(results)


def _madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def back_with_huge_pages(variables):
    """Asks the kernel to back the buffers of ``variables`` with huge pages.

    Only after ``tune_cpu_allocator(huge_pages=True)``, for CPU arrays on
    one device; the 2 MiB-aligned part of each buffer gets
    ``MADV_HUGEPAGE`` (future faults) and ``MADV_COLLAPSE`` (the pages
    already there, Linux 6.1+). The sparse updates write these buffers in
    place (JAX's compiled steps donate them, PyTorch and TensorFlow update
    rows in place), so the advice lasts while the variables keep them.
    Advice the kernel refuses changes nothing. Returns the bytes advised.
    """
    if not _SETTINGS["huge_pages"]:
        return 0
    madvise = _madvise()
    if madvise is None:
        return 0
    advised = 0
    for variable in variables:
        buffer = _cpu_buffer(variable)
        if buffer is None:
            continue
        start, nbytes = buffer
        lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
        hi = (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if hi <= lo:
            continue
        if madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0:
            madvise(lo, hi - lo, _MADV_COLLAPSE)  # may be refused: harmless
            advised += hi - lo
    return advised


def _cpu_buffer(variable):
    """``(address, bytes)`` of a Keras variable's buffer in CPU memory, or
    None (not built yet, on an accelerator, or spread over devices)."""
    import keras

    if getattr(variable, "_value", None) is None:
        return None  # not initialized yet: no buffer to advise
    backend = keras.backend.backend()
    try:
        if backend == "jax":
            value = variable.value
            if len(value.devices()) != 1 or value.device.platform != "cpu":
                return None
            return value.unsafe_buffer_pointer(), value.nbytes
        if backend == "torch":
            value = variable.value
            if value.device.type != "cpu" or not value.is_contiguous():
                return None
            return value.data_ptr(), value.numel() * value.element_size()
        if backend == "tensorflow":
            return _tf_cpu_buffer(variable)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return None


def _tf_cpu_buffer(variable):
    """The buffer of a Keras variable's local CPU ``tf.Variable``, by an
    eager read, which shares the variable's memory until its first sparse
    access (reads copy after that: call this as the variable is built).
    The read and its NumPy view are dropped before returning, so the
    variable's in-place updates do not copy the buffer."""
    import numpy as np
    import tensorflow as tf

    from keras_sparse.ops.tensorflow.native_rows import local_cpu

    tf_variable = variable._value  # the tf.Variable itself, not a read
    if (
        not isinstance(tf_variable, tf.Variable)
        # Mirrored or remote copies: not one buffer of this process.
        or isinstance(tf_variable, tf.distribute.DistributedValues)
        or not tf.executing_eagerly()
        or not local_cpu(tf_variable.device)
    ):
        return None
    addresses = set()
    for _ in range(2):
        view = np.asarray(tf_variable.read_value())
        if not view.flags.c_contiguous:
            return None
        addresses.add(view.ctypes.data)
        del view
    # Two reads at one address share the variable's buffer; after a sparse
    # access each read is a copy of its own, whose advice would be lost.
    if len(addresses) != 1:
        return None
    return addresses.pop(), tf_variable.shape.num_elements() * tf_variable.dtype.size
