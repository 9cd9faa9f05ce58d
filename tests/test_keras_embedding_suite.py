"""Keras's own Embedding tests, run on `AllToAllDenseEmbedding`.

The test file is taken at test time from the source distribution of the
installed keras version (fetched once by pip and cached), never copied into
this repository. Its module-level ``layers`` is replaced by a view of
``keras.layers`` whose ``Embedding`` is the drop-in; nothing else changes.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys
import tarfile
import types

import keras
import numpy as np
import pytest

from keras_sparse import AllToAllDenseEmbedding

SUITE = "keras/src/layers/core/embedding_test.py"


def _cache_dir():
    root = os.environ.get("KS_TEST_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "keras-sparse-tests"
    )
    return pathlib.Path(root) / f"keras-{keras.__version__}"


def _from_sdist(cache):
    """``SUITE`` extracted from keras's sdist (pip download, cached)."""
    target = cache / "embedding_test.py"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"keras=={keras.__version__}",
            "-d",
            str(cache),
        ],
        check=True,
        timeout=300,
    )
    (sdist,) = cache.glob("keras-*.tar.gz")
    with tarfile.open(sdist) as tar:
        member = tar.getmember(f"keras-{keras.__version__}/{SUITE}")
        target.write_bytes(tar.extractfile(member).read())
    return target


def _suite_path():
    try:
        return _from_sdist(_cache_dir())
    except (subprocess.SubprocessError, OSError, KeyError, ValueError) as e:
        # No registry reachable: keras wheels ship the same file.
        installed = pathlib.Path(keras.__file__).parent / SUITE.split("/", 1)[1]
        if installed.exists():
            return installed
        raise RuntimeError(
            f"Cannot get keras {keras.__version__}'s {SUITE}: {e}"
        ) from e


class _DropInLayers(types.ModuleType):
    """``keras.src.layers`` with ``Embedding`` replaced by the drop-in."""

    Embedding = AllToAllDenseEmbedding

    def __getattr__(self, name):
        from keras.src import layers

        return getattr(layers, name)


def _load_suite():
    spec = importlib.util.spec_from_file_location(
        "keras_embedding_test_upstream", _suite_path()
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.layers = _DropInLayers("layers")
    return module


_suite = _load_suite()

# Collected by pytest: every test of Keras's file, on the drop-in.
EmbeddingTest = _suite.EmbeddingTest


def test_suite_runs_on_the_drop_in():
    """The substitution reaches the tests: ``layers.Embedding`` builds ours."""
    layer = _suite.layers.Embedding(3, 2)
    assert type(layer) is AllToAllDenseEmbedding
    assert _suite.layers.Dense is keras.layers.Dense
    names = [n for n in dir(EmbeddingTest) if n.startswith("test_")]
    assert len(names) >= 30, names


def _model(layer_cls, name):
    ids = keras.Input((3,), dtype="int32")
    out = layer_cls(10, 4, name=name)(ids)
    return keras.Model(ids, keras.layers.Dense(1)(out))


@pytest.mark.parametrize("direction", ["keras_to_drop_in", "drop_in_to_keras"])
def test_weight_files_move_both_ways(tmp_path, direction):
    """A .weights.h5 of a model with keras.layers.Embedding loads into the
    same model with the drop-in (same layer name), and the reverse."""
    classes = [keras.layers.Embedding, AllToAllDenseEmbedding]
    if direction == "drop_in_to_keras":
        classes.reverse()
    source, target = (_model(c, "emb") for c in classes)
    path = str(tmp_path / "model.weights.h5")
    source.save_weights(path)
    target.load_weights(path)
    x = np.array([[1, 2, 9], [0, 5, 5]], "int32")
    np.testing.assert_array_equal(
        np.asarray(source.predict(x, verbose=0)),
        np.asarray(target.predict(x, verbose=0)),
    )
    assert not np.allclose(
        keras.ops.convert_to_numpy(_model(classes[1], "fresh").layers[1].embeddings),
        keras.ops.convert_to_numpy(target.layers[1].embeddings),
    )
