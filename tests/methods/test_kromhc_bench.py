"""The KromHC step benchmark: its BENCH ratio paths resolve in the JSON it really writes, and its traffic bound."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from icml26.harness.bench import json_path, read_entry

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kromhc_step.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("kromhc_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_traffic_bound_is_the_hand_computed_byte_count(script):
    size = {"d_model": 128, "n_layers": 6, "n_heads": 4, "seq_len": 256, "batch_size": 8}
    bound = script.traffic_bound(size, 4, bandwidth_gbs=2 * 2**20 / 1e6)  # 2 MiB per ms
    # N = 2048 tokens: the stream is 2048 * 4 * 128 * 4 B = 4 MiB; 12 sub-layers * (5 * 4 MiB - 3 * 1 MiB) = 204 MiB.
    assert bound["stream_bytes"] == 4 * 2**20 and bound["sublayers"] == 12
    assert bound["min_extra_bytes_per_step"] == 204 * 2**20
    assert bound["min_extra_ms_per_step_at_bandwidth"] == pytest.approx(102.0)


@pytest.mark.slow  # builds four TinyLMs and imports the room (transformers): tens of seconds on a loaded machine
def test_bench_entry_paths_resolve_in_a_micro_run(script, monkeypatch):
    monkeypatch.setitem(script.SIZES, "full", {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 8,
                                               "batch_size": 2})
    sizes = script.measure("full", ["residual", "kromhc", "mhc_lite", "hc"], rounds=2, num_streams=4, threads=[1])
    result = {"sizes": sizes}
    entry = read_entry(SCRIPT)
    for label, path in entry["ratios"].items():
        value = json_path(result, path)
        assert isinstance(value, float) and value > 0, label
    rows = sizes[0]["rows"]
    assert [r["arm"] for r in rows] == ["residual", "kromhc", "mhc_lite", "hc"]
    assert rows[0]["ratio_to_residual_median"] == 1.0 and len(rows[1]["cpu_ms_all"]) == 2
