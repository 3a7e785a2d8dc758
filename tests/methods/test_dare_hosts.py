"""DARE's IQL and Cal-QL hosts: losses against the loop reference (values and gradients), the unmasked host is
CORL's algorithm, each host learns a trivial task in a few hundred steps, kill-and-resume, the CVAE behavior model
inside DARE's score, and bad input."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from icml26.methods.dare import reference as ref
from icml26.methods.dare.config import DAREConfig, corl_defaults
from icml26.methods.dare.dare import alignment_score
from icml26.methods.dare.hosts import DARECalQL, DAREIQL, make_agent
from icml26.methods.dare.trainer import DARETD3BC, finetune
from icml26.rl import NAV_ENV_ID, make_env
from icml26.rl.behavior import generate
from icml26.rl.buffers import OfflineBuffer
from icml26.rl.nets import CVAE

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(n=9, obs_dim=3, act_dim=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"observations": torch.randn(n, obs_dim, generator=g), "actions": torch.rand(n, act_dim, generator=g) * 2 - 1,
            "rewards": torch.randn(n, generator=g), "next_observations": torch.randn(n, obs_dim, generator=g),
            "dones": (torch.rand(n, generator=g) < 0.3).float(), "mc_returns": torch.randn(n, generator=g)}


KEEP = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1], dtype=torch.bool)


def test_corl_defaults_and_bad_config():
    assert corl_defaults("calql", antmaze=True)["actor_lr"] == 1e-4 and corl_defaults("iql")["iql_beta"] == 3.0
    for field, value in [("host", "cql"), ("behavior", "flow"), ("iql_tau", 1.0), ("cql_n_actions", 0),
                         ("exp_adv_max", 0.0), ("relaxed_alpha", -0.1), ("diffusion_steps", 0),
                         ("guidance_scale", -1.0), ("guidance_scale", 0.5)]:
        with pytest.raises(ValueError, match=field):
            DAREConfig(**{field: value})
    with pytest.raises(ValueError, match="host"):
        corl_defaults("sac")
    with pytest.raises(TypeError, match="DAREConfig"):
        DAREIQL(2, 2, {"host": "iql"})
    assert isinstance(make_agent(2, 2, DAREConfig(host="calql", hidden=8)), DARECalQL)


def _linears(module: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in module.modules() if isinstance(m, torch.nn.Linear)]


def test_iql_q_and_v_networks_follow_critic_layers():
    agent = make_agent(2, 2, DAREConfig(**corl_defaults("iql", antmaze=True), hidden=8, critic_layers=4))
    assert len(_linears(agent.critic.q1)) == len(_linears(agent.value)) == 5 and len(_linears(agent.actor)) == 3


def test_iql_value_loss_is_the_expectile_loss():
    agent = DAREIQL(3, 2, DAREConfig(hidden=8, layers=1, iql_tau=0.8), seed=0)
    b = _batch()
    loss, adv = agent.value_loss(b)
    with torch.no_grad():
        q = torch.min(*agent.critic_target(b["observations"], b["actions"]))
    v = agent.value(b["observations"])
    torch.testing.assert_close(loss, ref.expectile_loss(q, v, 0.8))
    torch.testing.assert_close(adv, (q - v).detach())


def test_iql_masked_actor_loss_matches_reference_values_and_gradients():
    agent = DAREIQL(3, 2, DAREConfig(hidden=8, layers=1, relaxed_alpha=0.3, iql_beta=2.0, exp_adv_max=4.0), seed=0)
    b = _batch()
    adv = torch.linspace(-1.0, 1.5, 9)
    state = agent.gen.get_state()
    fast = agent.actor_loss(b, adv, KEEP)
    g_fast = torch.autograd.grad(fast, list(agent.actor.parameters()))
    agent.gen.set_state(state)
    obs = b["observations"]
    a_tilde, logp_tilde = agent.actor.rsample(obs, agent.gen)
    q_tilde = torch.min(*agent.critic(obs, a_tilde.clamp(-1, 1)))
    slow = ref.iql_actor_loss(agent.actor.log_prob(obs, b["actions"]), adv, logp_tilde, q_tilde, KEEP, 2.0, 4.0, 0.3)
    g_slow = torch.autograd.grad(slow, list(agent.actor.parameters()))
    torch.testing.assert_close(fast, slow.float())
    for x, y in zip(g_fast, g_slow):
        torch.testing.assert_close(x, y)
    # keep everywhere: CORL's IQL policy loss, mean(min(exp(beta A), clip) * -log pi(a|s))
    allk = agent.actor_loss(b, adv, torch.ones(9, dtype=torch.bool))
    corl = (torch.exp(2.0 * adv).clamp(max=4.0) * -agent.actor.log_prob(obs, b["actions"])).mean()
    torch.testing.assert_close(allk, corl)


def test_calql_gap_matches_reference_with_and_without_calibration():
    agent = DARECalQL(3, 2, DAREConfig(host="calql", hidden=8, layers=1, cql_n_actions=3), seed=0)
    b = _batch()
    g = torch.Generator().manual_seed(2)
    obs, nobs = b["observations"], b["next_observations"]
    rand = torch.rand((3, 9, 2), generator=g) * 2 - 1
    cur, nxt = agent.actor.sample(obs, 3, g), agent.actor.sample(nobs, 3, g)
    cur, nxt = (cur[0].detach(), cur[1].detach()), (nxt[0].detach(), nxt[1].detach())
    q_data = agent.critic(obs, b["actions"])
    for lower in (None, b["mc_returns"]):
        fast = agent.cql_gap(obs, q_data, rand, cur, nxt, lower)
        slow = 0
        for j in range(2):
            qs = [torch.stack([agent.critic(obs, a[k])[j] for k in range(3)], 1) for a in (rand, cur[0], nxt[0])]
            slow = slow + ref.cql_gap(qs[0], qs[1], qs[2], cur[1].T, nxt[1].T, q_data[j], 2, lower)
        torch.testing.assert_close(fast.double(), slow, rtol=1e-5, atol=1e-5)
    # the regulariser is applied on S_off only: keep = none leaves the plain TD loss (SAC critic)
    agent.calibrating = False
    none = torch.zeros(9, dtype=torch.bool)
    state = agent.gen.get_state()
    td_only = agent.q_loss(b, none)
    agent.gen.set_state(state)
    full = agent.q_loss(b, torch.ones(9, dtype=torch.bool))
    assert td_only[1] is None and full[1] is None  # no Lagrange multiplier unless cql_lagrange
    assert float(full[0].detach()) != float(td_only[0].detach())


def _calql_antmaze(**kw):
    cfg = DAREConfig(**{**corl_defaults("calql", antmaze=True), "hidden": 8, "cql_n_actions": 3, **kw})
    return DARECalQL(3, 2, cfg, seed=0)


def test_calql_corl_antmaze_extras_are_the_defaults_and_build_corls_networks():
    d = corl_defaults("calql", antmaze=True)
    assert (d["critic_layers"], d["actor_layers"], d["actor_log_std_offset"]) == (5, 3, -1.0)
    assert d["cql_lagrange"] and d["cql_target_action_gap"] == 0.8 and d["cql_max_target_backup"]
    assert d["orthogonal_init"] and d["cql_clip_diff_min"] == -200.0
    assert not corl_defaults("calql").get("cql_lagrange", False) and "critic_layers" not in corl_defaults("calql")
    agent = _calql_antmaze()
    assert len(_linears(agent.critic.q1)) == 6 and len(_linears(agent.actor)) == 4
    for lin in _linears(agent.actor) + _linears(agent.critic):  # orthogonal with gain sqrt(2), zero bias
        w = lin.weight.detach().double()
        gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
        torch.testing.assert_close(gram, 2 * torch.eye(gram.shape[0], dtype=torch.float64), atol=1e-5, rtol=0)
        assert not lin.bias.detach().any()
    # the learnable log-std map starts at head - 1 and trains with the actor
    obs = torch.randn(4, 3)
    head = agent.actor.net(obs).chunk(2, -1)[1]
    torch.testing.assert_close(agent.actor.dist_params(obs)[1], (head - 1.0).clamp(-20.0, 2.0))
    names = {n for n, _ in agent.actor.named_parameters()}
    assert {"log_std_scale", "log_std_offset"} <= names
    for name, value in [("critic_layers", 0), ("actor_layers", 0), ("cql_clip_diff_min", float("nan"))]:
        with pytest.raises(ValueError, match=name):
            DAREConfig(**{name: value})


def test_calql_max_target_backup_is_the_max_over_policy_draws():
    agent = _calql_antmaze()
    b = _batch()
    state = agent.gen.get_state()
    fast = agent.td_target(b)
    agent.gen.set_state(state)
    nobs = b["next_observations"]
    acts, _ = agent.actor.sample(nobs, 3, agent.gen)
    best = []
    with torch.no_grad():
        for i in range(9):  # per sample: the best of the 3 draws under min_j Q'_j
            best.append(max(float(torch.min(*agent.critic_target(nobs[i:i + 1], acts[k, i:i + 1]))) for k in range(3)))
    torch.testing.assert_close(fast, b["rewards"] + 0.99 * (1 - b["dones"]) * torch.tensor(best))


def test_calql_lagrange_term_is_corls_and_its_multiplier_holds_the_gap_at_its_target():
    agent = _calql_antmaze(cql_clip_diff_min=-1.0)
    agent.calibrating = False
    b = _batch()
    state = agent.gen.get_state()
    loss, loss_ap = agent.q_loss(b, torch.ones(9, dtype=torch.bool))
    # CORL, per critic j: alpha' cql_alpha (mean_i clamp(gap_ij, -1) - target), with the same draws
    agent.gen.set_state(state)
    y = agent.td_target(b)
    q_data = agent.critic(b["observations"], b["actions"])
    k, obs, nobs = 3, b["observations"], b["next_observations"]
    rand = torch.rand((k, 9, 2), generator=agent.gen) * 2 - 1
    cur, nxt = (tuple(t.detach() for t in agent.actor.sample(o, k, agent.gen)) for o in (obs, nobs))
    ap = float(np.exp(1.0))
    expected = sum(torch.nn.functional.mse_loss(q, y) for q in q_data)
    for j in range(2):
        qs = [torch.stack([agent.critic(obs, a[kk])[j] for kk in range(k)], 1) for a in (rand, cur[0], nxt[0])]
        gap = ref.cql_gap(qs[0], qs[1], qs[2], cur[1].T, nxt[1].T, q_data[j], 2).clamp(min=-1.0)
        expected = expected + ap * 5.0 * (float(gap.mean()) - 0.8)
    torch.testing.assert_close(float(loss.detach()), float(expected.detach()), rtol=1e-5, atol=1e-5)
    # only S_off (keep) enters the term; nothing kept leaves the TD loss and no multiplier loss
    assert agent.q_loss(b, torch.zeros(9, dtype=torch.bool))[1] is None
    # the multiplier's loss is -1/2 of the term: a gap above its target raises alpha', below lowers it
    for target, sign in ((-100.0, 1), (100.0, -1)):
        agent = _calql_antmaze(cql_target_action_gap=target)
        before = float(agent.log_alpha_prime.detach())
        agent.update(b, torch.ones(9, dtype=torch.bool))
        assert sign * (float(agent.log_alpha_prime.detach()) - before) > 0


@pytest.mark.parametrize("host,extra,tol", [("iql", {}, 0.12), pytest.param(
    "calql", {"cql_alpha": 1.0, "cql_n_actions": 4}, 0.2, marks=pytest.mark.slow)])
def test_host_learns_a_one_step_bandit_in_300_steps(host, extra, tol, one_step_bandit):
    data, obs, target = one_step_bandit
    cfg = DAREConfig(**{**corl_defaults(host), "actor_lr": 1e-3, "critic_lr": 1e-3, **extra}, hidden=32, batch_size=64)
    agent = make_agent(2, 2, cfg, seed=0)
    off = OfflineBuffer(data, mc_discount=cfg.discount)
    start = np.abs(agent.actor(torch.as_tensor(obs)).detach().numpy() - target).mean()
    agent.pretrain(off, 300)
    err = np.abs(agent.actor(torch.as_tensor(obs)).detach().numpy() - target)
    assert err.mean() < tol < start


def _fresh(host, seed=0, behavior="gaussian"):
    cfg = DAREConfig(**corl_defaults(host, antmaze=True), hidden=16, batch_size=32, bc_steps=20, cql_n_actions=2,
                     reward_bias=-1.0, behavior=behavior)
    agent = make_agent(2, 2, cfg, seed=seed)
    off = OfflineBuffer(generate("medium", 400, seed=0), reward_bias=-1.0, mc_discount=cfg.discount)
    agent.pretrain(off, 10)
    agent.fit_behavior(off)
    return agent, off


@pytest.mark.parametrize("host", ["iql", pytest.param("calql", marks=pytest.mark.slow)])
def test_killed_run_resumes_to_the_same_state(tmp_path, host):
    kw = dict(eval_every=30, eval_episodes=1, seed=0, checkpoint_every=20)
    a, off = _fresh(host)
    full = finetune(a, make_env(NAV_ENV_ID), make_env(NAV_ENV_ID), off, 80, checkpoint=tmp_path / "a.pt", **kw)
    b, off = _fresh(host)
    part = finetune(b, make_env(NAV_ENV_ID), make_env(NAV_ENV_ID), off, 80, checkpoint=tmp_path / "b.pt",
                    stop_after=60, **kw)
    assert part["steps_done"] == 60
    c, off = _fresh(host, seed=5)
    resumed = finetune(c, make_env(NAV_ENV_ID), make_env(NAV_ENV_ID), off, 80, checkpoint=tmp_path / "b.pt", **kw)
    assert resumed["curve"] == full["curve"] and resumed["diag"] == full["diag"]
    for x, y in zip(a.actor.parameters(), c.actor.parameters()):
        assert torch.equal(x, y)
    if host == "calql":
        assert not c.calibrating and torch.equal(a.log_alpha, c.log_alpha)
        assert torch.equal(a.log_alpha_prime, c.log_alpha_prime) and not torch.equal(c.log_alpha_prime,
                                                                                      torch.ones(1))


def test_calql_calibration_needs_mc_returns_and_is_switched_off_online():
    agent = DARECalQL(2, 2, DAREConfig(host="calql", hidden=8), seed=0)
    b = _batch(obs_dim=2)
    del b["mc_returns"]
    before = [p.clone() for p in agent.actor.parameters()]
    with pytest.raises(ValueError, match="mc_returns"):
        agent.update(b, torch.ones(9, dtype=torch.bool))
    assert all(torch.equal(x, y) for x, y in zip(before, agent.actor.parameters())) and agent.n_updates == 0
    agent.start_online()
    agent.update(b, torch.ones(9, dtype=torch.bool))  # online: no calibration, no bound needed


def test_cvae_behavior_model_in_dare_scores():
    agent, off = _fresh("td3bc", behavior="cvae")
    assert isinstance(agent.behavior, CVAE) and isinstance(agent, DARETD3BC)
    b = off.sample(16, agent.gen)
    for kind in ("kl_mean", "nll", "min_dist"):
        d = alignment_score(agent.behavior, b["observations"], b["actions"], kind, 4, agent.gen)
        assert d.shape == (16,) and torch.isfinite(d).all()
    state = agent.state_dict()
    twin = make_agent(2, 2, replace(agent.config), seed=9)
    twin.load_state_dict(state)
    for x, y in zip(agent.behavior.parameters(), twin.behavior.parameters()):
        assert torch.equal(x, y)


def test_finetune_rejects_bad_input_before_any_step():
    agent, off = _fresh("iql")
    before = agent.n_updates
    env = make_env(NAV_ENV_ID)
    with pytest.raises(ValueError, match="online_steps"):
        finetune(agent, env, env, off, 0, eval_every=10, eval_episodes=1, seed=0)
    with pytest.raises(ValueError, match="eval_every"):
        finetune(agent, env, env, off, 10, eval_every=0, eval_episodes=1, seed=0)
    other = make_agent(3, 2, agent.config)
    with pytest.raises(ValueError, match="dims"):
        finetune(other, env, env, off, 10, eval_every=10, eval_episodes=1, seed=0)
    with pytest.raises(TypeError, match="DAREHost"):
        finetune(object(), env, env, off, 10, eval_every=10, eval_episodes=1, seed=0)
    assert agent.n_updates == before and not agent.online


@pytest.mark.slow
def test_card_usage_snippet_runs(tmp_path, monkeypatch, run_card_snippet):
    import pathlib

    import icml26.methods.dare as room

    monkeypatch.chdir(tmp_path)
    namespace = run_card_snippet(pathlib.Path(room.__file__).parent / "README.md")
    assert len(namespace["out"]["curve"]) == 3
    assert namespace["out"]["steps_done"] == 100
