"""Where a layer's table lives: the seam between the layers and sharding.

Layers never import `keras_sparse.sharding` (it sits above them). They ask
`provider()` instead: `keras_sparse.sharding` installs itself here when it
is imported, which ``import keras_sparse`` always does. Its hooks decide,
for the active Keras distribution, how a layer's variables are laid out
(``variable_rows``, ``table_initializer``, ``padded_value`` /
``unpadded_value``, ``collection_placement`` / ``collection_stacks``), how
its rows are looked up (``route``, ``routed_lookup``, ``routed_gather``,
``route_stack``, ``exchange_buckets``) and where a hash layer's keys are
mapped (``place_hash_table``, ``map_keys_in_step``).
"""

_provider = None


def install(provider):
    """Makes ``provider`` (a module or object with the hooks above) the one
    the layers consult."""
    global _provider
    _provider = provider


def provider():
    if _provider is None:
        raise RuntimeError(
            "keras_sparse.layers need keras_sparse.sharding's placement hooks; "
            "import keras_sparse (or keras_sparse.sharding) first."
        )
    return _provider
