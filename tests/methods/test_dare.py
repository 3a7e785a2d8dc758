"""DARE room: per-sample machinery against the loop reference, the origin-split reduction, the masked TD3+BC
loss (values and gradients), learning a trivial task, kill-and-resume, and the null arm."""

import math

import numpy as np
import pytest
import torch

from icml26.methods.dare import experiments as ex
from icml26.methods.dare import reference as ref
from icml26.methods.dare.config import DAREConfig
from icml26.methods.dare.dare import (alignment_score, constrained_mask, exchange, fit_gaussians, posterior_online,
                                      separation)
from icml26.methods.dare.trainer import DARETD3BC, finetune
from icml26.rl import NAV_ENV_ID, make_env
from icml26.rl.behavior import generate
from icml26.rl.buffers import OfflineBuffer
from icml26.rl.nets import GaussianPolicy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("field,value", [("constraint", "sometimes"), ("score", "kl"), ("eta", 1.0),
                                         ("mixing_ratio", 0.0), ("batch_size", 0), ("actor_lr", 0.0),
                                         ("discount", 1.0), ("alpha", -1.0), ("fit", "gmm")])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        DAREConfig(**{field: value})


@pytest.mark.parametrize("b,a,k", [(7, 2, 5), (13, 3, 1)])
def test_scores_match_reference(b, a, k):
    torch.manual_seed(0)
    beh = GaussianPolicy(4, a, hidden=8, layers=1)
    obs, act = torch.randn(b, 4), torch.rand(b, a) * 2 - 1
    refs = beh.sample(obs, k, torch.Generator().manual_seed(3)).detach()
    fast_kl = alignment_score(beh, obs, act, "kl_mean", k, torch.Generator().manual_seed(3))
    fast_min = alignment_score(beh, obs, act, "min_dist", k, torch.Generator().manual_seed(3))
    torch.testing.assert_close(fast_kl, ref.kl_mean_score(act, refs))
    torch.testing.assert_close(fast_min, ref.min_dist_score(act, refs))
    mean, log_std = beh(obs)
    nll = alignment_score(beh, obs, act, "nll", k)
    torch.testing.assert_close(nll.double(), ref.gaussian_nll(act, mean.detach(), log_std.detach()), rtol=1e-5,
                               atol=1e-5)


def test_posterior_matches_reference_and_hand_value():
    d = torch.tensor([0.1, 0.3, 0.2, 2.0, 1.5, 0.25, 3.0])
    origin = torch.tensor([True, True, True, True, False, False, False])
    p = posterior_online(d, fit_gaussians(d, origin))
    np.testing.assert_allclose(p.numpy(), ref.posterior_moments(d.tolist(), origin.tolist()), rtol=1e-9)
    # two origins with equal spread and priors: the posterior is exactly 1/2 at the midpoint of the means
    d2 = torch.tensor([0.0, 2.0, 4.0, 6.0, 3.0])
    o2 = torch.tensor([True, True, False, False, True])
    par = fit_gaussians(d2[:4], o2[:4])
    assert float(posterior_online(torch.tensor([3.0]), par)) == pytest.approx(0.5)


def test_em_recovers_separated_components():
    g = torch.Generator().manual_seed(0)
    off = torch.randn(400, generator=g) * 0.3
    on = 5 + torch.randn(400, generator=g) * 0.3
    d = torch.cat((off, on))
    noisy_origin = torch.cat((torch.rand(400, generator=g) < 0.7, torch.rand(400, generator=g) < 0.3))
    par = fit_gaussians(d, noisy_origin, fit="em")
    assert float(par["mu_off"]) == pytest.approx(0.0, abs=0.1) and float(par["mu_on"]) == pytest.approx(5.0, abs=0.1)
    keep = exchange(posterior_online(d, par))
    assert keep[:400].all() and not keep[400:].any()
    assert separation(d, keep) > separation(d, noisy_origin)


def test_exchange_reduces_to_origin_split_when_scores_are_forced():
    origin = torch.tensor([True, False, True, True, False])
    forced = (~origin).double()  # p = 0 for offline-origin, 1 for online-origin
    for mode in ("threshold", "stochastic"):
        keep = constrained_mask("dare", origin, forced, mode=mode, generator=torch.Generator().manual_seed(0))
        assert torch.equal(keep, constrained_mask("origin", origin))
    assert constrained_mask("all", origin).all() and not constrained_mask("none", origin).any()


def test_masked_actor_loss_matches_reference_values_and_gradients():
    agent = DARETD3BC(3, 2, DAREConfig(hidden=8, layers=1), seed=0)
    g = torch.Generator().manual_seed(1)
    b = {"observations": torch.randn(9, 3, generator=g), "actions": torch.rand(9, 2, generator=g) * 2 - 1}
    keep = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1], dtype=torch.bool)
    fast = agent.actor_loss(b, keep)
    g_fast = torch.autograd.grad(fast, list(agent.actor.parameters()))
    pi = agent.actor(b["observations"])
    q = agent.critic.q1(torch.cat((b["observations"], pi), -1)).squeeze(-1)
    slow = ref.td3bc_actor_loss(q, pi, b["actions"], keep, agent.config.alpha)
    g_slow = torch.autograd.grad(slow, list(agent.actor.parameters()))
    torch.testing.assert_close(fast, slow)
    for x, y in zip(g_fast, g_slow):
        torch.testing.assert_close(x, y)
    # keep everywhere = CORL's TD3+BC actor loss
    allk = agent.actor_loss(b, torch.ones(9, dtype=torch.bool))
    lam = agent.config.alpha / q.abs().mean().detach()
    torch.testing.assert_close(allk, -lam * q.mean() + torch.nn.functional.mse_loss(pi, b["actions"]))


def test_td3_learns_a_one_step_bandit(one_step_bandit):
    """Single-step episodes with r = -||a - a*||^2 and random actions: TD3 (no constraint) finds a*."""
    data, obs, target = one_step_bandit
    agent = DARETD3BC(2, 2, DAREConfig(hidden=64, batch_size=64, actor_lr=1e-3, critic_lr=1e-3), seed=0)
    off = OfflineBuffer(data)
    none = torch.zeros(64, dtype=torch.bool)
    start = np.abs(agent.actor(torch.as_tensor(obs)).detach().numpy() - target).mean()
    for _ in range(800):
        agent.update(off.sample(64, agent.gen), none)
    err = np.abs(agent.actor(torch.as_tensor(obs)).detach().numpy() - target)
    assert err.mean() < 0.1 < start and err.max() < 0.25


def _fresh(seed=0):
    cfg = DAREConfig(hidden=16, batch_size=32, bc_steps=20)
    data = generate("medium", 400, seed=0)
    agent = DARETD3BC(2, 2, cfg, seed=seed)
    off = OfflineBuffer(data, reward_bias=-1.0)
    agent.pretrain(off, 10)
    agent.fit_behavior(off)
    return agent, off


def test_killed_run_resumes_to_the_same_state(tmp_path):
    kw = dict(eval_every=40, eval_episodes=1, seed=0, checkpoint_every=30)
    a, off = _fresh()
    full = finetune(a, make_env(NAV_ENV_ID), make_env(NAV_ENV_ID), off, 120, checkpoint=tmp_path / "a.pt", **kw)
    b, off = _fresh()
    part = finetune(b, make_env(NAV_ENV_ID), make_env(NAV_ENV_ID), off, 120, checkpoint=tmp_path / "b.pt",
                    stop_after=90, **kw)
    assert part["steps_done"] == 90 and (tmp_path / "b.pt").exists()
    c, off = _fresh(seed=5)  # a different init: everything must come from the checkpoint
    resumed = finetune(c, make_env(NAV_ENV_ID), make_env(NAV_ENV_ID), off, 120, checkpoint=tmp_path / "b.pt", **kw)
    assert resumed["curve"] == full["curve"]
    for x, y in zip(a.actor.parameters(), c.actor.parameters()):
        assert torch.equal(x, y)


def test_dare_diagnostics_and_null_arm_fail_comparator(monkeypatch):
    cfg = ex.SPECS[0].tiers["smoke"]
    prepared = {"tuning": {"chosen": {"dare": ex.DARE_VARIANTS[0], "origin": 2.5, "keep_all": 2.5,
                                      "drop_all": 3e-4}}}
    res = ex.run_claim(cfg, 0, prepared)
    assert 0.0 <= res["checks"]["exchanged_fraction"] <= 1.0
    assert all(math.isfinite(v) for v in res["statistics"].values())
    monkeypatch.setitem(ex.CONSTRAINT, "dare", "origin")  # the method switched back to the baseline
    null = ex.run_claim(cfg, 0, prepared)
    assert null["statistics"]["final_gain"] == 0.0
    assert not ex.COMPARATOR.holds(null["statistics"]["final_gain"])


def test_arm_config_maps_tuned_values():
    cfg = ex.SPECS[0].tiers["smoke"]
    d = ex.arm_config("dare", "nll/em/stochastic", cfg)
    assert (d.score, d.fit, d.exchange, d.constraint) == ("nll", "em", "stochastic", "dare")
    assert ex.arm_config("drop_all", 1e-3, cfg).actor_lr == 1e-3 and ex.arm_config("origin", 7.5, cfg).alpha == 7.5


def test_the_curve_plot_names_the_specs_own_evaluation_episodes():
    from matplotlib.figure import Figure  # no pyplot: no global backend or open figure to clean up

    curves = {arm: [[0, 10.0], [100, 20.0]] for arm in ex.ARMS}
    result = {"arms_order": list(ex.ARMS), "seed_results": [{"curves": curves}],
              "run_info": {"config": {"eval_episodes": 5}}}
    ax = Figure().subplots()
    ex.plot_curves(result, ax)
    assert ax.get_ylabel() == "normalised return (5 episodes per evaluation)"


def _tensors(state, path=""):
    """(path, tensor) for every tensor in a nested state dict."""
    if isinstance(state, dict):
        return [pair for key, value in state.items() for pair in _tensors(value, f"{path}/{key}")]
    return [(path, state)] if torch.is_tensor(state) else []


@pytest.mark.parametrize("spec_id", ["dare_vs_origin", "dare_vs_origin_iql", "dare_vs_origin_calql"])
def test_an_online_run_leaves_the_shared_offline_state_untouched(spec_id):
    """Every arm of a seed starts from one in-memory offline state. torch's Optimizer.load_state_dict keeps the
    given Adam tensors, so before the fix the first arm's online updates moved that state's moments and step
    counts, and every later arm (and tuning point) started from where the previous one ended: results depended
    on the order of the runs in a process."""
    cfg = dict(next(s for s in ex.SPECS if s.id == spec_id).tiers["smoke"])
    variant = ex.DARE_VARIANTS[0]
    before = [(path, t.clone()) for path, t in _tensors(ex.pretrained(cfg, 0)["state"])]
    assert any("_opt/state" in path for path, _ in before)  # the optimisers' moments are part of the state
    ex.online_run("dare", variant, cfg, 0)
    after = dict(_tensors(ex.pretrained(cfg, 0)["state"]))
    changed = [path for path, t in before if not torch.equal(t, after[path])]
    assert not changed, f"an online run changed the shared offline state: {changed[:5]}"


def test_seed_workers_score_the_tuning_grid_ahead_with_the_same_numbers(tmp_path, monkeypatch):
    """``--seed-jobs 2``: every tuning point's online run is computed in the room's workers (``ahead`` must name
    exactly the runs ``score`` reads, or this process would fine-tune them again), the finished runs are kept in
    OUT/dare/runs/, and the result equals a run in one process."""
    from icml26.harness.runner import reproduce

    def fine_tuned_here(*args, **kwargs):
        raise AssertionError("an online run was computed in the parent process")

    monkeypatch.setattr(ex, "finetune", fine_tuned_here)
    (parallel,) = reproduce(["dare"], "smoke", tmp_path / "two", spec_ids=["dare_vs_origin"], n_seeds=2, seed_jobs=2)
    monkeypatch.undo()
    # 3 + 3 + 3 grid points and up to 2 extensions each for origin / keep_all, plus 4 arms for each of 2 seeds
    assert len(list((tmp_path / "two" / "dare" / "runs").glob("online_run-*.json"))) >= 9 + 2 * 4
    (serial,) = reproduce(["dare"], "smoke", tmp_path / "one", spec_ids=["dare_vs_origin"], n_seeds=2)
    assert parallel["prepared"] == serial["prepared"]
    assert [r["statistics"] for r in parallel["seed_results"]] == [r["statistics"] for r in serial["seed_results"]]
    assert [r["checks"] for r in parallel["seed_results"]] == [r["checks"] for r in serial["seed_results"]]
