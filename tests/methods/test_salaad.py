"""SALAAD: proximal operators against closed forms, the controller on hand-made sequences, the batched ADMM hook
against the per-block reference, resume, budget accounting of HPA and the baselines, and RPCA recovery."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from icml26.core.logging import read_jsonl
from icml26.core.testing import assert_close
from icml26.methods.salaad import (SALAAD, BlockConfig, ControllerConfig, RhoConfig, SALAADConfig, ThresholdController,
                                   block_cost, count_parameters, energy_rank, ialm_rpca, magnitude_prune,
                                   official_block_config, plan_hpa, rho_at, rpca_components, select_blocks,
                                   soft_threshold, svd_truncate, svt, truncate_to_budget)
from icml26.methods.salaad.admm import initial_rho
from icml26.methods.salaad.hpa import official_count
from icml26.methods.salaad.reference import (ReferenceBlock, energy_rank_reference, hpa_reference, ialm_numpy,
                                             soft_threshold_loop, svt_reference)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _planted(m: int = 40, n: int = 30, r: int = 3, density: float = 0.05, seed: int = 0):
    g = _gen(seed)
    low = torch.randn(m, r, generator=g, dtype=torch.float64) @ torch.randn(r, n, generator=g, dtype=torch.float64)
    sparse = torch.zeros(m, n, dtype=torch.float64)
    mask = torch.rand(m, n, generator=g) < density
    sparse[mask] = (torch.rand(int(mask.sum()), generator=g, dtype=torch.float64) - 0.5) * 20
    return low, sparse


# -- proximal operators ----------------------------------------------------------------------------------------
def test_soft_threshold_closed_form_including_negative_threshold():
    x = torch.tensor([-3.0, -0.5, 0.0, 0.2, 2.0], dtype=torch.float64)
    assert torch.equal(soft_threshold(x, 1.0), torch.tensor([-2.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64))
    # A negative threshold (the controller can go below 0) enlarges |x| and keeps exact zeros at zero.
    assert_close("neg", torch.tensor([-3.5, -1.0, 0.0, 0.7, 2.5], dtype=torch.float64), soft_threshold(x, -0.5), 1e-15)
    y = torch.randn(7, 5, generator=_gen(), dtype=torch.float64)
    for tau in (0.0, 0.3, -0.2):
        assert_close(f"loop tau={tau}", soft_threshold_loop(y, tau), soft_threshold(y, tau), 1e-15)


def test_svt_closed_form_and_reference():
    g = _gen(1)
    u, _ = torch.linalg.qr(torch.randn(9, 4, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(6, 4, generator=g, dtype=torch.float64))
    m = u @ torch.diag(torch.tensor([5.0, 3.0, 1.0, 0.5], dtype=torch.float64)) @ v.T
    out, s = svt(m, 2.0)
    assert_close("svt", u @ torch.diag(torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64)) @ v.T, out, 1e-12)
    assert int((s > 0).sum()) == 2
    a = torch.randn(11, 7, generator=g, dtype=torch.float64)
    ref, _ = svt_reference(a, 0.8)
    assert_close("svt vs full-SVD reference", ref, svt(a, 0.8)[0], 1e-12)
    # SVT is the prox of tau ||.||_*: no perturbation of its output lowers tau ||Z||_* + ||Z - A||^2 / 2.
    obj = lambda z: 0.8 * torch.linalg.svdvals(z).sum() + 0.5 * (z - a).pow(2).sum()  # noqa: E731
    best = obj(svt(a, 0.8)[0])
    assert all(obj(svt(a, 0.8)[0] + 1e-3 * torch.randn(11, 7, generator=g, dtype=torch.float64)) > best
               for _ in range(10))


def test_energy_rank_hand_values_and_reference():
    s = torch.tensor([3.0, 2.0, 1.0, 0.0])
    # squared energies 9, 4, 1 of 14 -> cumulative 0.643, 0.929, 1.0
    assert [energy_rank(s, q, squared=True) for q in (0.5, 0.9, 0.95, 0.999)] == [1, 2, 3, 3]
    # unsquared 3, 2, 1 of 6 -> 0.5, 0.833, 1.0 (reaching the quantile exactly counts)
    assert [energy_rank(s, q, squared=False) for q in (0.5, 0.8, 0.9)] == [1, 2, 3]
    assert energy_rank(torch.zeros(5), 0.999, squared=True) == 0
    r = torch.rand(30, generator=_gen()).sort(descending=True).values
    for q in (0.3, 0.9, 0.999):
        for sq in (True, False):
            assert energy_rank(r, q, squared=sq) == energy_rank_reference(r.tolist(), q, squared=sq)


# -- controller and rho ----------------------------------------------------------------------------------------
def test_controller_proportional_phase_then_derivative_term():
    c = ThresholdController(ControllerConfig(k_p=0.2, k_d=0.01, switch_after=4), target_rate=0.15)
    values = []
    for rate in (0.5, 0.4, 0.45, 0.3, 0.35):
        c.update(rate, rho=2.0)
        values.append(c.value)
    # updates 1-3: += 2 * (rate - 0.15) * 0.2; from update 4 on also += 2 * max(0, rate - previous) * 0.01
    expected = [0.14, 0.24, 0.36, 0.42, 0.501]
    assert all(math.isclose(v, e, rel_tol=1e-12) for v, e in zip(values, expected))


def test_controller_switches_at_update_1500_by_default():
    c = ThresholdController(ControllerConfig(k_p=0.002, k_d=0.01), target_rate=0.05)
    rate = lambda t: 0.05 + 1e-4 * t  # noqa: E731  (rising, so the derivative term is active once switched)
    value = 0.0
    for t in range(1, 1601):
        c.update(rate(t), rho=1.0)
        value += (rate(t) - 0.05) * 0.002 + (0.01 * max(0.0, rate(t) - rate(t - 1)) if t >= 1500 else 0.0)
        if t in (1499, 1500, 1600):
            assert math.isclose(c.value, value, rel_tol=1e-9), t
    assert math.isclose(c.dvalue, (rate(1600) - 0.05) * 0.002 + 0.01 * 1e-4, rel_tol=1e-9)


def test_controller_fixed_and_hard_cut_modes():
    fixed = ThresholdController(ControllerConfig(mode="fixed", init=0.3), 0.1)
    fixed.update(0.9, rho=1.0)
    assert fixed.value == 0.3 and fixed.updates == 1
    cut = ThresholdController(ControllerConfig(mode="hard_cut"), 0.25)
    assert cut.value == 0.0
    cut.cut(torch.tensor([[0.1, -0.9], [0.5, -0.3], [0.7, 0.2], [-0.05, 0.4]]), rho=2.0)
    # |.| sorted descending: 0.9, 0.7, 0.5, ...; index int(8 * 0.25) = 2 -> 0.5, times rho.
    assert math.isclose(cut.value, 0.5 * 2.0)


def test_rho_schedules():
    assert rho_at(RhoConfig(rho=1e-6), 5000, 1e-6) == 1e-6
    assert math.isclose(initial_rho(RhoConfig(mode="shape_dependent"), (16, 4), 5), 1 / (5 * 8))
    cfg = RhoConfig(rho=1.0, mode="adaptive", start_epoch=2)
    assert rho_at(cfg, 1, 1.0) == 1.0
    assert math.isclose(rho_at(cfg, 2001, 1.0), 5.5)  # t = 2000 is the midpoint between rho and 10 rho
    assert math.isclose(rho_at(cfg, 1951, 1.0), 1 + 9 * 0.05, rel_tol=1e-5)  # 5% point, W/2 before the middle
    assert math.isclose(rho_at(cfg, 9000, 1.0), 10.0)


# -- the hook ------------------------------------------------------------------------------------------------------
def _net(seed: int = 0) -> nn.Module:
    """Odd shapes, with two equal (6, 6) blocks so the batched SVD path is exercised."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 3)).double()


def _xy(seed: int = 1):
    g = _gen(seed)
    return torch.randn(32, 7, generator=g, dtype=torch.float64), torch.randint(0, 3, (32,), generator=g)


def _cfg() -> BlockConfig:
    # Large rho and gains so that a dozen steps move every quantity; early switch and ramp to cover both phases.
    # Nonzero initial thresholds: with alpha = beta = 0 the first S is pure SVD round-off, whose nonzero count (and
    # so beta) depends on how the SVD was computed, in the official code as here.
    return BlockConfig(rate_rank=0.5, rate_sparsity=0.3, init_energy=0.35,
                       alpha=ControllerConfig(init=0.05 * 0.05, k_p=0.5, k_d=0.2, switch_after=3),
                       beta=ControllerConfig(init=0.05 * 0.01, k_p=0.1, k_d=0.2, switch_after=3),
                       rho=RhoConfig(rho=0.05, mode="adaptive", start_epoch=2, ramp_mid=2.0, ramp_width=2.0))


def test_batched_hook_equals_per_block_reference_through_training():
    model, (x, y) = _net(), _xy()
    ref_model = copy.deepcopy(model)
    hook = SALAAD(model, {r".*\.weight": _cfg()}, config=SALAADConfig(num_freq=2), dtype=torch.float64)
    ref_w = [m.weight for m in ref_model if isinstance(m, nn.Linear)]
    refs = [ReferenceBlock(w.detach().clone(), _cfg()) for w in ref_w]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for step in range(14):
        loss = nn.functional.cross_entropy(model(x), y) + hook.penalty()
        opt.zero_grad()
        loss.backward()
        opt.step()
        hook.step()
        ref_loss = nn.functional.cross_entropy(ref_model(x), y) + sum(r.penalty(w) for r, w in zip(refs, ref_w))
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        if (step + 1) % 2 == 0:
            for r, w in zip(refs, ref_w):
                r.admm(w)
    assert hook.num_updates == 7
    for (name, b), r, w in zip(hook.blocks.items(), refs, ref_w):
        assert_close(f"{name} X", w, b.param, 1e-9)
        for key in ("L", "S", "Y"):
            assert_close(f"{name} {key}", getattr(r, key), getattr(b, key), 1e-9, atol=1e-12)
        assert math.isclose(b.alpha.value, r.alpha.value, rel_tol=1e-9, abs_tol=1e-15)
        assert math.isclose(b.beta.value, r.beta.value, rel_tol=1e-9, abs_tol=1e-15)
        assert math.isclose(b.rho, r.rho, rel_tol=1e-12)


def test_penalty_value_gradient_and_uncoupled_switch():
    model = _net()
    hook = SALAAD(model, {r".*\.weight": _cfg()}, dtype=torch.float64)
    for _ in range(3):
        hook.admm_update()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    model.zero_grad()
    pen = hook.penalty()
    pen.backward()
    expected = 0.0
    for b in hook.blocks.values():
        x_ = b.param.detach()
        expected += b.rho / 2 * float(torch.sum((x_ - b.L - b.S + b.Y / b.rho) ** 2))
        assert_close("grad", b.rho * (x_ - b.L - b.S) + b.Y, b.param.grad, 1e-12)
    assert math.isclose(float(pen.detach()), expected, rel_tol=1e-12)
    assert float(SALAAD(model, {r".*\.weight": _cfg()}, coupled=False).penalty()) == 0.0


def test_uncoupled_hook_trains_exactly_like_plain_training():
    (x, y) = _xy()
    runs = []
    for use_hook in (False, True):
        model = _net()
        hook = SALAAD(model, {r".*\.weight": _cfg()}, coupled=False) if use_hook else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(8):
            loss = nn.functional.cross_entropy(model(x), y) + (hook.penalty() if hook else 0.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if hook:
                hook.step()
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])


def test_admm_runs_every_num_freq_steps():
    hook = SALAAD(_net(), {r".*\.weight": _cfg()}, config=SALAADConfig(num_freq=3))
    ran = [hook.step() for _ in range(9)]
    assert ran == [False, False, True] * 3 and hook.num_updates == 3


def test_reconstruction_and_planted_recovery_on_a_fixed_matrix():
    low, sparse = _planted()
    lin = nn.Linear(30, 40, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(low + sparse)
    # Fixed thresholds alpha = 1, beta = 1/sqrt(max(m, n)): plain RPCA-ADMM, which recovers the planted pair.
    mu = 1.25 / float(torch.linalg.matrix_norm(low + sparse, 2))
    cfg = BlockConfig(init_energy=0.0, alpha=ControllerConfig(mode="fixed", init=1.0),
                      beta=ControllerConfig(mode="fixed", init=1 / math.sqrt(40)), rho=RhoConfig(rho=10 * mu))
    hook = SALAAD(lin, {"weight": cfg}, dtype=torch.float64)
    for _ in range(100):
        hook.admm_update()
    b = hook.blocks["weight"]
    assert_close("X = L + S", lin.weight, b.L + b.S, 1e-10)
    assert_close("L", low, b.L, 1e-8)
    assert_close("S", sparse, b.S, 1e-8)
    # The adaptive controller drives rank ratio and density to their targets (0.15 of rank 30 is 4.5).
    hook = SALAAD(lin, {"weight": BlockConfig(init_energy=0.0, rho=RhoConfig(rho=1e-3))}, dtype=torch.float64)
    for _ in range(600):
        hook.admm_update()
    st = hook.stats()["weight"]
    assert st["residual"] < 1e-3 and 4 / 30 <= st["rank_ratio"] <= 5 / 30 and 0.04 <= st["density"] <= 0.07


def test_state_dict_resume_reproduces_the_run():
    (x, y) = _xy()

    def make(model):
        return SALAAD(model, {r".*\.weight": _cfg()}, config=SALAADConfig(num_freq=2)), torch.optim.Adam(
            model.parameters(), lr=1e-2)

    def run(model, hook, opt, n):
        for _ in range(n):
            loss = nn.functional.cross_entropy(model(x), y) + hook.penalty()
            opt.zero_grad()
            loss.backward()
            opt.step()
            hook.step()

    model = _net()
    hook, opt = make(model)
    run(model, hook, opt, 5)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "hook": hook.state_dict()})
    run(model, hook, opt, 6)
    resumed = _net(seed=7)
    resumed.load_state_dict(ckpt["model"])
    r_hook, r_opt = make(resumed)
    r_opt.load_state_dict(ckpt["opt"])
    r_hook.load_state_dict(ckpt["hook"])
    run(resumed, r_hook, r_opt, 6)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    for name, b in hook.blocks.items():
        rb = r_hook.blocks[name]
        assert torch.equal(b.L, rb.L) and torch.equal(b.S, rb.S) and torch.equal(b.Y, rb.Y)
        assert b.alpha.state_dict() == rb.alpha.state_dict() and b.beta.state_dict() == rb.beta.state_dict()
    with pytest.raises(ValueError, match="blocks"):
        SALAAD(_net(), {r"0\.weight": _cfg()}).load_state_dict(ckpt["hook"])


def test_block_selection_by_pattern():
    from icml26.models.tiny_lm import TinyLM, TinyLMConfig

    model = TinyLM(TinyLMConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=8))
    hook = SALAAD(model)  # defaults: tied embedding once (embedding setting), every projection (linear setting)
    assert "tok_emb.weight" in hook.blocks and "lm_head.weight" not in hook.blocks
    assert len(hook.blocks) == 6 and all(b.param.ndim == 2 for b in hook.blocks.values())
    assert hook.blocks["tok_emb.weight"].rho == 3e-7 and hook.blocks["tok_emb.weight"].config.alpha.k_d == 1.0
    chosen = select_blocks(model, [(r".*qkv_proj\.weight", 1), (r".*\.weight", 2)])
    assert chosen["blocks.0.attn.branch.fn.qkv_proj.weight"] == 1 and chosen["tok_emb.weight"] == 2
    with pytest.raises(ValueError, match="match no 2-D parameter"):
        SALAAD(model, {r".*q_proj\.weight": "linear"})


# -- deployment and baselines ------------------------------------------------------------------------------------
def _components_model():
    """Three blocks with known structure plus biases (the dense rest), and their (L, S)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(20, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 5))
    comps = {}
    for i, name in enumerate(("0.weight", "2.weight", "4.weight")):
        w = dict(model.named_parameters())[name]
        low, sparse = _planted(*w.shape, r=2 + i, density=0.2, seed=i)
        comps[name] = (low.float() * 0.1, sparse.float() * 0.01)
    return model, comps


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
def test_hpa_budget_accounting_and_reference_parity(gamma):
    model, comps = _components_model()
    dense = count_parameters(model)
    rest = dense - sum(l.numel() for l, _ in comps.values())
    for fraction in [0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0]:
        small, report = truncate_to_budget(model, fraction, components=comps, config=SALAADConfig(hpa_gamma=gamma))
        target = int(fraction * dense)
        plan = plan_hpa(comps, dense, target, gamma=gamma)
        ranks, keep, weights = hpa_reference(comps, dense, target, gamma=gamma)
        assert plan.ranks == ranks and plan.keep == keep, fraction
        params = dict(small.named_parameters())
        for name in comps:
            assert_close(f"{name} @ {fraction}", weights[name], params[name].detach(), 1e-5, atol=1e-6)
            nnz = report.blocks[name]["nnz"]
            assert report.blocks[name]["cost"] == block_cost(comps[name][0].shape, ranks[name], nnz)
        assert report.params == rest + sum(b["cost"] for b in report.blocks.values())
        official = official_count(dense, {k: tuple(v[0].shape) for k, v in comps.items()}, plan.rank_quantile,
                                  plan.density)
        if target >= rest:
            assert report.params <= report.extra["planned_params"] <= target
            assert report.extra["planned_params"] >= min(official, target) - 3  # overshoot repair removes a few at most
        else:  # not even the dense rest fits: every block is emptied
            assert report.params == rest and report.extra["planned_params"] == official == rest
        for name, p in model.named_parameters():
            if name not in comps:
                assert torch.equal(p, params[name])


def test_hpa_counts_on_a_hand_made_surrogate():
    # One (10, 8) block: L of rank 2 with singular values (3, 1) (unsquared energy 0.75, 1.0 -> rank 2 at 0.999),
    # S with 4 nonzeros. Dense model = 80 + 10 (bias) = 90. Surrogate P = 10 + 2 * 18 + 4 = 50.
    lin = nn.Linear(8, 10)
    u, _ = torch.linalg.qr(torch.randn(10, 2, generator=_gen()))
    v, _ = torch.linalg.qr(torch.randn(8, 2, generator=_gen(1)))
    low = u @ torch.diag(torch.tensor([3.0, 1.0])) @ v.T
    sparse = torch.zeros(10, 8)
    sparse[0, 0], sparse[3, 2], sparse[5, 7], sparse[9, 1] = 0.4, -0.3, 0.2, 0.1
    comps = {"weight": (low, sparse)}
    plan = plan_hpa(comps, 90, 90)
    assert plan.surrogate_params == 50 and plan.status == 1 and plan.ranks == {"weight": 2}
    # T = 40: reduce 10, gamma 0.5 -> 5 from L (ratio 1 - 5/36), 5 from S (ratio 1 - 5/4 < 0 -> status 4, S gives
    # all 4, L gives 6): q = 0.25 * (1 - 6/36) -> rank int(8 * 0.2083) = 1; then post_allocate fills density.
    plan = plan_hpa(comps, 90, 40)
    assert plan.status == 4 and plan.ranks == {"weight": 1}
    assert plan.planned_params <= 40
    _, report = truncate_to_budget(lin, 40 / 90, components=comps)
    assert report.blocks["weight"]["rank"] == 1 and report.params <= 40


@pytest.mark.parametrize("allocation", ["uniform", "global", "energy"])
def test_svd_truncation_budget(allocation):
    model, comps = _components_model()
    blocks = list(comps)
    dense = count_parameters(model)
    for fraction in [0.1, 0.3, 0.6, 1.0]:
        small, report = svd_truncate(model, fraction, blocks, allocation=allocation)
        assert report.params <= int(fraction * dense)
        # Within one rank step of the largest block of the budget (the granularity of rank truncation).
        assert report.params >= int(fraction * dense) - 3 * (20 + 12)
    full, report = svd_truncate(model, 1.0, blocks, allocation=allocation)
    for p, q in zip(model.parameters(), full.parameters()):
        assert_close("dense at 100%", p, q, 1e-5)


@pytest.mark.parametrize("allocation", ["uniform", "global", "normalized"])
def test_magnitude_pruning_budget(allocation):
    model, comps = _components_model()
    blocks = list(comps)
    dense = count_parameters(model)
    for fraction in [0.1, 0.3, 0.6, 1.0]:
        small, report = magnitude_prune(model, fraction, blocks, allocation=allocation)
        target = int(fraction * dense)
        assert target - len(blocks) <= report.params <= target
        nnz = sum(int(torch.count_nonzero(dict(small.named_parameters())[b])) for b in blocks)
        assert nnz == sum(b["nnz"] for b in report.blocks.values())
    if allocation == "global":
        # One |w| threshold: every kept entry is at least as large as every dropped one.
        small, _ = magnitude_prune(model, 0.3, blocks, allocation="global")
        kept = torch.cat([dict(small.named_parameters())[b].detach().flatten() for b in blocks])
        orig = torch.cat([dict(model.named_parameters())[b].detach().flatten() for b in blocks])
        assert orig[kept != 0].abs().min() >= orig[kept == 0].abs().max()


def test_rpca_recovers_planted_low_rank_plus_sparse_and_matches_numpy():
    low, sparse = _planted(60, 40)
    a, e, it = ialm_rpca(low + sparse, 1 / math.sqrt(60))
    assert_close("A", low, a, 1e-5)
    assert_close("E", sparse, e, 1e-5)
    a_np, e_np, it_np = ialm_numpy((low + sparse).numpy(), 1 / math.sqrt(60))
    assert it == it_np
    assert_close("A vs numpy", torch.from_numpy(a_np), a, 1e-10)
    model, comps = _components_model()
    rp = rpca_components(model, list(comps))
    for name, (a_, e_) in rp.items():
        assert_close(name, dict(model.named_parameters())[name].detach(), a_ + e_, 2e-2)


def test_truncate_to_budget_from_a_trained_hook_keeps_the_architecture():
    from icml26.models.tiny_lm import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=8))
    hook = SALAAD(model, {r".*\.weight": official_block_config(rho_scale=1e4)}, config=SALAADConfig(num_freq=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (4, 9), generator=_gen())
    for _ in range(6):
        loss = model(ids[:, :-1], ids[:, 1:])[1] + hook.penalty()
        opt.zero_grad()
        loss.backward()
        opt.step()
        hook.step()
    before = copy.deepcopy(model.state_dict())
    for source in (hook, hook.state_dict()):
        small, report = truncate_to_budget(model, 0.3, components=source)
        assert type(small) is TinyLM and small.lm_head.weight is small.tok_emb.weight
        assert {k: v.shape for k, v in small.state_dict().items()} == {k: v.shape for k, v in before.items()}
        assert report.params <= int(0.3 * count_parameters(model))
        assert torch.isfinite(small(ids[:, :-1], ids[:, 1:])[1])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


# -- configuration -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, field", [
    (lambda: ControllerConfig(mode="pid"), "mode"), (lambda: ControllerConfig(k_p=-1.0), "k_p"),
    (lambda: ControllerConfig(k_d=float("nan")), "k_d"), (lambda: ControllerConfig(switch_after=0), "switch_after"),
    (lambda: RhoConfig(rho=0.0), "rho"), (lambda: RhoConfig(mode="auto"), "mode"),
    (lambda: RhoConfig(ramp_width=0.0), "ramp_width"), (lambda: BlockConfig(rate_rank=0.0), "rate_rank"),
    (lambda: BlockConfig(rate_sparsity=1.5), "rate_sparsity"), (lambda: BlockConfig(energy=0.0), "energy"),
    (lambda: BlockConfig(alpha=ControllerConfig(mode="hard_cut")), "alpha"),
    (lambda: SALAADConfig(num_freq=0), "num_freq"), (lambda: SALAADConfig(hpa_gamma=1.5), "hpa_gamma"),
    (lambda: official_block_config("conv"), "kind"), (lambda: truncate_to_budget(nn.Linear(2, 2), 0.0, components={}),
                                                      "fraction"),
])
def test_bad_values_raise_value_error_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_works_on_a_hugging_face_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    hook = SALAAD(model, config=SALAADConfig(num_freq=1))  # official per-kind defaults from parameter names
    assert hook.blocks["model.embed_tokens.weight"].rho == 3e-7 and hook.blocks["lm_head.weight"].rho == 6e-8
    assert hook.blocks["model.layers.0.self_attn.q_proj.weight"].rho == 1e-6
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 50, (2, 9), generator=_gen())
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss + hook.penalty()
        opt.zero_grad()
        loss.backward()
        opt.step()
        hook.step()
    small, report = truncate_to_budget(model, 0.5, components=hook)
    assert isinstance(small, transformers.LlamaForCausalLM) and report.params <= int(0.5 * count_parameters(model))
    assert torch.isfinite(small(input_ids=ids, labels=ids).loss)


# -- recovery fine-tuning and the claims (issue 8) ----------------------------------------------------------------
def _tiny_model(seed=0):
    from icml26.models.tiny_lm import TinyLM, TinyLMConfig

    torch.manual_seed(seed)
    return TinyLM(TinyLMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=16))


@pytest.mark.parametrize("kind", ["svd", "magnitude", "hpa"])
def test_recovery_keeps_rank_support_and_count_and_lowers_training_loss(kind):
    from icml26.methods.salaad.baselines import magnitude_prune, rpca_components, svd_truncate
    from icml26.methods.salaad.hpa import truncate_to_budget
    from icml26.methods.salaad.recovery import recover, sparse_entries_kept

    model = _tiny_model()
    blocks = [n for n, p in model.named_parameters() if p.dim() == 2]
    lows = None
    if kind == "svd":
        small, report = svd_truncate(model, 0.4, blocks)
    elif kind == "magnitude":
        small, report = magnitude_prune(model, 0.4, blocks)
    else:
        comps = rpca_components(model, blocks)
        small, report = truncate_to_budget(model, 0.4, components=comps)
        lows = {k: v[0] for k, v in comps.items()}
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32, (8, 16), generator=gen)
    batch = (x, torch.roll(x, -1, 1))
    with torch.no_grad():
        before = float(small(*batch)[1])
    tuned, info = recover(small, report, lambda: batch, steps=30, lr=1e-2, lows=lows)
    assert info["reconstruction_error"] < 1e-4
    with torch.no_grad():
        after = float(tuned(*batch)[1])
    assert after < before
    kept = sparse_entries_kept(tuned)
    for name, b in report.blocks.items():
        m, n = b["shape"]
        if b["cost"] < m * n:
            par = [v for k, v in kept.items() if k.startswith(name.rsplit(".", 1)[0] + ".parametrizations")]
            assert par and par[0]["rank"] == b["rank"] and par[0]["nnz"] == b["nnz"]
            # the deployed weight keeps rank <= b["rank"] off the support
            module = tuned.get_submodule(name.rsplit(".", 1)[0])
            mask = module.parametrizations.weight[0].mask
            assert torch.linalg.matrix_rank(module.weight.detach() * (1 - mask)) <= b["rank"] or b["nnz"] > 0


@pytest.mark.parametrize("index", [0, 1])
def test_null_arm_salaad_switched_to_a_baseline_fails_the_comparator(index):
    from icml26.methods.salaad.experiments import SPECS

    spec = SPECS[index]
    prep = {"tuning": {"chosen": {"salaad": 1e4, "rpca": 1.0, "svd": "uniform", "magnitude": "uniform"},
                       "on_edge": []}}
    out = spec.run(spec.tiers["smoke"], 0, prep, method_as="svd")
    value = out["statistics"][spec.comparator.statistic]
    assert value <= 0 and not spec.comparator.holds(value) and not spec.comparator.holds(spec.null_value)
    assert out["checks"]["recovery_reconstruction"] <= 1e-4


def test_tuning_gives_every_arm_the_same_number_of_settings(monkeypatch):
    from icml26.methods.salaad import experiments

    seen = {}
    monkeypatch.setattr(experiments, "train", lambda config, seed, coupled, rho_scale: (None, None))
    monkeypatch.setattr(experiments, "compress_curve", lambda arm, value, *a, **k: seen.setdefault(arm, []).append(
        value) or {0.1: {"loss": 1.0 + (abs(math.log10(value) - 4) if arm == "salaad" else
                                         abs(math.log2(value)) if arm == "rpca" else 0.0)}})
    out = experiments.tune(experiments.TIERS["quick"])["tuning"]
    assert {arm: len(v) for arm, v in seen.items()} == {"salaad": 3, "rpca": 3, "svd": 3, "magnitude": 3}
    assert out["chosen"]["salaad"] == 1e4 and out["chosen"]["rpca"] == 1.0 and out["on_edge"] == []


def test_a_full_tier_resumes_from_the_run_store_without_retraining(tmp_path, monkeypatch):
    """Each training is stored as a model + hook checkpoint, each arm's curve and the dense numbers as JSON: a new
    process (the memos cleared here) reads them back and gives the same numbers; the JSON alone suffices (the
    checkpoints deleted), and with only the checkpoints left the rest is recomputed from them, again exactly."""
    from icml26.harness.run_store import run_store
    from icml26.methods.salaad import experiments

    config = experiments.TIERS["smoke"]
    prep = {"tuning": {"chosen": {"salaad": 1e4, "rpca": 1.0, "svd": "global", "magnitude": "uniform"},
                       "on_edge": []}}
    monkeypatch.setattr(experiments, "_TRAINED", {})  # this test's own in-process memos, as in a new process
    monkeypatch.setattr(experiments, "_SEEDS", {})
    with run_store(tmp_path / "runs"):
        fresh = experiments.run_seed(config, 0, prep)
    stored = sorted(p.name.split("-")[0] + p.suffix for p in (tmp_path / "runs").iterdir())
    assert stored == ["dense.json"] + ["stored_curve.json"] * 5 + ["train.pt"] * 2

    def retrain(*args, **kwargs):
        raise AssertionError("a stored training was run again")

    monkeypatch.setattr(experiments, "seed_everything", retrain)
    for drop in ("nothing", "results", "checkpoints"):  # the results come back from the checkpoints, then suffice
        experiments._TRAINED.clear()
        experiments._SEEDS.clear()
        if drop != "nothing":
            for path in (tmp_path / "runs").glob("*.pt" if drop == "checkpoints" else "*.json"):
                path.unlink()
        with run_store(tmp_path / "runs"):
            again = experiments.run_seed(config, 0, prep)
        assert again["statistics"] == fresh["statistics"] and again["arms"] == fresh["arms"]
        assert again["curves"] == fresh["curves"]


def test_seed_workers_train_the_tuning_grid_and_the_seeds_ahead_with_the_same_numbers(tmp_path, monkeypatch):
    """``--seed-jobs 2``: the tuning's trainings and curves are computed ahead in the room's workers (``ahead`` in
    ``tune`` must name exactly the calls ``score`` makes, or this process would train them again), then the three
    seeds' trainings one at a time (the spec's ``ahead`` hook; handed out as whole seeds, seeds 0 and 2 would both
    go to worker 0). What those trainings log reaches SPEC.metrics.jsonl, and the result equals a run in one
    process."""
    from icml26.harness.runner import reproduce
    from icml26.methods.salaad import experiments

    def trained_here(*args, **kwargs):
        raise AssertionError("a training or a curve was computed in the parent process")

    monkeypatch.setattr(experiments, "seed_everything", trained_here)
    monkeypatch.setattr(experiments, "compress_curve", trained_here)
    (parallel,) = reproduce(["salaad"], "smoke", tmp_path / "two", spec_ids=["budget_curve"], n_seeds=3, seed_jobs=2)
    monkeypatch.undo()
    records = read_jsonl(tmp_path / "two" / "salaad" / "budget_curve.metrics.jsonl")
    ahead = {(r["seed"], r["arm"]) for r in records if r.get("phase") == "ahead"}
    assert {seed for seed, _ in ahead} == {0, 1, 2} and len(ahead) == 6  # both trainings of every seed
    assert not list((tmp_path / "two" / "salaad").glob("*.part"))
    (serial,) = reproduce(["salaad"], "smoke", tmp_path / "one", spec_ids=["budget_curve"], n_seeds=3)
    assert parallel["prepared"] == serial["prepared"]
    assert [r["statistics"] for r in parallel["seed_results"]] == [r["statistics"] for r in serial["seed_results"]]
