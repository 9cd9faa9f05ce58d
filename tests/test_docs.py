"""The docs site builds with warnings as errors, and its code runs.

The site (mkdocs.yml, docs/) is built with ``--strict``: a broken link or
anchor, a page left out of the navigation or a docstring the API reference
cannot parse fails the build. Every ```python block of the README and of the
docs pages runs, page by page, under the backend of this run (see
tests/docs_blocks.py for the comments that steer it; blocks for several
devices or processes run in tests/test_docs_multidevice.py).
"""

import os
import re
import subprocess
import sys

import keras
import pytest

from tests import docs_blocks

PAGES_WITH_CODE = [
    page
    for page in docs_blocks.pages()
    if any(b.language == "python" for b in docs_blocks.blocks(page))
]


@pytest.mark.backend_independent
def test_site_builds_with_warnings_as_errors(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=docs_blocks.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    reference = (site / "reference" / "layers" / "index.html").read_text()
    # The reference is generated from the docstrings, arguments included.
    assert "DistributedHashEmbedding" in reference
    assert "admit_after" in reference
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    assert "samples/s" in benchmarks  # BENCHMARKS.md included, not a stub


@pytest.mark.backend_independent
def test_every_python_block_runs_or_says_why_not():
    """A python block CI cannot run carries its reason; the rest run below."""
    for page in docs_blocks.pages():
        for block in docs_blocks.blocks(page):
            if block.language == "py":
                pytest.fail(f"{page}:{block.line}: write python, not py")
            if block.not_run is not None:
                assert block.language == "python", f"{page}:{block.line}"
    assert "getting-started.md" in " ".join(PAGES_WITH_CODE)


@pytest.mark.backend_independent
def test_blocks_not_run_compile_and_define_what_they_use():
    """A block CI cannot run, or runs alone on several devices or processes
    (tests/test_docs_multidevice.py, in its backend's run only), is still
    valid Python that a reader can run on its own: every name it reads is
    imported or assigned in it."""
    checked = 0
    for page in docs_blocks.pages():
        for block in docs_blocks.blocks(page):
            alone = block.not_run is not None or block.launch is not None
            if block.language != "python" or not alone:
                continue
            where = f"{page}:{block.line}"
            compile(block.code, where, "exec")  # SyntaxError names the place
            missing = docs_blocks.unbound_names(block.code)
            assert not missing, f"{where}: undefined in the block: {missing}"
            checked += 1
    assert checked >= 3


@pytest.mark.backend_independent
def test_unbound_names_finds_what_a_block_misses():
    code = (
        "import jax\nfrom os import path\nx = 1\n"
        "def f(a):\n    return a + x + y + len(path) + [b for b in z]\n"
        "class C:\n    pass\nC(); f(NUM_HOSTS); tf.constant(1); jax.devices()\n"
    )
    assert docs_blocks.unbound_names(code) == ["NUM_HOSTS", "tf", "y", "z"]


@pytest.mark.parametrize("page", PAGES_WITH_CODE)
def test_page_code_runs(page, tmp_path):
    backend = keras.config.backend()
    allowed = docs_blocks.backends(page)
    if allowed is not None and backend not in allowed:
        pytest.skip(f"{page} runs on {', '.join(sorted(allowed))}")
    program, count = docs_blocks.script(page)
    if not count:
        pytest.skip(f"{page}: every python block needs what CI lacks")
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(docs_blocks.ROOT))
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"
    ran = subprocess.run(
        [sys.executable, "-c", program],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert ran.returncode == 0, (
        f"{page} failed on {backend}:\n{ran.stdout[-3000:]}\n{ran.stderr[-6000:]}"
    )


@pytest.mark.backend_independent
def test_readme_links_reach_files_of_the_repository():
    """The README is read on its own (outside the site): every relative link
    must name a file or folder of the repository."""
    text = (docs_blocks.ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)", text)
    local = [t for t in targets if "://" not in t]
    assert "docs/getting-started.md" in local
    missing = [t for t in local if not (docs_blocks.ROOT / t).exists()]
    assert not missing, missing
