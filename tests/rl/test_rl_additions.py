"""Additions to the shared RL core for the DARE hosts: Monte-Carlo return-to-go (Cal-QL's bound), buffers that
carry it, the tanh-Gaussian / IQL actors' densities, and the CVAE behavior model."""

import math

import numpy as np
import pytest
import torch

from icml26.rl.buffers import OfflineBuffer, OnlineBuffer, mixed_batch
from icml26.rl.datasets import return_to_go, validate
from icml26.rl.nets import CVAE, IQLGaussianActor, TanhGaussianActor

pytestmark = pytest.mark.usefixtures("one_thread")


def _two_episodes():
    # episode 1: 3 steps ending in a terminal; episode 2: 2 steps cut by a timeout
    return validate({"observations": np.zeros((5, 1)), "actions": np.zeros((5, 1)),
                     "rewards": np.array([1.0, 0.0, 2.0, 1.0, 1.0]), "next_observations": np.zeros((5, 1)),
                     "terminals": np.array([0, 0, 1, 0, 0]), "timeouts": np.array([0, 0, 0, 0, 1])})


def test_return_to_go_hand_values():
    g = return_to_go(_two_episodes(), 0.5)
    np.testing.assert_allclose(g, [1 + 0.5 * 0 + 0.25 * 2, 0 + 0.5 * 2, 2, 1 + 0.5 * 1, 1], rtol=1e-6)
    # reward transform first (r' = 2 r - 1), then CORL's sparse rule: a failed episode is worth r'/(1 - gamma)
    g2 = return_to_go(_two_episodes(), 0.5, reward_scale=2.0, reward_bias=-1.0, sparse_failure_reward=1.0)
    np.testing.assert_allclose(g2[3:], [1 / 0.5, 1 / 0.5])
    np.testing.assert_allclose(g2[:3], [1 + 0.5 * -1 + 0.25 * 3, -1 + 0.5 * 3, 3], rtol=1e-6)
    with pytest.raises(ValueError, match="discount"):
        return_to_go(_two_episodes(), 1.0)


def test_mixed_batch_carries_mc_returns_zero_online():
    off = OfflineBuffer(_two_episodes(), mc_discount=0.5)
    on = OnlineBuffer(1, 1, 4)
    on.add([0.0], [0.0], 1.0, [0.0], False)
    batch, origin = mixed_batch(off, on, 8, 0.5, torch.Generator().manual_seed(0))
    assert batch["mc_returns"].shape == (8,) and torch.all(batch["mc_returns"][~origin] == 0)
    assert torch.all(batch["mc_returns"][origin] > 0)
    plain, _ = mixed_batch(OfflineBuffer(_two_episodes()), on, 8, 0.5, torch.Generator().manual_seed(0))
    assert "mc_returns" not in plain  # unchanged without mc_discount


def test_tanh_gaussian_log_prob_matches_change_of_variables():
    torch.manual_seed(0)
    pol = TanhGaussianActor(3, 2, hidden=8, layers=1)
    obs = torch.randn(5, 3)
    a, logp = pol.sample(obs, 4, torch.Generator().manual_seed(1))
    mean, log_std = pol.dist_params(obs)
    u = torch.atanh(a.double().clamp(-1 + 1e-12, 1 - 1e-12))
    base = torch.distributions.Normal(mean.double(), log_std.double().exp()).log_prob(u).sum(-1)
    expect = base - torch.log(1 - a.double().pow(2)).sum(-1)
    torch.testing.assert_close(logp.double(), expect, rtol=1e-4, atol=1e-4)
    assert a.shape == (4, 5, 2) and logp.shape == (4, 5) and a.abs().max() < 1
    assert torch.equal(pol(obs), torch.tanh(mean))


def test_iql_actor_log_prob_is_a_diagonal_gaussian():
    torch.manual_seed(0)
    pol = IQLGaussianActor(3, 2, hidden=8, layers=1)
    with torch.no_grad():
        pol.log_std.copy_(torch.tensor([-0.5, 0.3]))
    obs, act = torch.randn(6, 3), torch.rand(6, 2) * 2 - 1
    ref = torch.distributions.Normal(pol(obs), torch.tensor([-0.5, 0.3]).exp()).log_prob(act).sum(-1)
    torch.testing.assert_close(pol.log_prob(obs, act), ref)


def test_cvae_learns_a_bimodal_behavior():
    """Actions at +-0.8 (one mode per sign of s): the CVAE's draws land near the right mode and the data action
    scores higher (ELBO) than the opposite one."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    obs = torch.rand(512, 1, generator=g) * 2 - 1
    act = 0.8 * torch.sign(obs) + 0.05 * torch.randn(512, 1, generator=g)
    model = CVAE(1, 1, hidden=32, layers=2)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = model.fit_loss(obs, act, g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    test = torch.tensor([[0.7], [-0.7]])
    draws = model.sample(test, 16, g)
    assert draws.shape == (16, 2, 1)
    torch.testing.assert_close(draws.mean(0), torch.tensor([[0.8], [-0.8]]), atol=0.2, rtol=0)
    good = model.log_prob(test, torch.tensor([[0.8], [-0.8]]))
    bad = model.log_prob(test, torch.tensor([[-0.8], [0.8]]))
    assert torch.all(good > bad) and math.isfinite(float(good.sum()))
