"""The TabICLv2 ablation benchmark's pieces: the shared prior cache, per-dataset evaluation, paired intervals, the
win rule's null arm, and the lr-grid edge extension."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from icml26.methods.tabicl2 import pretrain
from icml26.methods.tabicl2.config import TabICLConfig
from icml26.methods.tabicl2.prior import sample_batch
from icml26.methods.tabicl2.reference import TabICL

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def abl():
    spec = importlib.util.spec_from_file_location("tabicl2_ablations", ROOT / "benchmarks" / "tabicl2_ablations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_cfg(**kw) -> TabICLConfig:
    return TabICLConfig(embed_dim=8, col_num_inds=4, col_nhead=2, row_num_blocks=1, row_nhead=2, row_num_cls=2,
                        icl_num_blocks=1, icl_nhead=2, ssmax_hidden=8, **kw)


def test_data_cache_gives_identical_batches_and_training(tmp_path):
    """--data-cache stores the very batches the loop would generate, and a run reading them trains identically."""
    args = pretrain.parse_args(["--min-rows", "16", "--max-rows", "32", "--max-features", "4", "--batch", "2"])
    X0, y0, n0 = pretrain.step_batch(args, 3, 0)
    args.data_cache = str(tmp_path / "cache")
    X1, y1, n1 = pretrain.step_batch(args, 3, 0)   # written
    X2, y2, n2 = pretrain.step_batch(args, 3, 0)   # read back
    assert n0 == n1 == n2 and torch.equal(X0, X1) and torch.equal(X0, X2) and torch.equal(y0, y2)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    model = json.dumps(tiny_cfg().to_dict())
    common = ["--steps", "2", "--min-rows", "16", "--max-rows", "32", "--max-features", "4", "--batch", "2",
              "--val-batches", "1", "--model", model]
    pretrain.main(["--out", str(tmp_path / "a"), *common])
    pretrain.main(["--out", str(tmp_path / "b"), "--data-cache", str(tmp_path / "c2"), *common])
    pretrain.main(["--out", str(tmp_path / "c"), "--data-cache", str(tmp_path / "c2"), *common])  # from the cache
    sa, sb, sc = (torch.load(tmp_path / d / "state.pt", weights_only=False)["model"] for d in "abc")
    for k in sa:
        assert torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sc[k]), k


def test_per_dataset_metrics_match_pretrain_evaluate(abl):
    """Mean of the per-dataset CE equals pretraining's batch CE (equal test rows per dataset); the short context is
    the same forward as a dataset cut to its first n_ctx training rows."""
    torch.manual_seed(0)
    model = TabICL(tiny_cfg())
    X, y = (torch.from_numpy(a) for a in sample_batch(11, 3, 40 + 7, 5, 40))
    m = abl.per_dataset_metrics(model, [(X, y)], 40, 40)
    ref = pretrain.evaluate(model, [(X, y, 40)], torch.device("cpu"))
    assert m["ce"].shape == (3,) and m["acc"].shape == (3,)
    assert m["ce"].mean() == pytest.approx(ref["val_ce"], rel=1e-5)
    assert m["acc"].mean() == pytest.approx(ref["val_acc"], rel=1e-6)
    short = abl.per_dataset_metrics(model, [(X, y)], 9, 40)
    Xc, yc = torch.cat([X[:, :9], X[:, 40:]], 1), torch.cat([y[:, :9], y[:, 40:]], 1)
    with torch.no_grad():
        logits = model(Xc, yc[:, :9])
    n_cls = y[:, :40].max(1).values + 1
    for d in range(3):
        lg = logits[d, :, : int(n_cls[d])]
        ce = torch.nn.functional.cross_entropy(lg, yc[d, 9:]).item()
        assert short["ce"][d] == pytest.approx(ce, rel=1e-5)


def test_paired_ci_and_reading(abl):
    rng = np.random.default_rng(0)
    a = rng.normal(size=96)
    null = abl.paired_ci(a, a)                      # null arm: an arm against itself
    assert null == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    assert abl.read(null, 0.0) == "no difference shown"
    shifted = abl.paired_ci(a + 0.5, a)
    assert shifted["mean"] == pytest.approx(0.5) and shifted["lo"] == pytest.approx(0.5)
    assert abl.read(shifted, 0.1) == "better" and abl.read(shifted, 0.6) == "no difference shown"
    assert abl.read(abl.paired_ci(a - 0.5, a), 0.1) == "worse"
    noisy = abl.paired_ci(a + rng.normal(size=96), a)
    assert noisy["lo"] < noisy["mean"] < noisy["hi"]
    with pytest.raises(ValueError, match="paired_ci"):
        abl.paired_ci(np.ones(1), np.ones(1))


def test_lr_grid_extends_once_beyond_an_edge(abl):
    grid = (1e-3, 3e-3, 9e-3)
    assert abl.next_lr({1e-3: 1.0, 3e-3: 0.9, 9e-3: 1.1}, grid) is None           # interior
    assert abl.next_lr({1e-3: 1.0, 3e-3: 0.9, 9e-3: 0.8}, grid) == pytest.approx(2.7e-2)
    assert abl.next_lr({1e-3: 0.7, 3e-3: 0.9, 9e-3: 1.0}, grid) == pytest.approx(1e-3 / 3)
    # after the one extension the choice is final, wherever the best lies
    assert abl.next_lr({1e-3: 1.0, 3e-3: 0.9, 9e-3: 0.8, 2.7e-2: 0.7}, grid) is None
    assert abl.next_lr({1e-3: 1.0, 3e-3: 0.9, 9e-3: 0.8, 2.7e-2: 0.95}, grid) is None
    assert abl.next_lr({3.3e-4: 0.6, 1e-3: 0.7, 3e-3: 0.8, 1.1e-4: 0.9}, (3.3e-4, 1e-3, 3e-3)) is None


def test_cli_rejects_bad_arguments(abl, tmp_path):
    with pytest.raises(SystemExit, match="unknown arms"):
        abl.main(["--arms", "nope", "--dir", str(tmp_path), "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="steps"):
        abl.main(["--steps", "0", "--dir", str(tmp_path), "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
