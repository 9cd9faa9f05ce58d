"""A layer's store rows in a ``.keras`` file: Keras's asset files, chunked.

Keras's weights path (``save_own_variables``) holds each entry in memory,
so a table beyond memory cannot go through it. A layer with a row store
writes the store's rows in ``save_assets`` instead, chunk by chunk
(`keras_sparse.store.chunk_files`), with a progress bar for big stores, and
`load_assets` streams them back. Keras stages assets in a temporary folder
(``tempfile``'s) and then copies them into the archive, and extracts them
there again on load.

Only ``model.save`` / ``keras.saving.save_model`` and ``load_model`` carry
assets: `keras_sparse.layers.atomic_save` runs them under `assets_follow`.
Elsewhere (``save_weights``, direct ``save_own_variables`` calls) the rows
go with the weights, in memory, as before.
"""

import contextlib
import contextvars
import os

from keras_sparse.progress import tracker

#: The folder of a layer's assets that holds its store rows.
FOLDER = "store_rows"
#: Bytes of rows per chunk file (bounds a save's and a load's memory).
CHUNK_BYTES = 64 << 20

_follow = contextvars.ContextVar("keras_sparse_assets_follow", default=False)


@contextlib.contextmanager
def assets_follow():
    """Marks a Keras model save or load that also writes or reads assets."""
    token = _follow.set(True)
    try:
        yield
    finally:
        _follow.reset(token)


def expected() -> bool:
    """Whether the save or load running now carries assets."""
    return _follow.get()


def rows_per_chunk(fields) -> int:
    return max(1, CHUNK_BYTES // sum(f.row_bytes for f in fields))


def save(layer_name, fields, chunks, total, dir_path) -> int:
    """Writes ``chunks`` (``(keys, rows)``, about `rows_per_chunk` each) of
    ``total`` rows into the asset folder ``dir_path``; returns the rows."""
    from keras_sparse.store.chunk_files import write_chunks

    title = f"Layer '{layer_name}': saving {total:,} stored rows"
    with tracker(total, title, {"rows": 1}) as progress:
        progress.stage("rows")
        return write_chunks(
            os.path.join(dir_path, FOLDER),
            fields,
            chunks,
            on_rows=lambda done: progress.part(done, total),
        )


def saved_rows(dir_path):
    """The rows saved in the asset folder ``dir_path`` (None: none saved)."""
    from keras_sparse.store.chunk_files import read_manifest

    folder = os.path.join(dir_path or "", FOLDER)
    if not dir_path or not os.path.isdir(folder):
        return None
    return read_manifest(folder, "load_assets")["rows"]


def load(layer_name, fields, dir_path, write):
    """Streams the saved rows in ``dir_path`` to ``write(keys, rows)``,
    chunk by chunk (progress); returns how many rows."""
    from keras_sparse.store.chunk_files import read_chunks

    who = f"Layer '{layer_name}'"
    total = saved_rows(dir_path) or 0
    title = f"{who}: loading {total:,} stored rows"
    done = 0
    with tracker(total, title, {"rows": 1}) as progress:
        progress.stage("rows")
        for keys, rows in read_chunks(os.path.join(dir_path, FOLDER), fields, who):
            write(keys, rows)
            done += len(keys)
            progress.part(done, total)
    return done


def missing_assets_error(layer_name, rows):
    """The error of a load that would leave out the ``rows`` store rows a
    ``.keras`` file holds in its assets (``load_weights``)."""
    return ValueError(
        f"Layer '{layer_name}': the file holds {rows:,} row-store rows in its "
        "asset files, which only `keras.saving.load_model` reads; nothing was "
        "loaded. Load the model with `keras.saving.load_model(path)` (then "
        "copy its weights over), or save weights with `model.save_weights` "
        "(the rows then go with the weights)."
    )
