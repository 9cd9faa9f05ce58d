"""tune_cpu_allocator: a freed large buffer comes back without page faults."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's mallopt"
)

# Allocates, writes and frees a 64 MiB buffer twice (as XLA:CPU does with a
# step's temporary buffer); prints the minor page faults of the second time.
_SCRIPT = textwrap.dedent(
    """
    import ctypes, importlib.util, resource
    # The module alone (the package would import Keras and a backend).
    spec = importlib.util.spec_from_file_location("cpu_allocator", {path!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    took = module.tune_cpu_allocator() if {tune} else None
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = (ctypes.c_void_p,)
    size = 64 << 20
    def cycle():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        libc.free(p)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    cycle()
    print(took, cycle())
    """
)


def _second_cycle_faults(tune):
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    path = str(root / "keras_sparse" / "cpu_allocator.py")
    code = _SCRIPT.format(path=path, tune=tune)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1])


def test_tuned_allocator_reuses_a_freed_large_buffer():
    took, faults = _second_cycle_faults(tune=True)
    if took != "True":
        pytest.skip("no glibc mallopt here")
    # 64 MiB is 16384 pages; reused memory faults (almost) none of them.
    assert faults < 100


def test_default_allocator_faults_the_buffer_in_again():
    # What the tuning is for (and proof the check above can fail).
    _, faults = _second_cycle_faults(tune=False)
    assert faults > 10000


def test_defaults_can_be_restored():
    import keras_sparse as ks

    assert ks.tune_cpu_allocator(False) in (True, False)


# Builds a 200,000-row table on this run's backend's CPU and trains it two
# epochs; prints whether tuning took, the bytes advised, whether the kernel
# marked the table's memory for huge pages ("hg"), and the process's
# huge-page bytes before and after training (a table moved to a copy by
# its updates would leave its huge pages behind).
_HUGE_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import keras
    import keras_sparse as ks
    from keras_sparse import cpu_allocator
    took = ks.tune_cpu_allocator({enable}, huge_pages={huge})
    layer = ks.AllToAllDenseEmbedding(
        200_000, 16, combiner="sum", optimizer="adagrad"
    )
    inputs = keras.Input((2,), dtype="int32")
    model = keras.Model(inputs, layer(inputs))
    # Before any update (TensorFlow's reads copy after a sparse access).
    buffer = cpu_allocator._cpu_buffer(layer.embeddings)
    if buffer is None:
        print("not-on-the-cpu")
        raise SystemExit(0)
    start = buffer[0]
    advised = cpu_allocator.back_with_huge_pages([layer.embeddings])
    def huge_bytes():
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    flags = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= start + (4 << 20) < hi
        elif head == "VmFlags:" and inside:
            flags = line.split()[1:]
    before = huge_bytes()
    model.compile(optimizer="sgd", loss="mse")
    ids = np.arange(64, dtype="int32").reshape(32, 2)
    model.fit(ids, np.ones((32, 16)), batch_size=8, epochs=2, verbose=0)
    print(took, advised, "hg" in (flags or []), before, huge_bytes())
    """
)


@pytest.mark.parametrize(
    "enable, huge, marked",
    [
        (True, None, True),
        (True, False, False),
        (False, True, True),
        (False, None, False),
    ],
)
def test_huge_pages_back_the_tables_built_after_tuning(enable, huge, marked):
    """With ``huge_pages`` (by default as ``enable``) the kernel marks a
    table's memory for 2 MiB pages (VmFlags "hg") on this run's backend,
    and training keeps the table there; without it, it does not."""
    out = subprocess.run(
        [sys.executable, "-c", _HUGE_SCRIPT.format(enable=enable, huge=huge)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if out == ["not-on-the-cpu"]:
        pytest.skip("this backend's tables are not in CPU memory")
    if out[0] != "True":
        pytest.skip("no glibc mallopt here")
    advised, before, after = int(out[1]), int(out[3]), int(out[4])
    assert (out[2] == "True") == marked
    assert (advised > 0) == marked  # 10 MiB: whole 2 MiB pages inside
    if marked and before >= advised:
        # The kernel collapsed the table into huge pages (where it will:
        # Linux 6.1+), and the in-place updates kept it on them.
        assert after >= advised
