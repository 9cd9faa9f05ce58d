"""Delta exports of a hash layer: what changed after a step.

``layer.export(since_step=s)`` of a layer built with ``track_changes=True``
returns the records (``keys``, ``values``, slots, ``scores``) of the keys
whose record may have changed after step ``s``, plus ``removed_keys``: the
keys the layer held at step ``s`` (or got after it) and no longer holds
(evicted, expired, erased). Steps are the table's clock: the training
steps the layer has taken (`keras_sparse.table.changes`). A delta is
self-describing: ``layer`` (its name), ``since_step``, ``step`` (the clock
it was taken at) and ``dtype`` (of ``values``). `apply_delta` applies
deltas in order to older records::

    full = layer.export(since_step=-1)         # everything, as a delta
    ...                                        # train
    d1 = layer.export(since_step=int(full["step"]))
    ...
    d2 = layer.export(since_step=int(d1["step"]))
    apply_delta(full, d1, d2)                  # == layer.export(since_step=-1)

``since_step=-1`` gives every record (a *full* delta, with no removed
keys): the base of a chain. The layer's checkpoints keep the change steps
and removed keys, so a chain continues across a save and load.
"""

import numpy as np

from keras_sparse.table import change_keys

#: Entries describing a delta (the others are per-key records).
META = ("layer", "since_step", "step", "dtype", "removed_keys")
FULL = -1  # `since_step` of a full delta


def checked_flag(layer_name, name, value):
    """``value`` as a bool; raises ValueError naming the layer and argument."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(
            f"Layer '{layer_name}': `{name}` must be True or False. "
            f"Received: {name}={value!r}."
        )
    return bool(value)


def _check_tracked(layer):
    if not change_keys.tracks_changes(layer.table):
        raise ValueError(
            f"Layer '{layer.name}': `export(since_step=...)` needs the layer "
            "built with `track_changes=True` (it keeps each key's step of "
            "last change and the removed keys); this layer has "
            "track_changes=False."
        )


def layer_step(layer, trained=None):
    """The layer's step (its table clock, as of its last trained step)."""
    return int(layer._table_clock() if trained is None else trained.clock)


def trained_step(layer):
    """The layer's step as of its last trained step (a stage may have
    mapped batches ahead of it)."""
    return layer_step(layer, layer._trained_table())


def forget_removals(layer, through_step):
    """`DistributedHashEmbedding.forget_removals`: see there."""
    _check_tracked(layer)
    low, step = change_keys.horizon(layer.table), trained_step(layer)
    if (
        isinstance(through_step, bool)
        or not isinstance(through_step, (int, np.integer))
        or not low <= through_step <= step
    ):
        raise ValueError(
            f"Layer '{layer.name}': `forget_removals` takes a step in "
            f"[{low}, {step}] (the oldest step deltas can start from, and "
            f"the last trained step). Received: through_step={through_step!r}."
        )
    return change_keys.forget_removals(layer.table, int(through_step))


def delta_records(layer, since_step, include_rows, progress):
    """`export(since_step=...)`: see the module docstring."""
    _check_tracked(layer)
    trained = layer._trained_table()
    step = layer_step(layer, trained)
    low = change_keys.horizon(layer.table)
    if (
        isinstance(since_step, bool)
        or not isinstance(since_step, (int, np.integer))
        or not (since_step == FULL or low <= since_step <= step)
    ):
        raise ValueError(
            f"Layer '{layer.name}': `since_step` must be -1 (every record) or "
            f"an integer in [{low}, {step}] (the steps whose removals the "
            f"layer knows, up to its current step). Received: "
            f"since_step={since_step!r}."
        )
    out = layer._records_out(include_rows, progress, trained)
    dtype = out["values"].dtype
    gone, gone_steps = change_keys.removed_keys(layer.table)
    if since_step == FULL:
        removed = gone[:0]
    else:
        changed = change_keys.keys_changed(layer.table, out["keys"])
        # A key the table lacks (in the row store, or evicted by batches an
        # input stage mapped ahead): changed when it was removed.
        lacking = changed == change_keys.UNKNOWN
        lost = out["keys"][lacking]
        at = np.minimum(np.searchsorted(gone, lost), max(len(gone) - 1, 0))
        hit = gone[at] == lost if len(gone) else np.zeros(len(lost), bool)
        changed[lacking] = np.where(hit, gone_steps[at] if len(gone) else -1, -1)
        # A key held now is not removed: its record is here if it changed.
        removed = gone[(gone_steps > since_step) & ~np.isin(gone, out["keys"])]
        keep = changed > since_step
        out = {name: value[keep] for name, value in out.items()}
    out["removed_keys"] = removed
    out.update(
        layer=np.str_(layer.name),
        since_step=np.int64(since_step),
        step=np.int64(step),
        dtype=np.str_(dtype.name),
    )
    return out


# ------------------------------------------------------------------- apply
def _scalar(delta, name, what):
    if name not in delta:
        raise ValueError(
            f"`apply_delta`: {what} has no '{name}' entry: not a delta "
            "(`layer.export(since_step=...)`)."
        )
    return np.asarray(delta[name]).item()


def apply_delta(base, *deltas):
    """Records of ``base`` (a full delta, ``layer.export(since_step=-1)``,
    or an earlier result) updated by ``deltas`` in order: their keys'
    records replace or join the base's, their ``removed_keys`` leave it.
    Returns a full delta (records in key order) at the last delta's step.

    For a collection (``{field: delta}`` dicts, see
    ``HashEmbeddingCollection.export``) each field is applied on its own.

    Raises ValueError, naming the layer and the steps, for a delta of
    another layer, of another dtype or record names, or one that does not
    start where the records end (``since_step`` must equal their
    ``step``; a full delta replaces them).
    """
    if base and all(isinstance(v, dict) for v in base.values()):
        for d in deltas:
            if set(d) != set(base):
                raise ValueError(
                    f"`apply_delta`: a collection delta holds fields "
                    f"{sorted(d)}, the records {sorted(base)}."
                )
        return {f: apply_delta(base[f], *(d[f] for d in deltas)) for f in base}
    out = dict(base)
    name = _scalar(out, "layer", "the base")
    step = _scalar(out, "step", "the base")
    for i, delta in enumerate(deltas):
        what = f"delta {i}"
        other = _scalar(delta, "layer", what)
        since = _scalar(delta, "since_step", what)
        if other != name:
            raise ValueError(
                f"`apply_delta`: {what} is of layer '{other}', the records of "
                f"layer '{name}'; nothing was applied."
            )
        if since != FULL and since != step:
            raise ValueError(
                f"`apply_delta`: {what} of layer '{name}' covers steps "
                f"({since}, {_scalar(delta, 'step', what)}], but the records "
                f"are at step {step}: apply deltas in order, each starting at "
                "the step the records end at; nothing was applied."
            )
        if _scalar(delta, "dtype", what) != _scalar(out, "dtype", "the base"):
            raise ValueError(
                f"`apply_delta`: {what} of layer '{name}' has dtype "
                f"{_scalar(delta, 'dtype', what)}, the records "
                f"{_scalar(out, 'dtype', 'the base')}; nothing was applied."
            )
        fields = sorted(set(delta) - set(META))
        if since != FULL and fields != sorted(set(out) - set(META)):
            raise ValueError(
                f"`apply_delta`: {what} of layer '{name}' holds records "
                f"{fields}, the base {sorted(set(out) - set(META))}."
            )
        out = _merged(out, delta, fields, since == FULL)
        step = _scalar(delta, "step", what)
    return out


def _merged(out, delta, fields, full):
    keys = np.asarray(delta["keys"], np.int64)
    if full:
        merged = {f: np.asarray(delta[f]) for f in fields}
    else:
        drop = np.concatenate([np.asarray(delta["removed_keys"], np.int64), keys])
        stay = ~np.isin(np.asarray(out["keys"], np.int64), drop)
        merged = {
            f: np.concatenate([np.asarray(out[f])[stay], np.asarray(delta[f])])
            for f in fields
        }
    order = np.argsort(merged["keys"], kind="stable")
    merged = {f: v[order] for f, v in merged.items()}
    merged["removed_keys"] = keys[:0]
    for m in ("layer", "step", "dtype"):
        merged[m] = delta[m]
    merged["since_step"] = np.int64(FULL)
    return merged


# ------------------------------------------------------------- checkpoints
_STEPS, _GONE, _GONE_STEPS, _HORIZON = (
    "change_steps",
    "removed_keys",
    "removed_steps",
    "change_horizon",
)


def save(layer, store, keys):
    """Writes the saved ``keys``' change steps and the removal log."""
    if not change_keys.tracks_changes(layer.table):
        return
    local = getattr(layer.table, "local", None)
    if local is not None and len(local) < layer.table.num_shards:
        # Other processes' removals are not here: the load starts afresh.
        return
    steps = change_keys.keys_changed(layer.table, keys)
    gone, gone_steps = change_keys.removed_keys(layer.table)
    # Keys only in the row store: changed when they were removed.
    lacking = steps == change_keys.UNKNOWN
    steps[lacking] = -1
    store[_STEPS] = steps
    store[_GONE], store[_GONE_STEPS] = gone, gone_steps
    store[_HORIZON] = np.int64(change_keys.horizon(layer.table))


def checked(layer, store):
    """What `save` wrote, or None (then removals before the load step are
    unknown: deltas since an earlier step are refused)."""
    if not change_keys.tracks_changes(layer.table):
        return None
    if _STEPS not in set(store.keys()):
        return None
    keys = np.asarray(store["record_keys"][...], np.int64).reshape(-1)
    steps = np.asarray(store[_STEPS][...], np.int64).reshape(-1)
    gone = np.asarray(store[_GONE][...], np.int64).reshape(-1)
    gone_steps = np.asarray(store[_GONE_STEPS][...], np.int64).reshape(-1)
    if steps.shape != keys.shape or gone.shape != gone_steps.shape:
        raise ValueError(
            f"Layer '{layer.name}': the saved `{_STEPS}` must hold one step "
            f"per saved key ({keys.size}) and `{_GONE_STEPS}` one per removed "
            f"key ({gone.size}); received {steps.size} and {gone_steps.size}."
        )
    return keys, steps, gone, gone_steps, int(np.asarray(store[_HORIZON][...]))


def load(layer, saved):
    """Restores what `checked` read, after the records were loaded."""
    if not change_keys.tracks_changes(layer.table):
        return
    if saved is None:
        clock = layer._table_clock()
        change_keys.set_changes(layer.table, [], [], [], [], clock)
        return
    change_keys.set_changes(layer.table, *saved)
