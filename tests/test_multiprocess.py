"""2 processes x 4 CPU devices (gloo collectives over loopback) train like one
process with 8 devices; a dead peer makes the survivor fail fast (JAX)."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from keras_sparse import optimizers as ks_optimizers

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="sharding is implemented for JAX"
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "multiprocess_train.py"
TIMEOUT = 240  # per launch, generous for a loaded 2-core machine
STEPS = "4"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the script sets its own device count
    env["KERAS_BACKEND"] = "jax"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _launch(*args):
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--steps", STEPS, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        cwd=str(ROOT),
    )


def _finish(proc, timeout=TIMEOUT):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"process did not finish in {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def _result(out):
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _pair(port, *args):
    """Processes 0 and 1 of a 2-process run on ``port``."""
    pair = ["--num-processes", "2", "--port", str(port)]
    return [_launch(*args, *pair, "--process-id", str(i)) for i in range(2)]


# One key-sharded layer per sparse optimizer, all in one model.
OPTIMIZERS = ("sgd", "adagrad", "adam", "rowwise_adagrad", "ftrl")


def _slots(optimizer):
    """``{slot name: initial value}`` of a sparse optimizer."""
    return {s.name: s.initial_value for s in ks_optimizers.get(optimizer).slot_specs()}


def _records(path):
    """``{layer: (its records, {key: {field: value}})}`` one process wrote."""
    lines = pathlib.Path(path).read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("RECORDS ")
    layers = json.loads(lines[0][len("RECORDS ") :])["layers"]
    out = {}
    for name, rec in layers.items():
        fields = [f for f in rec if f not in ("keys", "shards", "stats")]
        out[name] = (
            rec,
            {key: {f: rec[f][i] for f in fields} for i, key in enumerate(rec["keys"])},
        )
    return out


def _hash_runs(out_dir):
    """A key-sharded DistributedHashEmbedding beside a row-sharded table;
    each process writes its records to ``out_dir/<name>.json`` (files, not
    pipes: a full pipe would block a process inside a collective). The
    references: one process of 8 devices, and one device with no
    distribution whose layer holds its keys in 8 host shards (eviction is
    per shard by design; the step runs unsharded)."""
    args = ("--hash", "--steps", "6", "--batch-size", "128")
    args += ("--hash-optimizers", ",".join(OPTIMIZERS))
    port = ["--num-processes", "2", "--port", str(_free_port())]
    runs = {}
    for name, more in (
        ("h0", [*port, "--process-id", "0"]),
        ("h1", [*port, "--process-id", "1"]),
        ("href", ["--num-processes", "1", "--local-devices", "8"]),
        ("hone", ["--num-processes", "1", "--local-devices", "1", *ONE_DEVICE]),
    ):
        out = ["--records-out", str(out_dir / f"{name}.json")]
        runs[name] = _launch(*args, *more, *out)
    return runs


ONE_DEVICE = ["--host-shards", "8"]


def _collection_runs():
    """An EmbeddingCollection (row, column, data and two table-wise tables)."""
    c0, c1 = _pair(_free_port(), "--collection")
    cref = _launch("--collection", "--num-processes", "1", "--local-devices", "8")
    return {"cref": cref, "c0": c0, "c1": c1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The scenarios in waves of launches (5, then 3 and 3 processes).

    The dead-peer scenario times the survivor's failure, so it runs in the
    first wave, beside fewer processes competing for the cores.
    """
    port, kill_port = _free_port(), _free_port()
    p0, p1 = _pair(port, "--route-check")
    procs = {
        "ref": _launch("--num-processes", "1", "--local-devices", "8"),
        "p0": p0,
        "p1": p1,
    }
    # The key-sharded hash model: a peer dies while the survivor's steps run
    # host callbacks and key exchanges.
    kill = ["--hash", "--num-processes", "2", "--port", str(kill_port)]
    kill += ["--heartbeat-timeout", "5"]
    procs["survivor"] = _launch("--process-id", "0", *kill, "--watchdog", "60")
    procs["victim"] = _launch("--process-id", "1", *kill, "--die-at-step", "2")
    try:
        done = {"victim": _finish(procs["victim"])}
        died = time.monotonic()
        done["survivor"] = _finish(procs["survivor"], timeout=90)
        done["survivor_s"] = time.monotonic() - died
        for name in ("ref", "p0", "p1"):
            done[name] = _finish(procs[name])
        procs.update(_collection_runs())
        for name in ("cref", "c0", "c1"):
            done[name] = _finish(procs[name])
        out_dir = tmp_path_factory.mktemp("records")
        procs.update(_hash_runs(out_dir))
        for name in ("href", "hone", "h0", "h1"):
            done[name] = _finish(procs[name])
        done["records"] = out_dir
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def test_two_processes_match_one_process_eight_devices(runs):
    for name in ("ref", "p0", "p1"):
        rc, out = runs[name]
        assert rc == 0, out[-3000:]
    ref, multi = _result(runs["ref"][1]), _result(runs["p0"][1])
    assert (ref["processes"], ref["devices"]) == (1, 8)
    assert (multi["processes"], multi["devices"]) == (2, 8)
    assert len(multi["losses"]) == int(STEPS)
    assert multi["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=1e-5)
    assert multi["checksums"] == pytest.approx(ref["checksums"], rel=1e-5)
    assert f"step {STEPS}" in runs["p1"][1]  # process 1 trained too


def test_locality_routing_places_samples_on_own_process_devices(runs):
    """Each process's ``route="locality"`` stage places its samples among its
    own 4 devices: its batches, put on the devices as a step puts them,
    leave fewer ids away from their row's table shard than its unrouted
    batches, and the stage's byte counters are exactly those ids' bytes."""
    for name in ("p0", "p1"):
        rc, out = runs[name]
        assert rc == 0, out[-3000:]
        lines = [line for line in out.splitlines() if line.startswith("ROUTE ")]
        assert len(lines) == 1, out[-3000:]
        check = json.loads(lines[0][len("ROUTE ") :])
        cost = check["bytes_per_id"]
        assert check["process"] == int(name[1])
        assert check["stage_bytes_unrouted"] == check["remote_ids_unrouted"] * cost
        assert check["stage_bytes_routed"] == check["remote_ids_routed"] * cost
        assert check["remote_ids_routed"] < 0.9 * check["remote_ids_unrouted"]


def test_collection_two_processes_match_one_process(runs):
    for name in ("cref", "c0", "c1"):
        rc, out = runs[name]
        assert rc == 0, out[-3000:]
    ref, multi = _result(runs["cref"][1]), _result(runs["c0"][1])
    assert (multi["processes"], multi["devices"]) == (2, 8)
    assert set(multi["checksums"]) == {"user", "item", "country", "genre", "region"}
    assert multi["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=1e-5)
    assert multi["checksums"] == pytest.approx(ref["checksums"], rel=1e-5)
    assert multi["losses"][-1] < multi["losses"][0]  # it trained


def _assert_hash_runs_match(runs, ref_name, atol):
    """The 2-process records against the run ``ref_name``'s, key by key
    (``atol``: a fraction of each field's largest magnitude)."""
    for name in (ref_name, "h0", "h1"):
        rc, out = runs[name]
        assert rc == 0, out[-3000:]
    ref, multi = _result(runs[ref_name][1]), _result(runs["h0"][1])
    assert (multi["processes"], multi["devices"]) == (2, 8)
    assert multi["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=1e-5)
    assert multi["checksums"] == pytest.approx(ref["checksums"], rel=1e-5)
    out_dir = runs["records"]
    refs = _records(out_dir / f"{ref_name}.json")
    parts = [_records(out_dir / f"h{i}.json") for i in (0, 1)]
    assert set(refs) == {f"hashed_{opt}" for opt in OPTIMIZERS}
    for opt in OPTIMIZERS:
        _assert_layer_matches(f"hashed_{opt}", refs, parts, _slots(opt), atol)
    return ref


def _assert_layer_matches(name, refs, parts, slots, atol):
    """One layer's keys, vector, every optimizer slot, score and counters."""
    ref_rec, want = refs[name]
    (r0, got0), (r1, got1) = (part[name] for part in parts)
    assert (r0["shards"], r1["shards"]) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert not set(got0) & set(got1)
    got = {**got0, **got1}
    assert set(got) == set(want) and len(want) > 100, name
    fields = next(iter(want.values()))
    assert set(fields) == {"values", "scores", *slots}, name
    for field in ("values", *slots):
        # Within ``atol`` of the field's largest magnitude: an adam velocity
        # is ~1e-8 where a vector is ~1e-2.
        tol = atol * max(np.abs(r[field]).max() for r in want.values())
        for key, record in want.items():
            assert got[key][field] == pytest.approx(record[field], abs=tol), (
                name,
                field,
                key,
            )
    for key, record in want.items():
        assert got[key]["scores"] == record["scores"], (name, key)
    for slot, initial in slots.items():  # every slot was trained
        moved = [np.abs(np.subtract(r[slot], initial)).max() for r in want.values()]
        assert max(moved) > 0, (name, slot)
    stats = ref_rec["stats"]
    assert stats["evictions"] > 0 and stats["rejected_admissions"] > 0
    for stat in ("hits", "misses", "inserts", "evictions", "rejected_admissions"):
        assert r0["stats"][stat] + r1["stats"][stat] == stats[stat], (name, stat)


def test_key_sharded_hash_layer_two_processes_match_one_key_by_key(runs):
    """Each process holds and exports only its own devices' table shards;
    together they hold exactly the single-process run's keys, with the same
    vectors, optimizer slots and scores, evictions and admission included:
    one layer per sparse optimizer (sgd, adagrad, adam, rowwise_adagrad,
    ftrl), all trained in the same model."""
    # Gloo and in-process collectives sum in other orders: up to ~2e-7 of
    # a field's largest magnitude (ftrl), so 1e-5 of it.
    ref = _assert_hash_runs_match(runs, "href", atol=1e-5)
    assert (ref["processes"], ref["devices"]) == (1, 8)


def test_key_sharded_hash_layer_two_processes_match_one_device(runs):
    """2 processes x 4 devices against one device in one process (the
    step unsharded, the keys in 8 host shards): the same keys, vectors,
    every slot, scores and counters, evictions and admission included, for
    every sparse optimizer (one layer each in the same model)."""
    # Partial sums of hot keys' gradients reorder across devices: 1e-5
    # of each field's largest magnitude.
    ref = _assert_hash_runs_match(runs, "hone", atol=1e-5)
    assert (ref["processes"], ref["devices"]) == (1, 1)
    hone = _records(runs["records"] / "hone.json")
    assert all(rec["shards"] == [] for rec, _ in hone.values())


def test_killed_peer_fails_the_survivor_quickly(runs):
    """Also inside key-sharded steps (the scenario trains the hash model)."""
    rc_victim, _ = runs["victim"]
    rc, out = runs["survivor"]
    assert rc_victim == -9
    assert rc != 0, out[-3000:]
    assert runs["survivor_s"] < 75
    assert "ERROR" in out and "peer process" in out, out[-3000:]
    assert "RESULT" not in out
