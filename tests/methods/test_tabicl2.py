"""TabICLv2 room: network properties, prior, Muon, pretraining (few steps + resume)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from icml26.methods.tabicl2 import reference as ref
from icml26.methods.tabicl2.config import TabICLConfig
from icml26.methods.tabicl2.muon import Muon, muon_lr_scale, newton_schulz5
from icml26.methods.tabicl2.prior import PriorConfig, prior_hash, sample_batch, sample_dataset
from icml26.methods.tabicl2.reference import QASSMax, SSMax, TabICL, group_features

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(embed_dim=16, col_nhead=2, row_nhead=2, icl_nhead=2, col_num_inds=4, icl_num_blocks=2,
             ssmax_hidden=8)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    m = TabICL(TabICLConfig(**{**SMALL, **kw})).double().eval()
    # perturb the zero-initialised QASSMax layer so the query-aware path is exercised by the tests
    for mod in m.modules():
        if isinstance(mod, QASSMax):
            torch.nn.init.normal_(mod.query_mlp[-1].weight, std=0.3)
    return m


def _table(B=2, T=23, H=5, n_train=15, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    y = torch.randint(0, k, (B, n_train), generator=g)
    return X, y


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="embed_dim"):
        TabICLConfig(embed_dim=30, col_nhead=4)
    with pytest.raises(ValueError, match="ssmax"):
        TabICLConfig(ssmax="flash")
    with pytest.raises(ValueError, match="softmax_temperature"):
        TabICLConfig(softmax_temperature=0)


@pytest.mark.parametrize("H", [1, 2, 5, 7])
def test_shapes(H):
    m = _model()
    X, y = _table(H=H)
    out = m(X, y)
    assert out.shape == (2, 23 - 15, 10)
    assert torch.isfinite(out).all()
    p = m.predict_proba(X, y, n_classes=3)
    assert p.shape == (2, 8, 3)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 8, dtype=torch.float64))


def test_feature_groups_circular_shifts():
    H = 7
    X = torch.arange(H, dtype=torch.float64).view(1, 1, H)
    g = group_features(X, 3)[0, 0]
    assert g.shape == (H, 3)
    for j in range(H):
        assert g[j].tolist() == [(j + 1) % H, (j + 2) % H, (j + 4) % H]
    counts = np.bincount(g.flatten().long().numpy(), minlength=H)
    assert (counts == 3).all()  # every feature in exactly 3 groups, G = H


def test_test_rows_do_not_influence_each_other():
    m = _model()
    X, y = _table()
    out = m(X, y)
    X2 = X.clone()
    X2[:, 18:] = torch.randn_like(X2[:, 18:]) * 5  # change other test rows
    out2 = m(X2, y)
    torch.testing.assert_close(out[:, :3], out2[:, :3], rtol=0, atol=1e-10)
    # a test row alone gives the same prediction as in a batch of test rows
    alone = m(X[:, :16], y)
    torch.testing.assert_close(alone[:, 0], out[:, 0], rtol=0, atol=1e-10)
    assert not torch.allclose(out[:, 4:], out2[:, 4:])  # the changed rows did change


def test_train_rows_matter_and_permutation_invariance():
    m = _model()
    X, y = _table()
    out = m(X, y)
    perm = torch.randperm(15, generator=torch.Generator().manual_seed(3))
    Xp = X.clone()
    Xp[:, :15] = X[:, perm]
    out_p = m(Xp, y[:, perm])
    torch.testing.assert_close(out, out_p, rtol=0, atol=1e-9)
    # changing one training label changes the test predictions (the context is used)
    y2 = y.clone()
    y2[:, 0] = (y2[:, 0] + 1) % 3
    assert (m(X, y2) - out).abs().max() > 1e-6
    # permuting test rows permutes the outputs
    tp = torch.randperm(8, generator=torch.Generator().manual_seed(4))
    Xt = X.clone()
    Xt[:, 15:] = X[:, 15 + tp]
    torch.testing.assert_close(m(Xt, y), out[:, tp], rtol=0, atol=1e-10)


def test_feature_order_matters_through_rope():
    m = _model()
    X, y = _table(H=5)
    out = m(X, y)
    assert (m(X[..., [1, 0, 2, 3, 4]], y) - out).abs().max() > 1e-6


def test_qassmax_reduces_to_base_scaling_at_init():
    torch.manual_seed(0)
    layer = QASSMax(num_heads=3, head_dim=4, hidden=16).double()
    q = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    for n in (1, 10, 1000):
        base = layer.base_mlp(torch.tensor([[math.log(n)]], dtype=torch.float64)).view(3, 1, 4)
        torch.testing.assert_close(layer(q, n), q * base, rtol=0, atol=0)
    # after training the query MLP, the modulation stays in (0, 2)
    torch.nn.init.normal_(layer.query_mlp[-1].weight, std=0.5)
    ratio = layer(q, 10) / (q * layer.base_scale(10, q))
    assert (ratio > 0).all() and (ratio < 2).all()


def test_ssmax_no_fading():
    """With SSMax (s = 1) one key ahead by margin 1 keeps weight >= 1/2 as n grows; plain softmax fades."""
    layer = SSMax(1, 1)
    for n in (10, 1000, 100000):
        logits = torch.zeros(n, dtype=torch.float64)
        logits[0] = 1.0
        q_scale = layer(torch.ones(1, 1, 1, dtype=torch.float64), n).item()
        w = (logits * q_scale).softmax(0)[0].item()
        assert w >= 0.5 - 1e-9
        assert logits.softmax(0)[0].item() < 0.5 or n == 10
    assert torch.zeros(10000).index_fill(0, torch.tensor([0]), 1.0).softmax(0)[0] < 1e-3


def test_fast_attention_matches_reference_outputs_and_grads():
    X, y = _table(T=19, H=6, n_train=11)
    grads = []
    outs = []
    for fast in (False, True):
        ref._FAST = fast
        try:
            m = _model(seed=1)
            out = m(X, y)
            out.square().sum().backward()
            outs.append(out.detach())
            grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
        finally:
            ref._FAST = True
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-7, atol=1e-9)


def test_ssmax_options_all_run():
    X, y = _table()
    for kind in ("none", "ssmax", "qassmax"):
        assert torch.isfinite(_model(ssmax=kind)(X, y)).all()


def test_forward_rejects_bad_shapes():
    m = _model()
    X, y = _table()
    with pytest.raises(ValueError, match="n_train"):
        m(X, torch.zeros(2, 23, dtype=torch.long))
    with pytest.raises(ValueError, match="expected"):
        m(X[0], y)


# ---------------------------------------------------------------- prior

def test_prior_deterministic_and_well_formed():
    X, y, tries = sample_dataset(5, 120, 7, 80)
    X2, y2, _ = sample_dataset(5, 120, 7, 80)
    assert np.array_equal(X, X2) and np.array_equal(y, y2)
    assert X.shape == (120, 7) and y.shape == (120,) and X.dtype == np.float32
    assert np.isfinite(X).all() and tries >= 1
    k = y.max() + 1
    assert set(np.unique(y[:80])) == set(range(k))  # every class present in training rows
    assert set(np.unique(y[80:])) <= set(range(k))
    np.testing.assert_allclose(X[:80].mean(0), 0, atol=1e-4)  # standardised with train statistics
    assert np.abs(X).max() <= 100
    X3, _, _ = sample_dataset(6, 120, 7, 80)
    assert not np.array_equal(X, X3)


def test_prior_rejects_unpredictable_targets():
    """Accepted datasets are learnable: a depth-3 tree beats the majority class on average."""
    from sklearn.tree import DecisionTreeClassifier
    gains = []
    for s in range(15):
        X, y, _ = sample_dataset(100 + s, 200, 5, 150)
        tree = DecisionTreeClassifier(max_depth=3, random_state=0).fit(X[:150], y[:150])
        gains.append((tree.predict(X[150:]) == y[150:]).mean() - (y[150:] == np.bincount(y[:150]).argmax()).mean())
    assert np.mean(gains) > 0.05


def test_prior_batch_hash_and_config_errors():
    X, y = sample_batch(1, 3, 40, 4, 30)
    assert X.shape == (3, 40, 4) and y.shape == (3, 40)
    assert prior_hash(X, y) == prior_hash(*sample_batch(1, 3, 40, 4, 30))
    assert prior_hash(X, y) != prior_hash(*sample_batch(2, 3, 40, 4, 30))
    with pytest.raises(ValueError, match="max_nodes"):
        PriorConfig(max_nodes=1)
    with pytest.raises(ValueError, match="n_train"):
        sample_dataset(0, 10, 3, 10)


# ---------------------------------------------------------------- Muon

def test_newton_schulz_band_scale_and_transpose():
    torch.manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(40, 40, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(20, 20, dtype=torch.float64))
    s = torch.logspace(-2, 0, 20, dtype=torch.float64)
    G = U[:, :20] * s @ V.T
    sv = torch.linalg.svdvals(newton_schulz5(G))
    assert sv.min() > 0.6 and sv.max() < 1.2
    torch.testing.assert_close(newton_schulz5(3.7 * G), newton_schulz5(G))
    torch.testing.assert_close(newton_schulz5(G.T), newton_schulz5(G).T)


def test_muon_update_rms_and_decoupled_wd():
    torch.manual_seed(0)
    for shape in [(64, 32), (16, 128), (50, 1)]:
        p = torch.nn.Parameter(torch.randn(shape, dtype=torch.float64))
        opt = Muon([p], lr=1e-2, weight_decay=0.0)
        p.grad = torch.randn(shape, dtype=torch.float64)
        before = p.detach().clone()
        opt.step()
        rms = (p.detach() - before).pow(2).mean().sqrt().item()
        if shape[1] == 1:
            # a vector (n, 1) has one singular value, 1 after normalisation, which NS5 maps to ~0.696:
            # the update is 0.696 * unit direction * 0.2 sqrt(n) lr, i.e. RMS 0.2 * 0.696 * lr
            s = 1.0
            for _ in range(5):
                s = 3.4445 * s - 4.7750 * s ** 3 + 2.0315 * s ** 5
            assert rms == pytest.approx(0.2 * s * 1e-2, rel=1e-5)
        else:
            assert 0.1 * 1e-2 < rms < 0.3 * 1e-2
    p = torch.nn.Parameter(torch.ones(8, 4, dtype=torch.float64))
    opt = Muon([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((8, 4), 0.95, dtype=torch.float64))
    assert muon_lr_scale(torch.Size([64, 32])) == pytest.approx(0.2 * 8)


def test_muon_matches_torch_muon_on_matrices():
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    torch.manual_seed(0)
    W0 = torch.randn(24, 12)
    grads = [torch.randn(24, 12) for _ in range(3)]
    p1, p2 = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    ours = Muon([p1], lr=1e-2, momentum=0.9, weight_decay=0.01)
    theirs = torch.optim.Muon([p2], lr=1e-2, momentum=0.9, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    for g in grads:
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    # torch's momentum is an EMA (scale differs by 1/(1-mu), removed by NS) and its NS runs in bf16
    assert (p1 - p2).abs().max().item() < 3e-3
    assert (p1 - W0).abs().max().item() > 1e-2


def test_muon_adamw_option_routes_vectors():
    p, b = torch.nn.Parameter(torch.randn(6, 3)), torch.nn.Parameter(torch.randn(6))
    opt = Muon([p, b], lr=1e-2, adamw_for_vectors=True)
    p.grad, b.grad = torch.randn(6, 3), torch.randn(6)
    opt.step()
    assert "exp_avg" in opt.state[b] and "momentum_buffer" in opt.state[p]


# ---------------------------------------------------------------- pretraining

def test_pretrain_few_steps_and_resume(tmp_path):
    from icml26.methods.tabicl2.pretrain import main
    model = json.dumps(SMALL)
    common = ["--out", str(tmp_path / "run"), "--batch", "2", "--min-rows", "24", "--max-rows", "32",
              "--max-features", "4", "--ckpt-every", "2", "--eval-every", "1000", "--val-batches", "1", "--model", model]
    r1 = main(common + ["--steps", "2"])
    assert r1["steps"] == 2 and (tmp_path / "run" / "state.pt").exists()
    # a later call with a longer schedule resumes from step 2 instead of restarting
    r2 = main(common + ["--steps", "4", "--export", str(tmp_path / "ck.pt")])
    assert r2["steps"] == 4 and r2["datasets"] == 8
    lines = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4]
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    m = TabICL(TabICLConfig(**ck["config"]))
    m.load_state_dict(ck["state_dict"])
    assert ck["meta"]["steps"] == 4


def test_pretrain_resume_reproduces_uninterrupted_run(tmp_path):
    """A run killed after a checkpoint and resumed ends with the same weights as an uninterrupted run."""
    from icml26.methods.tabicl2.pretrain import main
    common = ["--batch", "2", "--min-rows", "24", "--max-rows", "32", "--max-features", "3", "--ckpt-every", "2",
              "--eval-every", "1000", "--val-batches", "1", "--model", json.dumps(SMALL), "--steps", "4"]
    main(["--out", str(tmp_path / "a")] + common)
    assert main(["--out", str(tmp_path / "b"), "--stop-at", "3"] + common) == {"stopped_at": 3}
    assert torch.load(tmp_path / "b" / "state.pt", weights_only=False)["step"] == 2  # step 3 was lost
    main(["--out", str(tmp_path / "b")] + common)
    a = torch.load(tmp_path / "a" / "state.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "state.pt", weights_only=False)["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


_GLOO_TEARDOWN_SCRIPT = """
import os, sys, torch
import torch.distributed as dist
from icml26.methods.tabicl2.pretrain import close_distributed, init_distributed
init_distributed()
model = torch.nn.Linear(3, 2)
torch.optim.SGD(model.parameters(), lr=0.1)  # the first optimizer imports torch._dynamo
model(torch.ones(4, 3)).sum().backward()
for p in model.parameters():
    dist.all_reduce(p.grad)
close_distributed()
left = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print("rank", os.environ["RANK"], "threads", sorted(left), flush=True)
sys.exit(3 if any("gloo" in name for name in left) else 0)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through Linux /proc")
def test_ddp_teardown_leaves_no_gloo_threads(tmp_path):
    """After close_distributed no gloo thread is left to be torn down at interpreter exit (where it crashed a rank
    now and then): the group was really freed, even with an optimizer built after init_distributed."""
    import os
    import subprocess
    import sys
    script = tmp_path / "teardown.py"
    script.write_text(_GLOO_TEARDOWN_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("threads") == 2


def test_ddp_two_cpu_processes_stay_in_sync(tmp_path):
    """torchrun with 2 gloo processes: gradients are all-reduced, so both ranks end with identical weights."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ICML26_PROGRESS": "0", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "-m", "icml26.methods.tabicl2.pretrain", "--out", str(tmp_path / "ddp"), "--steps", "3", "--batch", "2",
           "--min-rows", "24", "--max-rows", "32", "--max-features", "3", "--ckpt-every", "2", "--eval-every", "1000",
           "--val-batches", "1", "--model", json.dumps(SMALL)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    # torchrun's own summary hides why a rank died: show the ranks' error lines first
    cause = [ln for ln in proc.stderr.splitlines() if re.search(r"terminate|what\(\)|Error|error|Exception", ln)]
    assert proc.returncode == 0, "\n".join(cause)[:4000] + "\n...\n" + proc.stderr[-1500:]
    assert '"ranks_in_sync": true' in proc.stdout and '"world_size": 2' in proc.stdout
    lines = [json.loads(x) for x in (tmp_path / "ddp" / "log.jsonl").read_text().splitlines()]
    assert [r["datasets"] for r in lines if "loss" in r] == [4, 8, 12]  # 2 ranks x batch 2 per step
