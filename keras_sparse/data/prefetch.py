"""Asynchronous prefetching input stage for models with keras_sparse layers.

``stage = keras_sparse.data.prefetch(source, model, threads=2, capacity=4)``
returns a `keras.utils.PyDataset` that ``model.fit`` / ``evaluate`` /
``predict`` accept on every backend. Worker threads do each
`DistributedHashEmbedding`'s input-side work ahead of the step: the hash
table's ``lookup_or_insert`` (key -> row, admission, eviction), plus the
optional locality routing of samples to data-parallel replicas. The step then
receives *prepared* inputs and runs without the per-step host callback
(``io_callback`` on JAX, ``tf.numpy_function`` on TensorFlow, eager host
work on PyTorch).

Prepared-input encoding (int32, the keys' shape):

- ``row`` (``>= 0``): the key is in the table at ``row``;
- ``-2 - row`` (``<= -2``): the key got ``row`` freshly in this batch; the
  step re-initializes the row (vector from the initializer, optimizer slots
  reset) before reading it, exactly like the slow path's ``fresh`` flag;
- ``-1``: no row (not admitted yet, weight 0 / padding, or an unknown key in
  inference). Reads zeros and trains nothing.

With ``dedup=True`` (the default) the workers also number each batch's
distinct rows per layer (the "segments": unique rows + inverse, computed
with NumPy) and hand them over stacked with the codes along the batch axis
(`keras_sparse.layers.hash.prepared_inputs`); the step's sparse update then
takes them instead of sorting the ids itself. The numbers are those the
step's own sort would give, so results do not change. For a layer
row-sharded under the active distribution with compact exchange buffers
(``row_exchange_slack``), the workers instead bucket its ids by owning
shard (``bucket=True``, `keras_sparse.sharding.exchange_buckets`): each
id's slot in its owner's send buffer travels with the codes, the step skips
its packing, all-reduce and overflow callback, and a batch that would
overflow a buffer raises in the worker, naming the layer, before its step.

While a stage is open, only prepared inputs may reach its hash layers
(`keras_sparse.data.prefetch_stage`): use one stage per data set (e.g.
``validation_data=prefetch(val, model, training=False)``).

Ordering and exactness. Each layer's table is mutated in batch order: a
layer's table call for batch ``i`` runs only after its call for batch
``i - 1`` (a turn counter per table; layers given one shared table object
take turns in feed order), with exactly the same call as the slow
path (``layer.map_host_keys``), one call per layer per batch. The tables of
different layers are independent, so their calls run in parallel: one
thread may do layer ``f`` of batch ``i`` while another does layer ``g`` of
batch ``i`` or ``i + 1``. Everything else (conversion, encoding, routing)
runs in parallel too. Batches are handed to Keras in order
(``deterministic=True``). Embedding values are read inside the step, so a
row evicted by batch ``i + k`` and handed to another key is only
re-initialized when step ``i + k`` runs, after step ``i`` has read (and
updated) it for its previous key. Fresh rows start from the same values in
both paths: per key (the stage hands each position's key words to the step,
`keras_sparse.layers.hash.keyed_fresh_rows`) or, for initializers without a
per-key form, one seed from the layer's generator per training step, sized
by the same rule (`keras_sparse.layers.hash.fresh_rows`); a new row is flagged fresh
at its first position in the batch only (so each is reset from one drawn
vector, whatever order a backend's scatter writes duplicates in: PyTorch's
varies from run to run), and ``sparse_iterations`` advances once per step in
both, so the seed generator, every table (same calls, same order, same LRU
clock) and the variables evolve identically: training with the stage is
bit-identical to training without it, whatever the number of threads.
On a GPU, XLA's scatter-adds (the gradient sums) are not deterministic by
default, so two runs of either path differ by float rounding; with
``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` the stage is bit-identical
there too (checked on an H100).

Checkpoints. A save during the fit (``ModelCheckpoint(save_freq=N)``,
``model.save`` or ``layer.export()`` in a callback) sees each table as of
the layer's last trained step: every table call of a training stage keeps
its undo record (`keras_sparse.table.undo`) in a per-table journal, and the
layer undoes, on a copy, the calls of the batches its step counter says are
not trained yet (`keras_sparse.data.lookahead`). Its variables need no undo:
a row the look-ahead gave to a new key still holds the evicted key's vector
and slots until that key's step resets it. The step count at which each
pass begins is read when the stage is made and then advanced by the batches
each pass trained, since reading it inside a fit is unreliable (purged on
JAX, possibly advanced by a step in flight on TensorFlow).

Caveats:

- On JAX without ``jax_enable_x64``, Keras truncates int64 keys to int32
  before the slow path sees them; the stage sees the full 64-bit keys. The
  two paths agree for keys in the int32 range.
- Batches looked up but never trained (early stopping, an exception, a new
  pass) inserted keys whose rows were not re-initialized. When such a pass is
  abandoned, the stage erases the keys that got a fresh row in the batches
  the layer's ``sparse_iterations`` counter says were not trained (they are
  re-inserted, fresh, when next seen), so no key can ever read a row that
  was not reset for it. A layer with a row store (``store=``) cannot erase:
  the keys those batches evicted are not in its store yet. Its table is put
  back exactly as its last trained step left it and the batches' row moves
  are dropped (`keras_sparse.data.untrained`); its moves otherwise run in
  the steps, in order, and read-only steps read stored keys by the key
  words the stage hands them.
- GPU tables (``table_device="gpu"``) take the same call: the worker sends
  the batch's keys to the GPU, the CUDA kernels map them, and the int32 codes
  come back to the worker, all off the step's critical path (the transfer
  then moves them to the device with the rest of the batch).
- ``deterministic=False`` lets batches out in completion order only when no
  layer mutates its table (inference stages); training stages keep order.
- Subclassed models: the stage cannot see which input feeds which layer;
  pass ``feature_map={layer_name: input_key}`` (``input_key``: a dict key of
  ``x``, an int position in a tuple/list ``x``, or None for a single array
  ``x``). Functional models are walked automatically (inputs as one tensor,
  a list, a dict or nested; the data in any structure Keras accepts for
  them, `keras_sparse.layers.model_feeds`); a layer must be fed directly by a model
  input, and called once.
- One model input may feed several hash layers: the stage stacks each
  layer's codes (and segments) along the batch axis of that input and each
  layer takes its own (`keras_sparse.layers.hash.prepared_inputs.take_blocks`).
  An input that feeds a hash layer and any other layer is refused (the
  other layer would read row codes as keys).
- Shutdown: ``close()`` returns once the workers have finished their
  current unit (a table call, a conversion: milliseconds), so no table call
  runs after it. The thread reading the source may be blocked inside the
  source's ``next()``, which Python cannot interrupt: ``close()`` does not
  wait for it; it is a daemon thread (it never keeps the process alive),
  drops what ``next()`` returns, closes the source's iterator and exits.
  When the source raises, the error reaches the step and every thread of
  the pass ends.
- ``route="locality"`` permutes samples within a batch; for ``predict`` that
  would permute the outputs, so it is refused for inference stages. Fresh
  rows start per key, so the routed run equals the unrouted one up to float
  summation order (except for seeded initializers without a per-key form,
  e.g. Orthogonal, whose draws follow batch positions).
  Routing gathers each device's ids on its own shard, and those ids pass
  through the exchange block a device sends to itself: with compact row
  buffers (``row_exchange_slack``) routed batches need a slack near the
  device count, else the bucketing reports an overflow before the step.
"""

from keras_sparse.data import cache_ahead
from keras_sparse.data.feed_layouts import default_replicas
from keras_sparse.data.feed_layouts import feed_layout
from keras_sparse.data.feed_layouts import feed_shares
from keras_sparse.data.feed_layouts import has_store
from keras_sparse.data.feed_layouts import key_words
from keras_sparse.data.local_replicas import local_replicas
from keras_sparse.data.prefetch_engine import Engine
from keras_sparse.data.prefetch_pass import PrefetchError
from keras_sparse.data.prefetch_stage import PrefetchStage
from keras_sparse.data.sources import make_source
from keras_sparse.data.transfer import batch_copier
from keras_sparse.layers.hash import table_users
from keras_sparse.layers.model_feeds import check_sole_readers
from keras_sparse.layers.model_feeds import plan

__all__ = ["PrefetchError", "PrefetchStage", "prefetch"]


def prefetch(
    source,
    model,
    *,
    threads=2,
    capacity=4,
    route=None,
    batch_size=None,
    deterministic=True,
    training=True,
    replicas=None,
    feature_map=None,
    y=None,
    sample_weight=None,
    steps=None,
    shuffle=False,
    seed=None,
    passes=None,
    transfer="auto",
    dedup=True,
    bucket=True,
):
    """Wraps ``source`` into a prefetching input stage for ``model``.

    Args:
        source: a dict/tuple/array of NumPy arrays (with ``batch_size``; a
            ``(x, y)`` or ``(x, y, sample_weight)`` tuple, or ``x`` with the
            ``y=``/``sample_weight=`` arguments), a ``tf.data.Dataset``, a
            ``keras.utils.PyDataset``, a torch ``DataLoader``, an iterable or
            generator of batches, or a callable returning such an iterable
            (needed for several epochs from a generator).
        model: the Keras model the batches are for.
        threads: worker threads. One layer's table calls run in batch
            order; different layers' calls run on different threads at once.
        capacity: most batches read and not yet consumed (bounds memory).
        route: None or ``"locality"`` (see `keras_sparse.data.routing`).
        batch_size: batch size for in-memory arrays.
        deterministic: hand batches out in order. False is honored only
            when no table is mutated (``training=False``).
        training: True for ``fit`` (keys are inserted), False for
            ``evaluate``/``predict`` (read-only lookups).
        replicas: replicas for ``route="locality"`` (default: the batch axis
            of the active `keras.distribution`).
        feature_map: ``{layer_name: input_key}`` for subclassed models.
        y: labels, for in-memory arrays.
        sample_weight: sample weights, for in-memory arrays.
        shuffle: shuffle in-memory arrays each pass.
        seed: seed of that shuffle.
        steps: batches per pass for sources without a length.
        passes: close automatically after this many complete passes.
        transfer: copy prepared batches to the device in the workers (JAX
            without a distribution, PyTorch; see `keras_sparse.data.transfer`).
            ``"auto"``: only when the default device is an accelerator.
        dedup: also number each batch's distinct rows per layer in the
            workers (unique rows + inverse), so the step's sparse update
            skips its sort (see `keras_sparse.layers.hash.prepared_inputs`).
            Results are identical either way. Off in multi-process JAX runs.
        bucket: for a row-sharded layer with compact exchange buffers (a
            ``row_exchange_slack``), pack its ids into their owners' buffers
            in the workers (`keras_sparse.sharding.exchange_buckets`), so the
            step skips the packing and its overflow check; an overflowing
            buffer raises in the worker, before the step. Results are
            identical either way.

    Returns:
        A `PrefetchStage` (a `keras.utils.PyDataset`); call ``stats()`` for
        its counters and ``close()`` (or use ``with``) when done.

    Example:

    >>> import numpy as np, keras, keras_sparse as ks
    >>> from keras_sparse.layers import DistributedHashEmbedding
    >>> keys = keras.Input((2,), dtype="int32", name="keys")
    >>> emb = DistributedHashEmbedding(4, capacity=64, combiner="sum",
    ...                                optimizer="adagrad")(keys)
    >>> model = keras.Model(keys, keras.layers.Dense(1)(emb))
    >>> model.compile("sgd", "mse")
    >>> x, y = np.arange(64).reshape(32, 2), np.ones((32, 1))
    >>> with ks.data.prefetch((x, y), model, batch_size=8) as stage:
    ...     _ = model.fit(stage, epochs=1, verbose=0)
    >>> stage.stats()["batches"]
    4
    """
    if threads < 1 or capacity < 1:
        raise ValueError("prefetch: `threads` and `capacity` must be >= 1")
    if route not in (None, "locality"):
        raise ValueError(f"prefetch: route must be None or 'locality'; got {route!r}")
    if route is not None and not training:
        raise ValueError(
            "prefetch: route='locality' permutes samples; it is for training "
            "stages only (training=True)."
        )
    if route is not None:
        replicas = replicas or default_replicas()
        if not replicas:
            raise ValueError(
                "prefetch: route='locality' needs `replicas` (or an active "
                "keras.distribution with a batch axis)."
            )
    # Across processes: this process's replicas, which its batches go to.
    local = local_replicas(replicas) if route is not None else None
    src = make_source(
        source, y=y, sample_weight=sample_weight, batch_size=batch_size,
        steps=steps, shuffle=shuffle, seed=seed,
    )  # fmt: skip
    feeds = plan(model, feature_map)
    if feature_map is None:
        check_sole_readers(model, feeds)
    hash_layers = [f.layer for f in feeds if f.kind == "hash"]
    for layer in hash_layers:
        if not layer.built:
            layer.build()
        if getattr(layer.table, "num_shards", None) is not None:
            raise ValueError(
                f"prefetch: layer '{layer.name}' is key-sharded (a table shard "
                "per device, mapped inside the step on its owner); a prefetch "
                "stage maps keys in one host table, so the two do not combine "
                "yet. Train it without the stage, or plan the layer with "
                "another strategy."
            )
        if has_store(layer) and len(table_users.users(layer)) > 1:
            # Its undo records and row moves would mix with the other's.
            raise ValueError(
                f"prefetch: layer '{layer.name}' has a row store (`store=`) "
                "and shares its table with another layer; give it a table of "
                "its own, or train it without the stage."
            )
    copy_batch = batch_copier(transfer)
    insert = bool(training)
    ordered = bool(deterministic) or (insert and bool(hash_layers))
    engine = Engine(
        feeds, src, int(threads), int(capacity), insert, ordered, route, replicas
    )
    engine.copy_batch = copy_batch
    engine.local_replicas = local
    if insert:
        engine.cached_feeds = cache_ahead.cached_feeds(model, feeds)
    engine.layouts = [
        feed_layout(f.layer, dedup, bucket) if f.kind == "hash" else None for f in feeds
    ]
    engine.words = key_words(feeds, engine.layouts)
    engine.groups, engine.shares = feed_shares(feeds, engine.layouts, engine.words)
    return PrefetchStage(engine, model, hash_layers, passes)
