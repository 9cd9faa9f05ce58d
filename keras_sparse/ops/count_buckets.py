"""Work sized to a data-dependent count, with static shapes.

A step often touches far fewer rows than it has positions: a Zipf batch of
16K ids per field has a few percent distinct ids, and fewer fresh ones. The
arrays of a compiled step need static shapes, so work whose natural size is a
count is done in the smallest of a few fixed sizes that holds the count
(``n/32, n/8, n/2, n``), selected by `keras.ops.switch`.

On CPUs the branch is free and the smaller sizes save real time. On
accelerators the full size is cheap while a data-dependent branch costs a
device-to-host sync, so there the largest size is always used.
"""

import keras
from keras import ops

# Fractions of ``n`` the sizes are (largest last).
FRACTIONS = (32, 8, 2, 1)
# None: decide by device (`sized_by_count`); True/False force it (tests and
# benchmarks compare both on any machine).
FORCE_SIZED = None


# Below this many positions a sized branch saves little and still costs its
# compile time (one copy of the work per size), see `sized_by_count`.
MIN_SIZED_POSITIONS = 8192


def sized_by_count(under_distribution=True, n=None):
    """Whether to size work to its count (CPU) or always use ``n``.

    ``under_distribution=False``: also ``n`` while a `keras.distribution` is
    active on JAX. The step is then partitioned over devices, and a branch on
    a global count makes XLA gather or reduce the branch's operands (extra
    collectives per step); use it for work whose values do not depend on the
    size chosen. ``n`` (the positions, when known): below
    `MIN_SIZED_POSITIONS` also ``n``, since every size compiles its own copy
    of the work.
    """
    if FORCE_SIZED is not None:
        return bool(FORCE_SIZED)
    if isinstance(n, int) and n < MIN_SIZED_POSITIONS:
        return False
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        if jax.default_backend() != "cpu":
            return False
        return under_distribution or keras.distribution.distribution() is None
    if backend == "torch":
        import torch

        return not torch.cuda.is_available()
    if backend == "tensorflow":
        import tensorflow as tf

        return not tf.config.list_logical_devices("GPU")
    return True


def bucket_sizes(n):
    """Ascending sizes for ``n`` positions (an int, or a tensor when unknown)."""
    if isinstance(n, int):
        return [max(1, -(-n // d)) for d in FRACTIONS]
    return [ops.maximum((n + d - 1) // d, 1) for d in FRACTIONS]


def switch_on_count(count, sizes, make_branch, sized=None):
    """``make_branch(size)()`` for the smallest of ``sizes`` holding ``count``.

    Every branch must return the same structure and shapes. ``sized=False``
    (default: `sized_by_count`) runs the largest size without a branch.
    """
    if sized is None:
        sized = sized_by_count()
    if not sized:
        return make_branch(sizes[-1])()
    # Equal sizes (small n) select equal branches, so no deduplication needed.
    index = sum(ops.cast(ops.greater(count, s), "int32") for s in sizes[:-1])
    return ops.switch(index, [make_branch(s) for s in sizes])
