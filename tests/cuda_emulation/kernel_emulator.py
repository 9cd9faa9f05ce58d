"""Compiles a CUDA source for the host and launches its kernels from Python.

`compile_module(source)` builds the unchanged source with ``g++`` against
``emu_cuda.h`` (one fiber per GPU thread, see there) plus a generated
``emu_<kernel>`` launcher per ``extern "C" __global__`` kernel, and returns an
object whose ``get_function(name)(grid, block, args)`` call matches
``cupy.RawKernel``. Arguments are checked the way a GPU would need them to be
right, where CuPy itself would pass them on unchecked: an array's dtype must
match the pointer's element type, be C-contiguous and writable when the
kernel may write it, and a scalar's dtype must match the parameter exactly.

    >>> src = 'extern "C" __global__ void twice(int* x, int n) {'
    >>> src += ' int i = blockIdx.x * blockDim.x + threadIdx.x;'
    >>> src += ' if (i < n) x[i] *= 2; }'
    >>> x = np.arange(5, dtype=np.int32)
    >>> compile_module(src).get_function("twice")((1,), (32,), (x, np.int32(5)))
    >>> x.tolist()
    [0, 2, 4, 6, 8]
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import threading

import numpy as np

HEADER = pathlib.Path(__file__).resolve().parent / "emu_cuda.h"
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")

_C_TYPES = {
    "char": np.int8,
    "signed char": np.int8,
    "unsigned char": np.uint8,
    "short": np.int16,
    "unsigned short": np.uint16,
    "int": np.int32,
    "unsigned int": np.uint32,
    "unsigned": np.uint32,
    "long long": np.int64,
    "unsigned long long": np.uint64,
    "int64_t": np.int64,
    "uint64_t": np.uint64,
    "float": np.float32,
    "double": np.float64,
    "bool": np.bool_,
}
_CTYPES_OF = {
    np.dtype(np.int8): ctypes.c_int8,
    np.dtype(np.uint8): ctypes.c_uint8,
    np.dtype(np.int16): ctypes.c_int16,
    np.dtype(np.uint16): ctypes.c_uint16,
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float,
    np.dtype(np.float64): ctypes.c_double,
    np.dtype(np.bool_): ctypes.c_bool,
}
# A 1-byte bool array is passed where a kernel declares unsigned char*.
_SAME_BYTES = {(np.dtype(np.uint8), np.dtype(np.bool_))}

_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?'
    r"(\w+)\s*\(([^)]*)\)"
)
_TYPEDEF = re.compile(r"typedef\s+([\w\s]+?)\s+(\w+)\s*;")
_COMPILE_LOCK = threading.Lock()


class KernelArgumentError(TypeError):
    """An argument a GPU would have misread (wrong dtype, layout, constness)."""


class EmulatedLaunchError(RuntimeError):
    """The emulator found behaviour undefined on a GPU (e.g. divergent ballot)."""


class Param:
    """One kernel parameter: name, element dtype, pointer or not, const or not."""

    def __init__(self, decl, typedefs):
        words = decl.replace("*", " * ").split()
        self.name = words[-1]
        self.pointer = "*" in words
        self.const = "const" in words
        base = " ".join(
            w for w in words[:-1] if w not in ("const", "*", "__restrict__")
        )
        base = typedefs.get(base, base)
        if base not in _C_TYPES:
            raise ValueError(f"emulator: unsupported parameter type {decl!r}")
        self.dtype = np.dtype(_C_TYPES[base])
        self.decl = decl.strip()


class EmulatedKernel:
    """``kernel(grid, block, args)`` as with ``cupy.RawKernel``."""

    def __init__(self, lib, name, params):
        self.name = name
        self.params = params
        self._fn = getattr(lib, f"emu_{name}")
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_char_p, ctypes.c_int]
        self._fn.argtypes += [ctypes.c_int]
        self._fn.argtypes += [
            ctypes.c_void_p if p.pointer else _CTYPES_OF[p.dtype] for p in params
        ]

    def __call__(self, grid, block, args, enable_cooperative_groups=False, **unused):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        if len(args) != len(self.params):
            raise KernelArgumentError(
                f"{self.name}: {len(self.params)} arguments expected, got {len(args)}"
            )
        converted = [self._convert(p, a) for p, a in zip(self.params, args)]
        err = ctypes.create_string_buffer(512)
        cooperative = int(bool(enable_cooperative_groups))
        if self._fn(*grid, *block, err, len(err), cooperative, *converted):
            raise EmulatedLaunchError(f"{self.name}: {err.value.decode()}")

    def _convert(self, param, arg):
        where = f"{self.name}: parameter `{param.decl}`"
        if param.pointer:
            arr = arg if isinstance(arg, np.ndarray) else None
            if arr is None:
                raise KernelArgumentError(
                    f"{where} needs an array, got {type(arg).__name__}"
                )
            ok = arr.dtype == param.dtype or (param.dtype, arr.dtype) in _SAME_BYTES
            if not ok:
                raise KernelArgumentError(
                    f"{where} needs {param.dtype} elements, got an array of {arr.dtype}"
                )
            if not arr.flags.c_contiguous:
                raise KernelArgumentError(f"{where} got a non-contiguous array")
            if not param.const and not arr.flags.writeable:
                raise KernelArgumentError(f"{where} may be written: read-only array")
            return arr.ctypes.data
        if isinstance(arg, np.ndarray) or not isinstance(arg, (np.generic, int)):
            raise KernelArgumentError(
                f"{where} needs a NumPy scalar of {param.dtype}, got "
                f"{type(arg).__name__}"
            )
        dtype = np.dtype(np.int64) if isinstance(arg, int) else arg.dtype
        if dtype != param.dtype:
            raise KernelArgumentError(
                f"{where} needs a {param.dtype} scalar, got {dtype} (a GPU "
                "would read the wrong bytes)"
            )
        return _CTYPES_OF[param.dtype](arg)


class EmulatedModule:
    """The kernels of one compiled source, by name (``cupy.RawModule``-like)."""

    def __init__(self, lib, kernels):
        self._kernels = {
            name: EmulatedKernel(lib, name, params) for name, params in kernels.items()
        }

    def get_function(self, name):
        return self._kernels[name]


def kernel_params(source):
    """``{kernel name: [Param]}`` of the ``extern "C" __global__`` kernels."""
    typedefs = {alias: " ".join(t.split()) for t, alias in _TYPEDEF.findall(source)}
    return {
        name: [Param(d, typedefs) for d in params.split(",") if d.strip()]
        for name, params in _KERNEL.findall(source)
    }


def _launchers(kernels):
    parts = []
    for name, params in kernels.items():
        decls = "".join(f", {p.decl}" for p in params)
        names = ", ".join(p.name for p in params)
        parts.append(
            f'extern "C" int emu_{name}(unsigned gx, unsigned gy, unsigned gz, '
            f"unsigned bx, unsigned by, unsigned bz, char* err, int err_len, "
            f"int cooperative"
            f"{decls}) {{\n"
            f"  return ks_emu::launch({{gx, gy, gz}}, {{bx, by, bz}}, "
            f"[=] {{ {name}({names}); }}, err, err_len, cooperative);\n}}\n"
        )
    return "\n".join(parts)


def _cache_dir():
    path = pathlib.Path(tempfile.gettempdir()) / f"keras_sparse_emu_{os.getuid()}"
    path.mkdir(exist_ok=True)
    return path


_MODULES = {}


def compile_module(source):
    """An `EmulatedModule` of ``source`` (compiled once per source text)."""
    if CXX is None:
        raise RuntimeError("emulator: no C++ compiler (g++ or clang++) found")
    kernels = kernel_params(source)
    text = source + "\n\n" + _launchers(kernels)
    flags = [
        "-std=c++17",
        "-O1",
        "-fPIC",
        "-shared",
        "-pthread",
        "-include",
        str(HEADER),
    ]
    digest = hashlib.sha256(
        (HEADER.read_text() + text + " ".join(flags) + CXX).encode()
    ).hexdigest()[:24]
    with _COMPILE_LOCK:
        if digest in _MODULES:
            return _MODULES[digest]
        lib_path = _cache_dir() / f"{digest}.so"
        if not lib_path.exists():
            with tempfile.TemporaryDirectory(dir=_cache_dir()) as work:
                cu = pathlib.Path(work) / "kernels.cpp"
                cu.write_text(text)
                out = pathlib.Path(work) / "k.so"
                proc = subprocess.run(
                    [CXX, *flags, str(cu), "-o", str(out)],
                    capture_output=True,
                    text=True,
                )
                if proc.returncode:
                    raise RuntimeError(f"emulator: compile failed\n{proc.stderr}")
                os.replace(out, lib_path)  # atomic for concurrent test runs
        module = EmulatedModule(ctypes.CDLL(str(lib_path)), kernels)
        _MODULES[digest] = module
        return module
