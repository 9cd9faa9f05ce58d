"""Progress bars over long host-side work on big hash tables.

Exporting, importing, saving and loading a hash layer, and building its
serving map for ``model.export``, take seconds to minutes at millions of
keys. `tracker` shows a `keras.utils.Progbar` over such work when it covers
at least ``min_rows`` rows and the session is interactive (stdout is a
terminal, or a Jupyter kernel runs), so batch jobs and their logs get no
new output; `set_progress` overrides that choice.

The work is split into weighted stages. Whole-array NumPy steps move the
bar when they end; copies, gathers and re-placement run in chunks of
`CHUNK_ROWS` rows (whether or not a bar is shown, so results never depend
on it) and move it chunk by chunk.
"""

import contextlib
import sys

DEFAULT_MIN_ROWS = 1_000_000
#: Rows per chunk of the chunked steps.
CHUNK_ROWS = 1 << 20

_setting = {"enabled": None, "min_rows": DEFAULT_MIN_ROWS}


def set_progress(enabled=None, min_rows=DEFAULT_MIN_ROWS):
    """Whether long work on big hash tables shows a progress bar.

    ``layer.export()``, ``layer.import_()``, saving and loading a
    `DistributedHashEmbedding` and building its serving map in
    ``model.export`` show a `keras.utils.Progbar` when they handle at least
    ``min_rows`` keys.

    Args:
        enabled: None (the default): only in an interactive session
            (stdout is a terminal or a Jupyter kernel runs, and Keras's
            interactive logging is on). True: always. False: never.
        min_rows: the fewest keys that get a bar.

    Example:

    >>> import keras_sparse as ks
    >>> ks.set_progress(False)  # e.g. a notebook whose output is kept
    >>> ks.set_progress(True, min_rows=10_000_000)  # only the biggest tables
    >>> ks.set_progress()  # back to the default
    """
    if enabled not in (None, True, False):
        raise ValueError(f"`enabled` must be None, True or False; got {enabled!r}.")
    if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 0:
        raise ValueError(
            f"`min_rows` must be a non-negative integer; got {min_rows!r}."
        )
    _setting.update(enabled=enabled, min_rows=min_rows)


def _interactive():
    """stdout is a terminal, or an IPython kernel (Jupyter) runs."""
    import keras

    if not keras.config.is_interactive_logging_enabled():
        return False
    try:
        if sys.stdout.isatty():
            return True
    except (AttributeError, ValueError):  # replaced or closed stdout
        pass
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def shown(rows):
    """Whether work on ``rows`` rows shows a bar under the current setting."""
    if rows < max(_setting["min_rows"], 1):
        return False
    if _setting["enabled"] is None:
        return _interactive()
    return _setting["enabled"]


@contextlib.contextmanager
def tracker(rows, title, stages):
    """A `Progress` over work on ``rows`` rows, with a bar when `shown`.

    ``title`` is printed above the bar; ``stages`` maps stage names, in
    order, to their estimated shares of the time.
    """
    bar = None
    if shown(rows):
        import keras
        from keras.src.utils import io_utils

        io_utils.print_msg(title)
        bar = keras.utils.Progbar(rows, unit_name="row")
    progress = Progress(rows, stages, bar)
    try:
        yield progress
    except BaseException:
        progress.close(finished=False)
        raise
    progress.close()


def silent():
    """A `Progress` that shows nothing."""
    return Progress(0, {"work": 1}, None)


class Progress:
    """Where work stands, as a fraction of ``rows`` shown on ``bar``."""

    def __init__(self, rows, stages, bar):
        total = float(sum(stages.values()))
        self._spans, start = {}, 0.0
        for name, weight in stages.items():
            self._spans[name] = (start / total, (start + weight) / total)
            start += weight
        self._span = (0.0, 0.0)
        self._rows, self._bar, self._shown = rows, bar, 0

    def stage(self, name):
        """Starts stage ``name``: the stages before it are done."""
        self._span = self._spans[name]
        self._show(self._span[0])

    def each(self, items):
        """Yields ``items``, the current span split evenly among them."""
        items = list(items)
        low, high = self._span
        for i, item in enumerate(items):
            self._span = _part(low, high, i, i + 1, len(items))
            yield item
            self._show(self._span[1])
        self._span = (low, high)

    def chunks(self, n):
        """Slices of ``range(n)`` of `CHUNK_ROWS` rows, the current span
        split among them by rows."""
        low, high = self._span
        for start in range(0, n, CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, n)
            self._span = _part(low, high, start, stop, n)
            yield slice(start, stop)
            self._show(self._span[1])
        self._span = (low, high)

    def part(self, done, total):
        """Shows ``done`` of ``total`` units of the current span (work whose
        chunks are not known in advance, e.g. a store's)."""
        low, high = self._span
        self._show(low + (high - low) * min(done, total) / max(total, 1))

    def close(self, finished=True):
        """Ends the bar: full, or where the work stopped (an error)."""
        if self._bar is not None:
            self._bar.update(self._rows if finished else self._shown, finalize=True)
            self._bar = None

    def _show(self, fraction):
        # Below the total until `close`: Progbar ends its line on reaching it.
        if self._bar is not None:
            self._shown = min(int(fraction * self._rows), self._rows - 1)
            self._bar.update(self._shown)


def _part(low, high, start, stop, n):
    width = high - low
    return (low + width * start / n, low + width * stop / n)
