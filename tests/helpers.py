"""Small model builders shared by the layer tests."""

import keras
import numpy as np


def pooled_model(layer, bag, dtype="int32"):
    """ids [batch, bag] -> layer -> sum over features -> [batch, 1]."""
    ids = keras.Input((bag,), dtype=dtype)
    x = layer(ids)
    while len(x.shape) > 2:
        x = keras.layers.Flatten()(x)
    out = keras.layers.Lambda(lambda t: keras.ops.sum(t, axis=-1, keepdims=True))(x)
    return keras.Model(ids, out)


def random_batches(num_rows, batch, bag, steps, seed=0, cover_all=False):
    rng = np.random.default_rng(seed)
    xs = []
    for _ in range(steps):
        x = rng.integers(0, num_rows, size=(batch, bag))
        if cover_all:
            flat = x.reshape(-1)
            flat[:num_rows] = rng.permutation(num_rows)
            x = flat.reshape(batch, bag)
        xs.append(x)
    x = np.concatenate(xs).astype("int32")
    y = rng.normal(size=(x.shape[0], 1)).astype("float32")
    return x, y


class _StepLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def fit_losses(model, x, y, batch_size):
    """One unshuffled epoch of ``model.fit``; the loss of every step."""
    rec = _StepLosses()
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0, callbacks=[rec])
    return rec.losses


def docs_code(page, heading):
    """The first ```python block after ``heading`` in ``page`` (from the root)."""
    from tests import docs_blocks

    lines = (docs_blocks.ROOT / page).read_text().split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith(heading)) + 1
    blocks = docs_blocks.blocks(page)
    return next(b.code for b in blocks if b.language == "python" and b.line > at)


def numpy_adagrad(table, acc, ids, valid, grads, lr, eps):
    """A dict model of one sparse Adagrad step (duplicates summed first),
    in float64: ``(new table, new accumulator)``."""
    table, acc = table.astype(np.float64), acc.astype(np.float64)
    summed = {}
    for i, ok, g in zip(ids, valid, grads):
        if ok:
            summed[i] = summed.get(i, 0.0) + g.astype(np.float64)
    for i, g in summed.items():
        acc[i] += g * g
        table[i] -= lr * g / np.sqrt(acc[i] + eps)
    return table, acc


def adagrad_case_strategies():
    """Hypothesis strategies for `adagrad_case`'s arguments."""
    from hypothesis import strategies as st

    return dict(
        seed=st.integers(0, 2**16),
        n=st.integers(0, 200),
        num_rows=st.integers(1, 30),
        invalid_share=st.sampled_from([0.0, 0.3, 1.0]),
        prepared=st.booleans(),
    )


def adagrad_case(seed, n, num_rows, invalid_share, prepared):
    """Random ``(table, acc, ids, valid, grads, segments)`` for an update;
    ``segments`` (with ``prepared``) numbers the distinct keys (ids where
    valid, else ``num_rows``) densely in a random order, as the input stage
    does; else None."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(num_rows, 3)).astype("float32")
    acc = rng.uniform(0.1, 1.0, (num_rows, 3)).astype("float32")
    ids = rng.integers(0, num_rows, n).astype("int32")
    valid = rng.random(n) >= invalid_share
    grads = rng.normal(size=(n, 3)).astype("float32")
    segments = None
    if prepared:
        keys = np.where(valid, ids, num_rows)
        number = {k: i for i, k in enumerate(rng.permutation(np.unique(keys)))}
        segments = np.array([number[k] for k in keys], "int64")
    return table, acc, ids, valid, grads, segments


def max_gap(a, b):
    """Largest gap between two dicts of arrays (model states, record sets),
    key by key; inf when their keys or an array's shape differ."""
    if a.keys() != b.keys():
        return float("inf")
    gaps = [0.0]
    for k in a:
        if np.shape(a[k]) != np.shape(b[k]):
            return float("inf")
        diff = np.abs(np.asarray(a[k], float) - np.asarray(b[k], float))
        gaps.append(float(diff.max(initial=0.0)))
    return max(gaps)


def replica_shapes(strategy, layer):
    """Each stacked table variable of ``layer`` (an `EmbeddingCollection`):
    the shape of its part on every replica of the tf.distribute
    ``strategy``."""
    local = strategy.experimental_local_results
    return {
        v.name: [list(c.shape) for c in local(v.value)]
        for v in layer.weights
        if v.name.startswith("stack_")
    }
