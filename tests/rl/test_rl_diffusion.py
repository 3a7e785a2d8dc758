"""The small diffusion behavior model (DARE's behavior="diffusion"): the VP schedule and DDPM posterior against
hand-computed values, the training loss and the ELBO proxy against a plain loop, gradients, energy guidance
(reduces exactly to unguided sampling at scale 0, pulls draws toward high energy), and that it learns a bimodal
action distribution that Gaussian BC cannot."""

import math

import pytest
import torch

from icml26.rl.nets import DiffusionBehavior, GaussianPolicy, vp_beta_schedule

pytestmark = pytest.mark.usefixtures("one_thread")


def test_vp_schedule_and_posterior_match_hand_computed_values():
    # T = 2: alpha_t = exp(-0.1 / 2 - 0.5 * 9.9 * (2t - 1) / 4)
    a1, a2 = math.exp(-0.05 - 0.5 * 9.9 / 4), math.exp(-0.05 - 0.5 * 9.9 * 3 / 4)
    torch.testing.assert_close(vp_beta_schedule(2), torch.tensor([1 - a1, 1 - a2]))
    m = DiffusionBehavior(1, 1, hidden=4, layers=1, n_steps=2)
    b1, b2 = 1 - a1, 1 - a2
    abar2 = a1 * a2
    # step 2 -> 1: c0 = beta_2 sqrt(abar_1) / (1 - abar_2), ct = (1 - abar_1) sqrt(alpha_2) / (1 - abar_2)
    torch.testing.assert_close(m.post_c0, torch.tensor([1.0, b2 * math.sqrt(a1) / (1 - abar2)]))
    torch.testing.assert_close(m.post_ct, torch.tensor([0.0, b1 * math.sqrt(a2) / (1 - abar2)]))
    torch.testing.assert_close(m.post_var, torch.tensor([0.0, b2 * b1 / (1 - abar2)]))


def test_one_step_sampling_is_the_clipped_x0_prediction():
    torch.manual_seed(0)
    m = DiffusionBehavior(3, 2, hidden=8, layers=1, n_steps=1)
    obs = torch.randn(5, 3)
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    draws = m.sample(obs, 2, g1)
    a_T = torch.randn((10, 2), generator=g2)
    ab = m.abar[0]
    ref = ((a_T - (1 - ab).sqrt() * m.eps(obs.repeat(2, 1), a_T, torch.zeros(10, dtype=torch.long))) / ab.sqrt())
    torch.testing.assert_close(draws, ref.clamp(-1, 1).view(2, 5, 2).detach())


def test_shapes_range_loss_and_elbo_proxy_match_a_plain_loop():
    torch.manual_seed(1)
    m = DiffusionBehavior(3, 2, hidden=16, layers=2, n_steps=3, n_elbo=2)
    obs, act = torch.randn(7, 3), torch.rand(7, 2) * 2 - 1
    g = torch.Generator().manual_seed(0)
    draws = m.sample(obs, 4, g)
    assert draws.shape == (4, 7, 2) and draws.abs().max() <= 1
    # fit_loss: L_simple at the generator's t and noise
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    loss = m.fit_loss(obs, act, g1)
    t = torch.randint(0, 3, (7,), generator=g2)
    eps = torch.randn(act.shape, generator=g2)
    ref = torch.stack([(m.eps(obs[i:i + 1], (m.abar[t[i]].sqrt() * act[i] + (1 - m.abar[t[i]]).sqrt() * eps[i])[None],
                              t[i:i + 1]) - eps[i]).pow(2).sum() for i in range(7)]).mean()
    torch.testing.assert_close(loss, ref)
    # log_prob: -1/2 mean over steps and the fixed (seed 0) noise draws, the same draws for every row
    lp = m.log_prob(obs, act)
    assert lp.shape == (7,)
    noise = torch.randn((3, 2, 1, 2), generator=torch.Generator().manual_seed(0))
    for i in range(7):
        errs = [(m.eps(obs[i:i + 1], (m.abar[s].sqrt() * act[i] + (1 - m.abar[s]).sqrt() * noise[s, j, 0])[None],
                       torch.tensor([s])) - noise[s, j, 0]).pow(2).sum() for s in range(3) for j in range(2)]
        torch.testing.assert_close(lp[i], -0.5 * torch.stack(errs).mean())
    # a deterministic function of (s, a): permuting the batch permutes the scores
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    torch.testing.assert_close(m.log_prob(obs[perm], act[perm]), lp[perm])


def test_gradients_flow_to_every_parameter_and_to_the_action():
    torch.manual_seed(2)
    m = DiffusionBehavior(3, 2, hidden=8, layers=2, n_steps=4).double()
    obs = torch.randn(5, 3, dtype=torch.float64)
    act = (torch.rand(5, 2, dtype=torch.float64) * 2 - 1).requires_grad_(True)
    m.fit_loss(obs, act.detach(), torch.Generator().manual_seed(0)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
               for p in m.parameters())
    assert torch.autograd.gradcheck(lambda a: m.log_prob(obs, a), (act,))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="n_steps"):
        DiffusionBehavior(2, 2, n_steps=0)
    m = DiffusionBehavior(2, 2, hidden=4, layers=1)
    with pytest.raises(ValueError, match="guidance_scale"):
        m.sample(torch.zeros(3, 2), 2, guidance_scale=-1.0)


def _bimodal(n, g):
    """Actions at +-(0.7, 0.5) with probability 1/2 each whatever the state: the mean (0, 0) is never taken."""
    s = torch.randn(n, 2, generator=g)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).unsqueeze(-1)
    return s, sign * torch.tensor([0.7, 0.5]) + 0.05 * torch.randn(n, 2, generator=g)


def _fit(model, g, steps=600):
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        s, a = _bimodal(256, g)
        loss = model.fit_loss(s, a, g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@pytest.fixture(scope="module")
def fitted():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    return (_fit(DiffusionBehavior(2, 2, hidden=64, layers=2, n_steps=10), g),
            _fit(GaussianPolicy(2, 2, hidden=64, layers=2), g))


MODE = torch.tensor([0.7, 0.5])


def _near(x, c, r):
    return float(((x - c).norm(dim=-1) < r).float().mean())


def test_learns_a_bimodal_distribution_that_gaussian_bc_cannot(fitted):
    diff, gauss = fitted
    g = torch.Generator().manual_seed(1)
    s, _ = _bimodal(200, g)
    xd, xg = diff.sample(s, 5, g), gauss.sample(s, 5, g)
    # the diffusion model's draws sit on both modes, rarely between them; Gaussian BC's sit mostly between
    assert _near(xd, MODE, 0.25) > 0.25 and _near(xd, -MODE, 0.25) > 0.25 and _near(xd, 0 * MODE, 0.3) < 0.15
    assert _near(xg, MODE, 0.25) + _near(xg, -MODE, 0.25) < 0.2
    # as an alignment score: a mode action is more behavior-like than the (never taken) mean under the ELBO proxy;
    # Gaussian BC ranks them the other way round
    with torch.no_grad():
        mode, mid = MODE.expand(200, 2), torch.zeros(200, 2)
        assert diff.log_prob(s, mode).mean() > diff.log_prob(s, mid).mean() + 0.1
        assert gauss.log_prob(s, mid).mean() > gauss.log_prob(s, mode).mean()


def test_energy_guidance_reduces_to_sampling_and_pulls_toward_high_energy(fitted):
    diff, _ = fitted
    diff.zero_grad(set_to_none=True)
    s = torch.randn(100, 2, generator=torch.Generator().manual_seed(2))
    energy = lambda o, a: a.sum(-1)  # noqa: E731  favours the + mode
    plain = diff.sample(s, 4, torch.Generator().manual_seed(5))
    zero = diff.sample(s, 4, torch.Generator().manual_seed(5), energy=energy, guidance_scale=0.0)
    assert torch.equal(plain, zero)
    guided = diff.sample(s, 4, torch.Generator().manual_seed(5), energy=energy, guidance_scale=0.5)
    plus = lambda x: float((x.sum(-1) > 0).float().mean())  # noqa: E731
    assert plus(guided) > plus(plain) + 0.15 and guided.abs().max() <= 1
    assert all(p.grad is None for p in diff.parameters())
