"""Batch sources for `keras_sparse.data.prefetch`: one interface over NumPy
arrays, tf.data, generators/iterables, `keras.utils.PyDataset` and torch
DataLoaders. Every batch comes out as NumPy in Keras' batch structure
(``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``)."""

import numpy as np
from keras import tree

__all__ = ["Source", "make_source", "to_numpy"]


def to_numpy(x):
    """NumPy view of a tf/torch/jax/NumPy array (other leaves unchanged)."""
    if isinstance(x, np.ndarray) or x is None:
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch
        return x.detach().cpu().numpy()
    if hasattr(x, "numpy") and callable(x.numpy):  # tf eager
        return x.numpy()
    if hasattr(x, "__array__"):
        return np.asarray(x)
    return x


def _tree_numpy(batch):
    if isinstance(batch, list):
        batch = tuple(batch)
    return tree.map_structure(to_numpy, batch)


class Source:
    """``num_batches`` (int or None) and ``passes()`` -> iterator of batches.

    Each call of ``passes()`` starts a new pass (an epoch) over the data.
    One-shot iterators (Python generators) can serve one pass only; pass a
    callable that returns a fresh iterable for several epochs.
    """

    def __init__(self, iterate, num_batches, end_pass=None, one_shot=False):
        self._iterate = iterate
        self.num_batches = num_batches
        self._end_pass = end_pass
        self._one_shot = one_shot
        self._used = False

    def passes(self):
        if self._one_shot and self._used:
            raise RuntimeError(
                "prefetch: this source is a one-shot iterator (e.g. a Python "
                "generator) and was already consumed. Pass a callable that "
                "returns a fresh iterable to train for several epochs."
            )
        self._used = True
        return self._iterate()

    def end_pass(self):
        if self._end_pass is not None:
            self._end_pass()


def _array_source(x, y, sample_weight, batch_size, shuffle, seed):
    if batch_size is None:
        raise ValueError(
            "prefetch: `batch_size` is required when the source is in-memory "
            "arrays (dict/tuple/list of NumPy arrays)."
        )
    n = len(tree.flatten(x)[0])
    num_batches = -(-n // int(batch_size))
    pass_count = [0]

    def iterate():
        order = None
        if shuffle:
            rng = np.random.default_rng(None if seed is None else seed + pass_count[0])
            order = rng.permutation(n)
        pass_count[0] += 1
        for i in range(num_batches):
            if order is None:
                sl = slice(i * batch_size, (i + 1) * batch_size)
            else:
                sl = np.sort(order[i * batch_size : (i + 1) * batch_size])

            def take(a, sl=sl):
                return None if a is None else np.asarray(a)[sl]

            bx = tree.map_structure(take, x)
            if y is None and sample_weight is None:
                yield bx if isinstance(bx, dict) else (bx,)
            elif sample_weight is None:
                yield (bx, tree.map_structure(take, y))
            else:
                yield (
                    bx,
                    tree.map_structure(take, y),
                    tree.map_structure(take, sample_weight),
                )

    return Source(iterate, num_batches)


def _is_arrays(x):
    leaves = tree.flatten(x)
    return bool(leaves) and all(
        isinstance(a, np.ndarray) or (hasattr(a, "shape") and hasattr(a, "dtype"))
        for a in leaves
    )


def make_source(
    source,
    *,
    y=None,
    sample_weight=None,
    batch_size=None,
    steps=None,
    shuffle=False,
    seed=None,
):
    """Wraps ``source`` (see `keras_sparse.data.prefetch`) into a `Source`."""
    import keras

    if isinstance(source, Source):
        return source
    if isinstance(source, keras.utils.PyDataset):
        ds = source

        def iterate_pyds():
            count = ds.num_batches
            indices = range(count) if count is not None else _count()
            for i in indices:
                yield _tree_numpy(ds[i])

        return Source(iterate_pyds, ds.num_batches, end_pass=ds.on_epoch_end)
    tf_dataset = _tf_dataset_type()
    if tf_dataset is not None and isinstance(source, tf_dataset):
        card = int(source.cardinality())
        num = card if card >= 0 else None

        def iterate_tf():
            for batch in source.as_numpy_iterator():
                yield _tree_numpy(batch)

        return Source(iterate_tf, steps or num)
    torch_loader = _torch_loader_type()
    if torch_loader is not None and isinstance(source, torch_loader):

        def iterate_torch():
            for batch in source:
                yield _tree_numpy(batch)

        try:
            num = len(source)
        except TypeError:
            num = None
        return Source(iterate_torch, steps or num)
    # In-memory arrays: x (dict/list/array) with y=..., or (x, y[, sw]).
    if isinstance(source, dict) or (
        not isinstance(source, tuple) and isinstance(source, np.ndarray)
    ):
        return _array_source(source, y, sample_weight, batch_size, shuffle, seed)
    if isinstance(source, tuple) and source and _is_arrays(source):
        if y is None and len(source) in (2, 3):
            x, yy = source[0], source[1]
            sw = source[2] if len(source) == 3 else None
            return _array_source(x, yy, sw, batch_size, shuffle, seed)
        return _array_source(source, y, sample_weight, batch_size, shuffle, seed)
    if callable(source) and not hasattr(source, "__iter__"):

        def iterate_callable():
            for batch in source():
                yield _tree_numpy(batch)

        return Source(iterate_callable, steps)
    if hasattr(source, "__iter__"):
        one_shot = iter(source) is source
        try:
            num = len(source)
        except TypeError:
            num = None

        def iterate_iterable():
            for batch in source:
                yield _tree_numpy(batch)

        return Source(iterate_iterable, steps or num, one_shot=one_shot)
    raise TypeError(
        "prefetch: unsupported source of type "
        f"{type(source).__name__}; expected a dict/tuple of NumPy arrays, a "
        "tf.data.Dataset, a keras.utils.PyDataset, a torch DataLoader, an "
        "iterable/generator of batches or a callable returning one."
    )


def _count():
    i = 0
    while True:
        yield i
        i += 1


def _tf_dataset_type():
    import sys

    tf = sys.modules.get("tensorflow")
    if tf is None:
        return None
    return tf.data.Dataset


def _torch_loader_type():
    import sys

    if "torch" not in sys.modules:
        return None
    import torch.utils.data

    return torch.utils.data.DataLoader
