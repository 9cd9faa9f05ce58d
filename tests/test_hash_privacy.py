"""Modules outside `keras_sparse.layers.hash` use the hash layers through
their public surface only: none reaches a private method or attribute of
`DistributedHashEmbedding` / `HashEmbeddingCollection` (its key mapping,
stage hold, records), so the package can change them freely."""

import ast
import inspect
import pathlib
import textwrap

import pytest

pytestmark = pytest.mark.backend_independent

ROOT = pathlib.Path(__file__).resolve().parents[1] / "keras_sparse"
HASH = ROOT / "layers" / "hash"


def _private_names():
    """Private (``_x``, not dunder) methods and instance attributes the hash
    layer classes define in `keras_sparse.layers.hash`, less those their
    bases outside it define too (Keras' and `SparseEmbeddingBase`'s)."""
    from keras_sparse.layers.hash.collection import HashEmbeddingCollection
    from keras_sparse.layers.hash.embedding import DistributedHashEmbedding

    names, inherited = set(), set()
    for top in (DistributedHashEmbedding, HashEmbeddingCollection):
        for cls in top.__mro__:
            if not cls.__module__.startswith("keras_sparse.layers.hash"):
                inherited.update(vars(cls))
                continue
            names.update(vars(cls))
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                ):
                    names.add(node.attr)
    private = {n for n in names if n.startswith("_") and not n.startswith("__")}
    # Keras' own attributes the layer sets (its instances have them).
    keras_layer = vars(__import__("keras").layers.Layer())
    # and those Keras reads but sets only in its layers' `quantize`.
    keras_protocol = {"_is_quantized"}
    return private - inherited - set(keras_layer) - keras_protocol


def _outside_uses(names):
    """``path:line .name`` of each access to one of ``names`` on an object
    other than ``self``/``cls``/``super()`` (a class's own members) in a
    module outside the hash layer's package."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if HASH in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _named_by_string(node, names):  # getattr(layer, "_x") and kin
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
                continue
            if not isinstance(node, ast.Attribute) or node.attr not in names:
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super":
                continue
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} .{node.attr}")
    return found


def _named_by_string(node, names):
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", "") in ("getattr", "setattr", "hasattr")
        and len(node.args) >= 2
        and getattr(node.args[0], "id", "") not in ("self", "cls")
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in names
    )


def test_private_names_are_found():
    names = _private_names()
    # The scan sees the names it guards (a broken scan would pass vacuously).
    assert {"_table_rows", "_map_keys", "_map_step_keys", "_call_prepared"} <= names
    assert not any(n.startswith("__") for n in names)


def test_no_module_outside_the_hash_package_uses_its_private_members():
    assert _outside_uses(_private_names()) == []
