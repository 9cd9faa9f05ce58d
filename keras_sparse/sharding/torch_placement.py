"""Sharded tables on torch: not built yet, every table is local or
replicated (see `keras_sparse.ops.torch_distributed`)."""


def build_placement(layer):
    """The `TablePlacement` ``layer`` is built with, or None (local)."""
    del layer
    return None
