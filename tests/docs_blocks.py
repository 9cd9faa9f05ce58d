"""Python code blocks of the docs pages and the README, and how to run them.

A page's ```python blocks run in order, in one fresh interpreter per page
(as a reader would paste them into one session), each compiled with the
page's own line numbers so a failure points at the line of the page.

HTML comments, invisible on the rendered page, steer this:

- ``<!-- not run: REASON -->`` on the line before a block: the block needs
  what CI lacks (a GPU, several hosts); the reason is required.
- ``<!-- runs on: jax -->`` anywhere on a page: its blocks run only under
  the listed Keras backends (comma-separated); other backends skip the page.
- ``<!-- runs on: BACKEND, devices: N -->`` or ``<!-- runs on: BACKEND,
  processes: N -->`` on the line before a block: a whole program on its own
  (not part of the page's session), run only under that Keras backend in a
  fresh interpreter that must end with a strategy of N replicas (devices),
  or as N processes launched as torchrun / a TF_CONFIG cluster would
  (processes); see tests/test_docs_multidevice.py.
"""

import builtins
import dataclasses
import pathlib
import re
import symtable

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")
RUNS_ON = re.compile(r"<!--\s*runs on:\s*([a-z, ]+?)\s*-->")
FENCE = re.compile(r"^```(\S*)")
LAUNCH = re.compile(
    r"^<!--\s*runs on:\s*(jax|tensorflow|torch)\s*,"
    r"\s*(devices|processes):\s*([1-9][0-9]*)\s*-->$"
)
LAUNCH_LIKE = re.compile(r"^<!--\s*runs on:.*(devices|processes)")


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a block that needs several devices or processes is run."""

    backend: str
    kind: str  # "devices" (one process, N replicas) or "processes"
    count: int


@dataclasses.dataclass
class Block:
    line: int  # 1-based line of the block's first code line
    language: str
    code: str
    not_run: str | None  # the reason, for a block CI cannot run
    launch: Launch | None = None  # a program of its own, on N devices/processes


def pages():
    """The README and every page under docs/, as paths relative to ROOT."""
    found = sorted((ROOT / "docs").rglob("*.md"))
    return ["README.md"] + [str(p.relative_to(ROOT)) for p in found]


def blocks(page):
    """Every fenced block of ``page`` (a path relative to ROOT)."""
    lines = (ROOT / page).read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        start = i + 1
        end = start
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{i + 1}: code block is never closed")
        before = lines[i - 1].strip() if i else ""
        reason = NOT_RUN.match(before)
        code = "\n".join(lines[start:end]) + "\n"
        lang = opened.group(1)
        launch = LAUNCH.match(before)
        if LAUNCH_LIKE.match(before) and not launch:
            raise ValueError(
                f"{page}:{i}: write <!-- runs on: jax|tensorflow|torch, "
                f"devices|processes: N -->, got {before!r}"
            )
        if launch:
            launch = Launch(launch[1], launch[2], int(launch[3]))
        out.append(Block(start + 1, lang, code, reason and reason.group(1), launch))
        i = end + 1
    return out


def backends(page):
    """The Keras backends a page's blocks run on (None: all)."""
    found = RUNS_ON.search((ROOT / page).read_text())
    return None if not found else {b.strip() for b in found.group(1).split(",")}


def script(page):
    """A Python program running the page's runnable python blocks in order."""
    runnable = [
        b
        for b in blocks(page)
        if b.language == "python" and not b.not_run and not b.launch
    ]
    parts = [
        "import sys",
        "__scope = {'__name__': '__main__'}",
    ]
    for block in runnable:
        padded = "\n" * (block.line - 1) + block.code
        parts.append(
            f"exec(compile({padded!r}, {str(ROOT / page)!r}, 'exec'), __scope)"
        )
    return "\n".join(parts) + "\n", len(runnable)


def launched(page):
    """The page's python blocks that run as programs of their own."""
    return [b for b in blocks(page) if b.language == "python" and b.launch]


def program(page, block, epilogue=""):
    """A Python program running ``block`` alone (its lines numbered as on
    the page) in ``__scope``, then ``epilogue`` (test code, which may read
    ``__scope``)."""
    padded = "\n" * (block.line - 1) + block.code
    return (
        "__scope = {'__name__': '__main__'}\n"
        f"exec(compile({padded!r}, {str(ROOT / page)!r}, 'exec'), __scope)\n" + epilogue
    )


def unbound_names(code):
    """Names ``code`` reads that it never binds (assigns, imports, defines)
    and that are not builtins: what a block run on its own would fail on
    with NameError. Reads inside functions and comprehensions count when
    they reach the module scope."""
    top = symtable.symtable(code, "<block>", "exec")
    bound = {
        s.get_name()
        for s in top.get_symbols()
        if s.is_assigned() or s.is_imported() or s.is_namespace()
    }
    known = bound | set(dir(builtins))
    read = set()

    def walk(table):
        for s in table.get_symbols():
            at_top = table is top or s.is_global() or s.is_declared_global()
            if s.is_referenced() and at_top:
                read.add(s.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return sorted(read - known)
