"""Builds a compiled helper on first use and caches it per user.

The sources are compiled by the system compiler into
``$KERAS_SPARSE_CACHE`` (else ``$XDG_CACHE_HOME/keras_sparse`` or
``~/.cache/keras_sparse``), under a name keyed by the sources, the
compiler, the flags and the platform: no build step at install time, and
no compiler at run time once built. Any failure leaves the caller on its
pure-Python route, with the reason in words.
"""

import hashlib
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading

from keras_sparse import atomic_files


def build_library(name, sources, main, compiler_env, compiler, flags, load):
    """``(loaded, status)``: ``load(path)`` of the library built from
    ``sources()`` (``{file name: text}``; ``main`` is compiled, the others
    are there to include) with ``$compiler_env`` (else ``compiler``) and
    ``flags`` (a sequence, or a callable returning one, called inside the
    failure guard); or ``(None, "off: <reason>")``. ``status`` is
    ``"on: <path>"`` when loaded."""
    if os.environ.get("KERAS_SPARSE_NATIVE", "1") == "0":
        return None, "off: KERAS_SPARSE_NATIVE=0"
    if not sys.platform.startswith(("linux", "darwin")):
        return None, f"off: no build recipe for platform {sys.platform!r}"
    command = shlex.split(os.environ.get(compiler_env) or compiler)
    found = shutil.which(command[0]) if command else None
    if found is None:
        return None, f"off: no C compiler found (${compiler_env} or {compiler})"
    try:
        flags = tuple(flags() if callable(flags) else flags)
        texts = sources()
        key = hashlib.sha256(
            "\0".join(
                [*texts, *texts.values(), *command, platform.machine(),
                 *platform.libc_ver(), *flags]
            ).encode()
        ).hexdigest()[:16]  # fmt: skip
        folder = cache_dir()
        check_private(folder)
        path = folder / f"{name}-{key}.so"
        if not path.is_file():
            _build([found, *command[1:]], texts, main, flags, path)
        return load(path), f"on: {path}"
    except Exception as error:  # any failure: the caller's other route runs
        return None, f"off: building or loading the helpers failed: {error}"


class LazyLibrary:
    """A library built (or loaded from the cache) on first use, once per
    process: `get()` is the loaded library or None, `status()` why.

    ``build`` takes no arguments and returns `build_library`'s
    ``(loaded, status)``; it runs at most once, under a lock, so threads
    that ask at the same time share one build.
    """

    def __init__(self, build):
        self._build = build
        self._lock = threading.Lock()
        self._result = None

    def get(self):
        with self._lock:
            if self._result is None:
                self._result = self._build()
            return self._result[0]

    def status(self):
        self.get()
        return self._result[1]

    def build(self):
        """``(loaded, status)`` of a build (or cache load) done now, not
        kept: what `get` would see in a fresh process."""
        return self._build()


def source_library(name, source, compiler_env, compiler, flags, load):
    """A `LazyLibrary` built from ``keras_sparse/kernels/<source>`` (its local includes
    expanded) as `build_library` does; ``flags`` is called at build time
    (a failure there, too, leaves the library off with the reason)."""
    return LazyLibrary(
        lambda: build_library(
            name,
            lambda: {source: _kernel_text(source)},
            source,
            compiler_env,
            compiler,
            flags,
            load,
        )  # fmt: skip
    )


def _kernel_text(source):
    # Looked up at each build, so that tests can replace it.
    from keras_sparse import kernel_sources

    return kernel_sources.kernel_source(source)


def cache_dir():
    if os.environ.get("KERAS_SPARSE_CACHE"):
        return pathlib.Path(os.environ["KERAS_SPARSE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "keras_sparse"


def check_private(folder):
    """Refuses a cache folder that others may write to: its library is
    loaded into this process."""
    if not folder.exists() or not hasattr(os, "getuid"):
        return
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o002:
        raise PermissionError(
            f"{folder} is not private to this user (owner {info.st_uid}, mode "
            f"{oct(info.st_mode & 0o777)}); set KERAS_SPARSE_CACHE to a "
            "folder of your own."
        )


def _build(command, texts, main, flags, path):
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Built beside its final name, synced and renamed: processes that build
    # at the same time (one per replica) never load a half-written file,
    # nor does a process after a crash.
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        for file_name, text in texts.items():
            (pathlib.Path(work) / file_name).write_text(text)
        built = pathlib.Path(work) / path.name
        result = subprocess.run(
            [*command, str(pathlib.Path(work) / main), "-o", str(built), *flags],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr.strip()[-2000:])
        atomic_files.publish(str(built), str(path))
