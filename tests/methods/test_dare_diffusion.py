"""DARE with the diffusion behavior model (behavior="diffusion", optional energy guidance by the host's critic):
every score kind is finite, the "nll" score is the negative ELBO proxy, guidance at scale 0 is exactly the
unguided model, guidance leaves the critic's gradients untouched, and a short online run checkpoints and resumes
to the same state."""

import pytest
import torch

from icml26.methods.dare.config import DAREConfig, corl_defaults
from icml26.methods.dare.dare import alignment_score
from icml26.methods.dare.hosts import make_agent
from icml26.methods.dare.trainer import _EnergyGuided, finetune
from icml26.rl import NAV_ENV_ID, make_env
from icml26.rl.behavior import generate
from icml26.rl.buffers import OfflineBuffer
from icml26.rl.nets import DiffusionBehavior

pytestmark = pytest.mark.usefixtures("one_thread")


def _agent(host="iql", guidance=0.0, seed=0):
    cfg = DAREConfig(**corl_defaults(host, antmaze=True), hidden=16, batch_size=32, bc_steps=20, cql_n_actions=2,
                     reward_bias=-1.0, behavior="diffusion", diffusion_steps=4, guidance_scale=guidance,
                     n_ref_actions=3)
    agent = make_agent(2, 2, cfg, seed=seed)
    off = OfflineBuffer(generate("medium", 300, seed=0), reward_bias=-1.0, mc_discount=cfg.discount)
    agent.pretrain(off, 5)
    agent.fit_behavior(off)
    return agent, off


@pytest.mark.parametrize("host", ["td3bc", "iql", "calql"])
def test_diffusion_behavior_scores_in_every_host(host):
    agent, off = _agent(host, guidance=0.5)
    assert isinstance(agent.behavior, DiffusionBehavior) and agent.behavior.n_steps == 4
    b = off.sample(16, agent.gen)
    for kind in ("kl_mean", "nll", "min_dist"):
        d = alignment_score(agent.behavior, b["observations"], b["actions"], kind, 3, agent.gen)
        assert d.shape == (16,) and torch.isfinite(d).all()
    torch.testing.assert_close(alignment_score(agent.behavior, b["observations"], b["actions"], "nll", 3),
                               -agent.behavior.log_prob(b["observations"], b["actions"]))
    agent.critic.zero_grad(set_to_none=True)
    keep, diag = agent.split(b, torch.arange(16) < 8)
    assert keep.shape == (16,) and 0 <= diag["released"] <= 1
    assert all(p.grad is None for p in agent.critic.parameters())  # guidance differentiates w.r.t. actions only


def test_guidance_at_scale_zero_is_the_unguided_model():
    agent, off = _agent()
    obs = off.sample(8, agent.gen)["observations"]
    guided = _EnergyGuided(agent.behavior, agent._energy, 0.0)
    a = guided.sample(obs, 3, torch.Generator().manual_seed(1))
    b = agent.behavior.sample(obs, 3, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    strong = _EnergyGuided(agent.behavior, agent._energy, 2.0).sample(obs, 3, torch.Generator().manual_seed(1))
    assert not torch.equal(strong, b) and strong.abs().max() <= 1


@pytest.mark.slow  # three 80-step online runs with the diffusion score: about a minute on the loaded machine
def test_killed_diffusion_run_resumes_to_the_same_state(tmp_path):
    kw = dict(eval_every=30, eval_episodes=1, seed=0, checkpoint_every=20)
    a, off = _agent(guidance=0.5)
    full = finetune(a, make_env(NAV_ENV_ID), make_env(NAV_ENV_ID), off, 80, checkpoint=tmp_path / "a.pt", **kw)
    b, off = _agent(guidance=0.5)
    finetune(b, make_env(NAV_ENV_ID), make_env(NAV_ENV_ID), off, 80, checkpoint=tmp_path / "b.pt", stop_after=60,
             **kw)
    assert (tmp_path / "b.pt").exists()  # an episode ended (50-step horizon) and was checkpointed before the kill
    c, off = _agent(guidance=0.5, seed=3)
    resumed = finetune(c, make_env(NAV_ENV_ID), make_env(NAV_ENV_ID), off, 80, checkpoint=tmp_path / "b.pt", **kw)
    assert resumed["curve"] == full["curve"] and resumed["diag"] == full["diag"]
    for x, y in zip((*a.actor.parameters(), *a.behavior.parameters()),
                    (*c.actor.parameters(), *c.behavior.parameters())):
        assert torch.equal(x, y)
