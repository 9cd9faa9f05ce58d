"""Keras callbacks of keras_sparse.

`DeltaExport` writes delta checkpoints of a model's hash layers
(`keras_sparse.layers.hash.deltas`) and fixed-vocabulary tables
(`keras_sparse.layers.dense_deltas`) while it trains.
"""

import os
import re

import keras
import numpy as np

from keras_sparse.atomic_files import atomic_path
from keras_sparse.layers.hash.deltas import FULL
from keras_sparse.layers.hash.deltas import apply_delta
from keras_sparse.layers.hash.deltas import trained_step
from keras_sparse.layers.hash.serving_map import hash_layers

_NAME = re.compile(r"^(?P<layer>.+)\.(?P<step>\d{8,})\.(?P<kind>full|delta)\.npz$")


class _Source:
    """One table `DeltaExport` writes: a hash layer, an
    `AllToAllDenseEmbedding` or a collection's table (named
    ``"<collection>/<table>"``, its files in a folder of the collection)."""

    def __init__(self, layer, table=None):
        self.layer, self.table = layer, table
        self.name = layer.name if table is None else f"{layer.name}/{table}"
        self.hashed = getattr(layer, "keras_sparse_kind", None) == "hash"

    def export(self, since):
        if self.table is not None:
            return self.layer.export(since_step=since, tables=[self.table])[self.table]
        return self.layer.export(since_step=since)

    def trained_step(self):
        return trained_step(self.layer) if self.hashed else self.layer._step()

    def forget(self, step):
        if self.hashed:  # a fixed vocabulary removes no keys
            self.layer.forget_removals(step)


def _tracked_sources(model):
    """``{name: _Source}`` of every table of ``model`` that can give
    deltas, and the names of those that could but do not track."""
    found, untracked = {}, []
    for layer in hash_layers(model):
        if layer.table.track_changes:
            found[layer.name] = _Source(layer)
        else:
            untracked.append(layer.name)
    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=True, recursive=True)) if flatten else [model]
    for layer in layers:
        if getattr(layer, "keras_sparse_kind", None) != "fixed":
            continue
        if not getattr(layer, "track_changes", False):
            untracked.append(layer.name)
        elif isinstance(getattr(layer, "tables", None), dict):
            for table in layer.tables:
                source = _Source(layer, table)
                found[source.name] = source
        else:
            found[layer.name] = _Source(layer)
    return found, untracked


class DeltaExport(keras.callbacks.Callback):
    """Writes ``<layer>.<step>.full.npz`` then ``<layer>.<step>.delta.npz``
    files of each table built with ``track_changes=True``: hash layers,
    `AllToAllDenseEmbedding` layers and `EmbeddingCollection` tables (as
    ``<collection>/<table>.<step>....npz``, their layer name
    ``"<collection>/<table>"``).

    At the start of ``fit`` a layer with no file in ``directory`` gets a
    full one (every record, `export(since_step=-1)`); a layer with files
    continues its chain from the newest. Then every ``every_n_steps``
    training steps, and at the end of ``fit``, it gets
    a delta since that file (`export(since_step=...)`), ending at the
    layer's last trained step (none when it has not moved). Each file is written
    under a temporary name and renamed, so a reader sees whole files only;
    each holds what describes it (``layer``, ``since_step``, ``step``,
    ``dtype``), and `keras_sparse.apply_delta` refuses one applied out of
    order or to another layer. `read` applies a layer's chain.

    Args:
        directory: folder of the files (created if missing).
        every_n_steps: int >= 1, the training steps between deltas.
        layers: names of the layers to export, a collection's tables as
            ``"<collection>/<table>"`` or the collection's name for all its
            tables (None: every table of the model with
            ``track_changes=True``).
        forget_removals: after each file, drop the layer's log of removed
            keys up to the file's step (`forget_removals` of the layer):
            the log then stays the size of one interval's removals instead
            of growing with every key ever evicted, and the layer can no
            longer give deltas since steps before its newest file.
    """

    def __init__(self, directory, every_n_steps, layers=None, forget_removals=False):
        super().__init__()
        if (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, (int, np.integer))
            or every_n_steps < 1
        ):
            raise ValueError(
                "DeltaExport: `every_n_steps` must be an integer >= 1. "
                f"Received: every_n_steps={every_n_steps!r}."
            )
        self.directory = os.fspath(directory)
        self.every_n_steps = int(every_n_steps)
        self.layer_names = None if layers is None else list(layers)
        if not isinstance(forget_removals, (bool, np.bool_)):
            raise ValueError(
                "DeltaExport: `forget_removals` must be True or False. "
                f"Received: forget_removals={forget_removals!r}."
            )
        self.forget_removals = bool(forget_removals)
        self._last = {}  # layer name -> step of its newest file
        self._tracked = []  # the layers, found at the start of fit

    def _layers(self):
        found, untracked = _tracked_sources(self.model)
        if self.layer_names is None:
            if not found:
                raise ValueError(
                    "DeltaExport: the model has no embedding table built with "
                    "`track_changes=True` (its embedding layers: "
                    f"{sorted(untracked)}); build them with it to export deltas."
                )
            return list(found.values())
        out = []
        for name in self.layer_names:
            chosen = [s for n, s in found.items() if n.split("/")[0] == name]
            chosen = [found[name]] if name in found else chosen
            if not chosen:
                raise ValueError(
                    f"DeltaExport: `layers` names '{name}', which is not an "
                    "embedding layer or collection table of the model built "
                    f"with track_changes=True (tracked: {sorted(found)}; not "
                    f"tracked: {sorted(untracked)})."
                )
            out.extend(chosen)
        return out

    def on_train_begin(self, logs=None):
        os.makedirs(self.directory, exist_ok=True)
        self._tracked = self._layers()
        self._batches = 0
        for layer in self._tracked:
            files = chain_files(self.directory, layer.name)
            if not files:
                self._write(layer, FULL)
                continue
            last = files[-1][0]
            if last > layer.trained_step():
                raise ValueError(
                    f"DeltaExport: '{self.directory}' holds files of layer "
                    f"'{layer.name}' up to step {last}, past the layer's "
                    f"step {layer.trained_step()}; use another directory."
                )
            self._last[layer.name] = last

    def on_train_batch_end(self, batch, logs=None):
        # Counted in batches: a prefetch stage moves the table clock ahead
        # of training (each file still ends at the last trained step).
        self._batches += 1
        if self._batches >= self.every_n_steps:
            self._batches = 0
            for layer in self._tracked:
                self._write(layer, self._last[layer.name])

    def on_train_end(self, logs=None):
        for layer in self._tracked:
            self._write(layer, self._last[layer.name])

    def _write(self, layer, since):
        self.model  # noqa: B018 (on JAX: attaches the variables fit holds)
        records = layer.export(since)
        step = int(records["step"])
        if since != FULL and step <= since:
            return  # nothing trained since (a stage mapped ahead): no file
        kind = "full" if since == FULL else "delta"
        target = os.path.join(self.directory, f"{layer.name}.{step:08d}.{kind}.npz")
        os.makedirs(os.path.dirname(target), exist_ok=True)  # a collection's
        with atomic_path(target, suffix=".npz") as temp:
            np.savez(temp, **records)
        self._last[layer.name] = step
        if self.forget_removals:
            layer.forget(step)

    @staticmethod
    def read(directory, layer):
        """The records of layer ``layer`` (its name; a collection's table:
        ``"<collection>/<table>"``) as of its newest
        file in ``directory``: its newest full file with the deltas after
        it applied in order (a full delta, see `keras_sparse.apply_delta`)."""
        files = chain_files(os.fspath(directory), layer)
        fulls = [i for i, (_, kind, _) in enumerate(files) if kind == "full"]
        if not fulls:
            raise ValueError(
                f"DeltaExport.read: '{directory}' holds no full file of layer "
                f"'{layer}' (files {[f[2] for f in files]})."
            )
        start = fulls[-1]
        loaded = [dict(np.load(path)) for _, _, path in files[start:]]
        return apply_delta(loaded[0], *loaded[1:])


def chain_files(directory, layer):
    """``(step, kind, path)`` of ``layer``'s files in ``directory``, by step
    (a collection's table, ``"<collection>/<table>"``: in its folder)."""
    if "/" in layer:
        folder, layer = layer.split("/", 1)
        directory = os.path.join(directory, folder)
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m and m["layer"] == layer:
            out.append((int(m["step"]), m["kind"], os.path.join(directory, name)))
    return sorted(out)
