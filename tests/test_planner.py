"""The sharding planner's choices (pure Python)."""

import pytest

import keras_sparse as ks
from keras_sparse.sharding import TableSpec
from keras_sparse.sharding import plan

pytestmark = pytest.mark.backend_independent

MiB = 1 << 20
GiB = 1 << 30


def test_small_tables_are_replicated():
    tables = [TableSpec(f"t{i}", 1000, 16, slot_widths=[16]) for i in range(4)]
    p = plan(tables, devices=8, memory_per_device=GiB, batch_size=4096)
    assert {t.strategy for t in p} == {"data"}
    # Replicated tables cost their full size on every device.
    assert p["t0"].bytes_per_device == 1000 * 32 * 4
    assert p["t0"].devices == tuple(range(8))


def test_huge_table_is_row_sharded():
    huge = TableSpec("huge", 80_000_000, 64, slot_widths=[1])
    small = TableSpec("small", 100, 8)
    p = plan([huge, small], devices=8, memory_per_device=4 * GiB, batch_size=1024)
    assert p.strategy("huge") == "row"
    assert p["huge"].bytes_per_device == 80_000_000 * 65 * 4 // 8
    assert p.strategy("small") == "data"


def test_medium_table_goes_table_wise_when_row_impossible():
    # 1000003 rows: not divisible by 8 and no sparse optimizer (so no
    # padding), too big to replicate everywhere, fits whole on one device.
    t = TableSpec("odd", 1_000_003, 32, sparse_update=False)
    p = plan([t], devices=8, memory_per_device=200 * MiB, batch_size=64, pinned=None)
    assert p.strategy("odd") in ("data", "table")
    p = plan(
        [t],
        devices=8,
        memory_per_device=200 * MiB,
        batch_size=64,
        strategies=("row", "column", "table"),
    )
    assert p.strategy("odd") in ("table", "column")


def test_uneven_rows_are_row_sharded_with_padding():
    t = TableSpec("odd", 1_000_003, 32, slot_widths=[32])
    p = plan([t], devices=8, strategies=("row",))
    assert p.strategy("odd") == "row"
    # ceil(1000003 / 8) rows per device, table + accumulator.
    assert p["odd"].bytes_per_device == 125_001 * 64 * 4


def test_table_wise_bin_packing_spreads_tables():
    tables = [TableSpec(f"t{i}", 2_000_000 + 8 * i, 16) for i in range(8)]
    p = plan(
        tables,
        devices=8,
        memory_per_device=200 * MiB,
        batch_size=8192,
        strategies=("table",),
    )
    assert sorted(d for t in p for d in t.devices) == list(range(8))


def test_pinned_is_honoured():
    tables = [TableSpec("a", 1000, 16), TableSpec("b", 1000, 16)]
    p = plan(tables, devices=8, pinned={"a": "row", "b": "column"})
    assert p.strategy("a") == "row" and p.strategy("b") == "column"
    assert "pinned" in p["a"].reason


def test_layer_sharding_counts_as_pinned_and_slots_counted():
    layer = ks.AllToAllDenseEmbedding(1024, 8, optimizer="adagrad", sharding="row")
    other = ks.AllToAllDenseEmbedding(64, 8, optimizer="rowwise_adagrad")
    p = plan([layer, other], devices=8)
    assert p.strategy(layer.name) == "row"
    # Table + per-element accumulator, split over 8 devices.
    assert p[layer.name].bytes_per_device == 1024 * 16 * 4 // 8
    assert p[other.name].spec.slot_widths == (1,)


def test_infeasible_raises_naming_the_table():
    t = TableSpec("giant", 1_000_000_000, 128)
    with pytest.raises(ValueError, match="giant.*1000000000 rows x 128 dim"):
        plan([t], devices=8, memory_per_device=GiB)


def test_bad_pins_raise():
    t = TableSpec("a", 100, 8)
    with pytest.raises(ValueError, match="unknown tables"):
        plan([t], pinned={"zzz": "row"})
    with pytest.raises(ValueError, match="pinned strategy"):
        plan([t], pinned={"a": "diagonal"})
    with pytest.raises(ValueError, match="not divisible"):
        plan(
            [TableSpec("odd", 101, 8, sparse_update=False)],
            devices=8,
            pinned={"odd": "row"},
        )


def test_plan_prints_a_table():
    tables = [TableSpec("small", 100, 8), TableSpec("huge", 80_000_000, 64)]
    text = str(plan(tables, devices=8, memory_per_device=4 * GiB))
    lines = text.splitlines()
    assert lines[0].split() == [
        "table",
        "rows",
        "dim",
        "strategy",
        "devices",
        "bytes/device",
        "comm",
        "bytes/step",
    ]
    assert any(line.startswith("huge") and " row " in line for line in lines)
    assert any(line.startswith("small:") for line in lines)  # reason line


def test_memory_is_held_back_for_later_tables():
    # 26 tables of growing size: replicating them all needs ~180 MiB/device,
    # sharding them all ~22 MiB. With 32 MiB the small ones are replicated and
    # the big ones sharded, and nothing is left without room.
    rows = [8 * int(2 * 1.45**i) for i in range(26)]
    tables = [
        TableSpec(f"t{i:02d}", r, 16, slot_widths=[16]) for i, r in enumerate(rows)
    ]
    p = plan(
        tables,
        devices=8,
        memory_per_device=32 * MiB,
        batch_size=256,
        strategies=("data", "row", "column"),
    )
    strategies = [p.strategy(f"t{i:02d}") for i in range(26)]
    assert strategies[0] == "data" and strategies[-1] == "row"
    assert max(p.device_bytes) <= 32 * MiB


def test_hash_embedding_tables_are_planned_like_fixed_ones():
    if not hasattr(ks, "DistributedHashEmbedding"):
        pytest.skip("no DistributedHashEmbedding")
    layer = ks.DistributedHashEmbedding(8, capacity=1024, optimizer="adagrad")
    p = plan([layer], devices=8)
    assert p.strategy(layer.name) == "data"  # small: replicated
    # Too big to replicate: split like a fixed-vocabulary table.
    full = 1024 * 16 * 4  # table + accumulator
    p = plan([layer], devices=8, memory_per_device=full // 4)
    assert p.strategy(layer.name) in ("row", "column")
    assert p[layer.name].bytes_per_device == full // 8
