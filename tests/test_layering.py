"""The package's layers point one way (table <- ops <- layers <- sharding
<- data): the import-linter contract in pyproject.toml, checked on the
import graph of the installed source."""

import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.backend_independent

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_lower_layers_never_import_higher_ones():
    exe = shutil.which("lint-imports") or str(
        pathlib.Path(sys.executable).with_name("lint-imports")
    )
    done = subprocess.run(
        [exe, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout, done.stdout


def _cycles(graph):
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return groups


def test_no_import_cycles():
    """No two keras_sparse modules import each other, directly or through
    others, lazily or not (the import graph built by grimp)."""
    grimp = pytest.importorskip("grimp")
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    graph = grimp.build_graph("keras_sparse", cache_dir=None)
    assert _cycles(graph) == []
    # The check finds a cycle when there is one.
    graph.add_import(
        importer="keras_sparse.table.hash_table",
        imported="keras_sparse.layers.hash.embedding",
    )
    assert _cycles(graph)
