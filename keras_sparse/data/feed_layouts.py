"""What each hash layer's prepared inputs travel with, chosen when a
`keras_sparse.data.prefetch` stage is made: its segments or exchange slots
(`feed_layout`), its key words (`key_words`), and its share of a model
input that feeds several hash layers (`feed_shares`)."""

import keras
import numpy as np

from keras_sparse.layers.model_feeds import input_groups


def default_replicas():
    """Replicas along the batch axis of the active `keras.distribution`
    (every device of its mesh without one), or None without a mesh."""
    dist = keras.distribution.distribution()
    if dist is None:
        return None
    mesh = getattr(dist, "device_mesh", None)
    if mesh is None:
        return None
    axis = getattr(dist, "batch_dim_name", None)
    if axis in tuple(mesh.axis_names):
        return int(mesh.shape[list(mesh.axis_names).index(axis)])
    return int(np.prod(mesh.shape))


def feed_layout(layer, dedup, bucket):
    """What a hash layer's codes travel with: None or ``(replicas, channel)``.

    A row-sharded layer with compact exchange buffers gets its ids' exchange
    slots (``bucket``; channel: its `ExchangeBuckets`). Other sharded layers
    get nothing: their lookups do not use segments, and full-size buffers or
    column sharding need no packing. Unsharded layers get their segments
    (``dedup``; channel "segments"), which number a batch's distinct rows
    over the whole batch the step sees; a multi-process JAX run assembles its
    global batch from per-process parts, whose numbers would be local, so it
    gets none.
    """
    if keras.backend.backend() != "jax":
        return (1, "segments") if dedup else None
    import jax

    from keras_sparse.sharding import keras_integration

    if jax.process_count() > 1:
        return None
    buckets = keras_integration.exchange_buckets(layer)
    if buckets is not None:
        return (buckets.devices, buckets) if bucket else None
    if keras_integration.route(layer) is not None or not dedup:
        return None
    return (default_replicas() or 1, "segments")


def feed_shares(feeds, layouts, words=None):
    """``(groups, shares)``: how hash layers reading one model input share it.

    ``groups``: ``(feed indices, replicas)`` per model input feeding hash
    layers, ``replicas`` what its blocks are packed for. ``shares``: per
    feed, None when the layer reads its input alone, else the
    ``(replicas, start, count, blocks)`` of `take_blocks`: the layer's
    ``count`` blocks (codes, or codes and segments) from ``start`` among the
    input's ``blocks``. Every layer of a group must use one replica count.
    """
    groups, shares = [], [None] * len(feeds)
    for group in input_groups(feeds):
        counts = [
            (1 if layouts[i] is None else 2) + (2 if words and words[i] else 0)
            for i in group
        ]
        replicas = {layouts[i][0] for i in group if layouts[i] is not None}
        if len(replicas) > 1:
            names = ", ".join(f"'{feeds[i].layer.name}'" for i in group)
            raise ValueError(
                f"prefetch: layers {names} read one model input but their "
                f"prepared inputs split over different replica counts "
                f"{sorted(replicas)}; give them separate inputs."
            )
        local = replicas.pop() if replicas else 1
        groups.append((group, local))
        if len(group) == 1:
            continue
        # Each process packs its own batch; JAX joins them process-major.
        total = local * process_count()
        start = 0
        for i, count in zip(group, counts):
            shares[i] = (total, start, count, sum(counts))
            start += count
    return groups, shares


def has_store(layer):
    """Whether a hash layer keeps evicted rows in a row store (``store=``)."""
    return getattr(layer, "row_tier", None) is not None


def process_count():
    """Processes that each pack their own part of a step's batch (JAX)."""
    if keras.backend.backend() != "jax":
        return 1
    import jax

    return jax.process_count()


def key_words(feeds, layouts):
    """Per feed: 0, or the replicas its key words (two int32 blocks per
    position) are packed for.

    Layers drawing fresh rows per key get each position's key words, in
    inference stages too: one layout per layer. So do layers with a row
    store: read-only steps read keys without a row from the store.
    """
    return [
        (
            (layout[0] if layout else 1) * process_count()
            if f.kind == "hash" and (f.layer.keys_drawn_per_key() or has_store(f.layer))
            else 0
        )
        for f, layout in zip(feeds, layouts)
    ]
