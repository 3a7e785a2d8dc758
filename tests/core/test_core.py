"""core: atomic writes, JSONL metric logging, seeding, relative-RMS closeness, memory sampling, assets."""

from __future__ import annotations

import json

import pytest
import torch

from icml26.core import io
from icml26.core.assets import MissingAssetError, cache_dir, require
from icml26.core.logging import JsonlLogger, log_metrics, metric_log, read_jsonl
from icml26.core.memory import PeakRSS, optimizer_state_bytes
from icml26.core.seeding import seed_everything
from icml26.core.testing import assert_close, relative_rms_error, tiny_tensor, tiny_tokens


def test_atomic_write_replaces_whole_file_and_keeps_old_one_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "r.json"
    io.atomic_write_json(target, {"a": 1, "bad": float("inf"), "t": torch.tensor(2.5)})
    assert json.loads(target.read_text()) == {"a": 1, "bad": "inf", "t": 2.5}

    def broken(handle):
        handle.write('{"half": ')
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        io._atomic_write(target, broken, "w")
    assert json.loads(target.read_text())["a"] == 1  # the old file is intact
    assert [p.name for p in target.parent.iterdir()] == ["r.json"]  # no temporary left behind


def test_jsonl_logger_and_active_metric_log(tmp_path):
    path = tmp_path / "m.jsonl"
    log_metrics(0, loss=9.0)  # no active log: a no-op
    with metric_log(path):
        log_metrics(1, loss=0.5)
        log_metrics(2, loss=float("nan"))
    with JsonlLogger(path) as logger:
        logger.log(3, loss=0.25)
    with open(path, "a") as handle:
        handle.write('{"step": 4, "lo')  # a torn last line, as after a kill
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2, 3] and records[1]["loss"] == "nan"


def test_seed_everything_repeats_and_validates():
    gen = seed_everything(7)
    a = (torch.rand(3), torch.rand(2, generator=gen))
    gen = seed_everything(7)
    b = (torch.rand(3), torch.rand(2, generator=gen))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="seed"):
        seed_everything(-1)


def test_assert_close_uses_relative_rms():
    ref = tiny_tensor(50, 7, seed=1)
    assert_close("same", ref, ref.clone(), 0.0)
    noisy = ref + 1e-4 * tiny_tensor(50, 7, seed=2)
    assert relative_rms_error(ref, noisy) == pytest.approx(1e-4, rel=0.2)
    assert_close("noisy", ref, noisy, 1e-3)
    with pytest.raises(AssertionError, match="relative RMS"):
        assert_close("noisy", ref, noisy, 1e-5)
    with pytest.raises(AssertionError, match="shape"):
        assert_close("shape", ref, ref.T, 1.0)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close("nan", ref, ref.clone().fill_(float("nan")), 1.0)
    assert tiny_tokens(2, 5, 11).max() < 11 and torch.equal(tiny_tokens(2, 5, 11), tiny_tokens(2, 5, 11))


def test_peak_rss_sees_an_allocation_and_state_bytes_count_tensors():
    with PeakRSS() as mem:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del block
    assert mem.delta_bytes > 32 * 2**20
    param = torch.nn.Parameter(torch.zeros(10))
    opt = torch.optim.Adam([param])
    param.grad = torch.ones(10)
    opt.step()
    assert optimizer_state_bytes(opt) == 2 * 10 * 4 + 4  # exp_avg, exp_avg_sq, float32 step tensor


def test_missing_asset_names_the_install_command(tmp_path, monkeypatch):
    with pytest.raises(MissingAssetError, match=r"pip install 'icml26\[x\]'"):
        require("definitely_not_a_module_xyz", "pip install 'icml26[x]'", purpose="a test")
    monkeypatch.setenv("ICML26_CACHE", str(tmp_path / "c"))
    assert cache_dir("a", "b") == tmp_path / "c" / "a" / "b" and (tmp_path / "c" / "a" / "b").is_dir()
