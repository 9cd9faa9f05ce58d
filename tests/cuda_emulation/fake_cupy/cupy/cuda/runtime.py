"""``cupy.cuda.runtime`` of the emulated device."""


class CUDARuntimeError(RuntimeError):
    pass


def getDeviceCount():  # noqa: N802  (CuPy's name)
    """One emulated device, or none where no C++ compiler can build kernels."""
    from tests.cuda_emulation.kernel_emulator import CXX

    return 0 if CXX is None else 1


def deviceSynchronize():  # noqa: N802
    pass
