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
import pytest

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


def _records(path):
    """The key-sharded layer's records one process wrote, by key."""
    lines = pathlib.Path(path).read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("RECORDS ")
    rec = json.loads(lines[0][len("RECORDS ") :])
    return rec, {
        key: (value, acc, score)
        for key, value, acc, score in zip(
            rec["keys"], rec["values"], rec["accumulator"], rec["scores"]
        )
    }


def _hash_runs(out_dir):
    """A key-sharded DistributedHashEmbedding beside a row-sharded table;
    each process writes its records to ``out_dir/<name>.json`` (files, not
    pipes: a full pipe would block a process inside a collective). The
    references: one process of 8 devices, and one device with no
    distribution whose layer holds its keys in 8 host shards (eviction is
    per shard by design; the step runs unsharded)."""
    args = ("--hash", "--steps", "6", "--batch-size", "128")
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
    p0, p1 = _pair(port)
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
    """The 2-process records against the run ``ref_name``'s, key by key."""
    for name in (ref_name, "h0", "h1"):
        rc, out = runs[name]
        assert rc == 0, out[-3000:]
    ref, multi = _result(runs[ref_name][1]), _result(runs["h0"][1])
    assert (multi["processes"], multi["devices"]) == (2, 8)
    assert multi["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=1e-5)
    assert multi["checksums"] == pytest.approx(ref["checksums"], rel=1e-5)
    out_dir = runs["records"]
    ref_rec, want = _records(out_dir / f"{ref_name}.json")
    (r0, got0), (r1, got1) = (_records(out_dir / f"h{i}.json") for i in (0, 1))
    assert (r0["shards"], r1["shards"]) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert not set(got0) & set(got1)
    got = {**got0, **got1}
    assert set(got) == set(want) and len(want) > 100
    for key, (value, acc, score) in want.items():
        assert got[key][0] == pytest.approx(value, abs=atol), key
        assert got[key][1] == pytest.approx(acc, abs=atol), key
        assert got[key][2] == score, key
    stats = ref_rec["stats"]
    assert stats["evictions"] > 0 and stats["rejected_admissions"] > 0
    for name in ("hits", "misses", "inserts", "evictions", "rejected_admissions"):
        assert r0["stats"][name] + r1["stats"][name] == stats[name], name
    return ref


def test_key_sharded_hash_layer_two_processes_match_one_key_by_key(runs):
    """Each process holds and exports only its own devices' table shards;
    together they hold exactly the single-process run's keys, with the same
    vectors, optimizer slots and scores, evictions and admission included."""
    ref = _assert_hash_runs_match(runs, "href", atol=1e-6)
    assert (ref["processes"], ref["devices"]) == (1, 8)


def test_key_sharded_hash_layer_two_processes_match_one_device(runs):
    """2 processes x 4 devices against one device in one process (the
    step unsharded, the keys in 8 host shards): the same keys, vectors,
    slots, scores and counters, evictions and admission included."""
    # Partial sums of hot keys' gradients reorder across devices: 1e-5.
    ref = _assert_hash_runs_match(runs, "hone", atol=1e-5)
    assert (ref["processes"], ref["devices"]) == (1, 1)
    assert _records(runs["records"] / "hone.json")[0]["shards"] == []


def test_killed_peer_fails_the_survivor_quickly(runs):
    """Also inside key-sharded steps (the scenario trains the hash model)."""
    rc_victim, _ = runs["victim"]
    rc, out = runs["survivor"]
    assert rc_victim == -9
    assert rc != 0, out[-3000:]
    assert runs["survivor_s"] < 75
    assert "ERROR" in out and "peer process" in out, out[-3000:]
    assert "RESULT" not in out
