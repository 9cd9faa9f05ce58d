"""``cupy.random`` on the emulated device (NumPy's generator, device arrays)."""

import numpy as _np


def default_rng(seed=None):
    from . import ndarray

    rng = _np.random.default_rng(seed)

    class _Generator:
        def __getattr__(self, name):
            fn = getattr(rng, name)
            return lambda *a, **k: ndarray(_np.asarray(fn(*a, **k)))

    return _Generator()
