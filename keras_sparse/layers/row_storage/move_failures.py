"""The error a step's row moves raise when the store under a cache fails."""

import contextlib


@contextlib.contextmanager
def store_failures(layer_name, lost):
    """Turns an I/O or memory error of a row store inside a step's moves
    into an error naming the layer. ``lost``: what may be lost ("Keys",
    "Rows")."""
    try:
        yield
    except (OSError, MemoryError) as e:
        # The plan is gone and what it evicted may be half written: only a
        # checkpoint holds it for sure.
        raise RuntimeError(
            f"Layer '{layer_name}': its row store failed while moving a "
            f"step's rows ({type(e).__name__}: {e}). {lost} this step "
            "evicted may be lost: restore the model from a checkpoint."
        ) from e
