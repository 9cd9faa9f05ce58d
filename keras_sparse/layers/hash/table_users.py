"""Which hash layers use one table object.

A layer owns its table, but a table object may be given to several layers
(``layer_b.table = layer_a.table``). Their calls must then keep one order
within a step (`keras_sparse.layers.hash.jax_step_mapping.calls_per_step`), as
the prefetch stage keeps one order for them across its workers.
"""

import weakref

_USERS = weakref.WeakKeyDictionary()  # table -> WeakSet of the layers using it


def register(table, layer):
    """Records that ``layer`` uses ``table`` (None: nothing to record)."""
    if table is None:
        return
    try:
        _USERS.setdefault(table, weakref.WeakSet()).add(layer)
    except TypeError:
        pass  # a table that cannot be weakly referenced: the layer's own


def users(layer):
    """The live layers whose table is ``layer``'s (``layer`` included)."""
    table = getattr(layer, "table", None)
    try:
        known = _USERS.get(table, ()) if table is not None else ()
    except TypeError:
        known = ()
    sharing = [u for u in known if getattr(u, "table", None) is table]
    return sharing if layer in sharing else [layer, *sharing]


def users_of(table):
    """The live layers registered as users of ``table``."""
    try:
        return list(_USERS.get(table, ()))
    except TypeError:
        return []
