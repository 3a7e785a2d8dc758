"""Every registered claim runs end to end at the smoke tier through the CLI (CleanRL-style subprocess run)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from icml26.harness.runner import reproducible_rooms, specs_for


@pytest.mark.parametrize("room", reproducible_rooms())
def test_room_claims_run_at_smoke_tier(room, tmp_path):
    env = {**os.environ, "ICML26_PROGRESS": "0", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "icml26.cli", "reproduce", room, "--tier", "smoke", "--out",
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    for spec in specs_for(room):
        result = json.loads((tmp_path / room / f"{spec.id}.json").read_text())
        assert result["status"] == "complete" and result["verdict"] == "inconclusive"
        assert set(result["arms"]) <= set(spec.arms) and spec.baseline in result["arms"]
        for arm, metrics in result["arms"].items():
            finite = [m["mean"] for m in metrics.values() if isinstance(m["mean"], float) and math.isfinite(m["mean"])]
            assert finite, f"{spec.id}/{arm}: no finite metric"
        assert (tmp_path / room / f"{spec.id}.png").exists()
    assert (tmp_path / "report.html").exists() and (tmp_path / "report.md").exists()
