"""A NumPy-backed stand-in for CuPy, so GPU code paths run on a CPU machine.

Put ``tests/cuda_emulation/fake_cupy`` first on ``sys.path`` (see
``tests/cuda_emulation/run_gpu_suite.py``): ``import cupy`` then finds one
emulated device, `RawModule` compiles CUDA sources for the host
(``kernel_emulator``) and arrays live in host memory behind a device-array
type that behaves like CuPy's where a GPU program would go wrong:

* mixing a host (NumPy) array into a device operation raises TypeError, as
  CuPy does: a GPU cannot read host memory;
* ``np.asarray(device_array)`` raises TypeError (CuPy forbids the implicit
  copy); use ``.get()`` / ``cupy.asnumpy``;
* indexing one element returns a 0-d device array, not a host scalar;
* kernel arguments are checked for dtype, layout and constness.

``stats`` counts what costs time on a real GPU but not here: ``syncs``, the
host synchronizations (reads of a device value on the host: ``int()``,
``bool()``, ``.get()``, ``.item()``, and operations whose result size the
host must learn: boolean-mask indexing, ``unique``, ``flatnonzero``...);
``ops``, device operations (each at least one kernel launch); ``kernels``,
launches of RawModule kernels.
"""

from __future__ import annotations

import operator

import numpy as _np

from . import cuda  # noqa: F401
from . import random  # noqa: F401

__version__ = "0.0-emulated"
EMULATED = True

stats = {"syncs": 0, "ops": 0, "kernels": 0, "host_to_device": 0}

_HOST_ALLOWED = {"asarray", "array", "asanyarray", "ascontiguousarray"}
# Their result size is data-dependent: CuPy reads a count back to the host.
_SIZE_DEPENDENT = {"unique", "flatnonzero", "nonzero", "argwhere", "extract"}


class _HostArrayError(TypeError):
    pass


def _host_error(where):
    return _HostArrayError(
        f"{where}: a NumPy (host) array was passed where a device array is "
        "needed; convert it with cupy.asarray first (CuPy raises here too)."
    )


def _unwrap(x, where, allow_host=False):
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, _np.ndarray) and not allow_host:
        if x.ndim == 0:
            return x
        raise _host_error(where)
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, where, allow_host) for v in x)
    return x


def _wrap(x):
    if isinstance(x, _np.ndarray):
        return ndarray(x)
    if isinstance(x, _np.generic):
        return ndarray(_np.asarray(x))
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


def _sync():
    stats["syncs"] += 1


def _op(name=""):
    stats["ops"] += 1
    if name in _SIZE_DEPENDENT:
        _sync()


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class ndarray:
    """A device array: a NumPy array that only device operations may touch."""

    __slots__ = ("_a",)
    __array_priority__ = 100

    def __init__(self, data):
        if not isinstance(data, _np.ndarray):
            data = _np.asarray(data)
        self._a = data

    # -- NumPy protocols (NEP 13/18), as CuPy implements them
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        where = f"cupy.{ufunc.__name__}"
        _op()
        args = _unwrap(inputs, where)
        if "out" in kwargs:
            kwargs["out"] = _unwrap(kwargs["out"], where)
        return _wrap(getattr(ufunc, method)(*args, **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        where = f"cupy.{func.__name__}"
        _op(func.__name__)
        return _wrap(func(*_unwrap(args, where), **_unwrap(kwargs, where)))

    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use "
            "`.get()` to construct a NumPy array explicitly."
        )

    @property
    def data(self):
        """The device pointer (``.ptr``) as CuPy gives it: kernels may read
        pointers from device memory (descriptors), and host memory is the
        device here."""
        return _Pointer(self._a.__array_interface__["data"][0])

    @property
    def __cuda_array_interface__(self):
        iface = dict(self._a.__array_interface__)
        iface["version"] = 3
        return iface

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    # -- host reads (each one a synchronization on a GPU)
    def get(self, stream=None, order="C", out=None):
        _sync()
        return self._a.copy()

    def item(self):
        _sync()
        return self._a.item()

    def tolist(self):
        _sync()
        return self._a.tolist()

    def __int__(self):
        _sync()
        return int(self._a)

    def __float__(self):
        _sync()
        return float(self._a)

    def __bool__(self):
        _sync()
        return bool(self._a)

    def __index__(self):
        _sync()
        return operator.index(self._a)

    # -- array basics
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray(self._a.T))

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (ndarray(_np.asarray(v)) for v in self._a)

    def __repr__(self):
        return f"cupy(emulated).{self._a!r}"

    def __getitem__(self, key):
        key = _unwrap(key, "cupy indexing", allow_host=True)
        if _is_mask(key):
            _sync()  # the result's size is read back on a GPU
        result = self._a[key]
        if not _np.may_share_memory(result, self._a):
            _op()  # a gather (a basic-slice view launches nothing)
        return _wrap(result)

    def __setitem__(self, key, value):
        key = _unwrap(key, "cupy indexing", allow_host=True)
        if _is_mask(key):
            _sync()
        _op()
        self._a[key] = _unwrap(value, "cupy setitem", allow_host=True)

    def argsort(self, axis=-1):
        return argsort(self, axis=axis)

    def __getattr__(self, name):
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr)

        def method(*args, **kwargs):
            where = f"cupy.ndarray.{name}"
            _op(name)
            out = attr(*_unwrap(args, where), **_unwrap(kwargs, where))
            return _wrap(out)

        return method


def _is_mask(key):
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, _np.ndarray) and k.dtype == _np.bool_ for k in keys)


def _binary(op, reflected=False):
    def method(self, other):
        other = _unwrap(other, f"cupy operator {op.__name__}")
        _op()
        return _wrap(op(other, self._a) if reflected else op(self._a, other))

    return method


def _inplace(op):
    def method(self, other):
        _op()
        op(self._a, _unwrap(other, f"cupy operator {op.__name__}"))
        return self

    return method


for _name in (
    "add sub mul truediv floordiv mod pow lshift rshift and or xor "
    "lt le eq ne gt ge matmul"
).split():
    _operator = getattr(operator, _name if _name not in ("and", "or") else _name + "_")
    setattr(ndarray, f"__{_name}__", _binary(_operator))
    if _name not in ("lt", "le", "eq", "ne", "gt", "ge"):
        setattr(ndarray, f"__r{_name}__", _binary(_operator, reflected=True))
        setattr(ndarray, f"__i{_name}__", _inplace(getattr(operator, f"i{_name}")))
for _name in ("neg", "pos", "invert", "abs"):
    setattr(
        ndarray,
        f"__{_name}__",
        (lambda op: lambda self: ndarray(op(self._a)))(getattr(operator, _name)),
    )
ndarray.__hash__ = None


# -- module functions: NumPy's, on device arrays
def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    if _is_device_buffer(a) or hasattr(a, "__cuda_array_interface__"):
        return ndarray(_np.asarray(a, dtype=dtype))  # zero-copy view
    stats["host_to_device"] += 1
    return ndarray(_np.array(a, dtype=dtype, order=order or "K"))


def _is_device_buffer(a):
    # In emulation, XLA's callback buffers stand for device memory.
    return type(a).__name__ == "Buffer"


array = asanyarray = asarray


def ascontiguousarray(a, dtype=None):
    a = asarray(a, dtype=dtype)
    return ndarray(_np.ascontiguousarray(a._a))


def argsort(a, axis=-1):
    """CuPy sorts with a stable radix sort; NumPy's default is not stable."""
    _op()
    return _wrap(_np.argsort(_unwrap(a, "cupy.argsort"), axis=axis, kind="stable"))


def asnumpy(a, stream=None):
    return a.get() if isinstance(a, ndarray) else _np.asarray(a)


def from_dlpack(x):
    return ndarray(_np.from_dlpack(x))


fromDlpack = from_dlpack


def get_array_module(*args):
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


class _MemoryPool:
    def __init__(self):
        self._limit = 0

    def set_limit(self, size=None, fraction=None):
        self._limit = size if size is not None else int(fraction * (16 << 30))

    def get_limit(self):
        return self._limit

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_all_blocks(self):
        pass


_POOL = _MemoryPool()


def get_default_memory_pool():
    return _POOL


class RawModule:
    """``cupy.RawModule`` on the host: the kernels run in ``kernel_emulator``."""

    def __init__(self, code=None, options=(), **kwargs):
        from tests.cuda_emulation.kernel_emulator import compile_module

        self._module = compile_module(code)

    def get_function(self, name):
        kernel = self._module.get_function(name)

        def launch(grid, block, args, enable_cooperative_groups=False, **kwargs):
            stats["kernels"] += 1
            where = f"kernel {name}"
            args = tuple(_unwrap(a, where) for a in args)
            kernel(
                grid, block, args, enable_cooperative_groups=enable_cooperative_groups
            )

        return launch


def __getattr__(name):
    target = getattr(_np, name)
    if not callable(target) or isinstance(target, type):
        return target  # dtypes, scalar types, constants

    def function(*args, **kwargs):
        where = f"cupy.{name}"
        _op(name)
        allow = name in _HOST_ALLOWED
        return _wrap(
            target(*_unwrap(args, where, allow), **_unwrap(kwargs, where, allow))
        )

    function.__name__ = name
    return function
