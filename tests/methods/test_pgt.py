"""PGT room: DPO loss and pairs against hand values and the loop reference, the trajectory log-likelihood against
the per-step loop (values and gradients), z-only optimisation with a frozen policy, best-z selection, the
Gymnasium view of the world, and the null arm."""

import math

import pytest
import torch
from gymnasium.utils.env_checker import check_env

from icml26.methods.pgt import experiments as ex
from icml26.methods.pgt import reference as ref
from icml26.methods.pgt import world
from icml26.methods.pgt.config import PGTConfig
from icml26.methods.pgt.pgt import dpo_loss, pgt, preference_pairs, split_pairs, tune_latent
from icml26.methods.pgt.policy import GoalPolicy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("field,value", [("lr", 0.0), ("beta", -1.0), ("epochs", 0), ("eval_fraction", 1.0),
                                         ("max_train_pairs", 0), ("rounds", 0)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        PGTConfig(**{field: value})


def test_dpo_loss_hand_values():
    # equal margins: -log sigma(0) = log 2
    assert float(dpo_loss(torch.tensor(1.0), torch.tensor(2.0), torch.tensor(1.0), torch.tensor(2.0), 0.1)) == \
        pytest.approx(math.log(2))
    # margin (3 - 1) - (0 - 1) = 3, beta 0.5: -log sigma(1.5)
    got = float(dpo_loss(torch.tensor(3.0), torch.tensor(0.0), torch.tensor(1.0), torch.tensor(1.0), 0.5))
    assert got == pytest.approx(math.log1p(math.exp(-1.5))) == pytest.approx(ref.dpo_loss(3, 0, 1, 1, 0.5))


def test_pairs_every_strictly_better_ordered_pair():
    r = torch.tensor([0.5, -1.0, 0.5, 2.0])
    assert preference_pairs(r) == ref.pairs(r.tolist())
    assert set(preference_pairs(r)) == {(0, 1), (2, 1), (3, 0), (3, 1), (3, 2)}
    tr, ev = split_pairs(preference_pairs(r), PGTConfig(max_train_pairs=2, max_eval_pairs=1),
                         torch.Generator().manual_seed(0))
    assert len(tr) == 2 and len(ev) == 1 and not set(tr) & set(ev)


@pytest.mark.parametrize("t", [1, 7])
def test_trajectory_logprob_matches_loop_values_and_gradients(t):
    torch.manual_seed(0)
    pol = GoalPolicy(z_dim=3, hidden=8)
    s, a = torch.randn(2, t, world.OBS_DIM), torch.randn(2, t, world.ACT_DIM)
    z = torch.randn(3, requires_grad=True)
    fast = pol.log_prob(s, a, z)
    slow = torch.stack([ref.trajectory_logprob(pol, s[i], a[i], z) for i in range(2)])
    torch.testing.assert_close(fast, slow)
    g_fast = torch.autograd.grad(fast.sum(), [z, pol.log_std])
    g_slow = torch.autograd.grad(slow.sum(), [z, pol.log_std])
    for x, y in zip(g_fast, g_slow):
        torch.testing.assert_close(x, y)


class _Direct(torch.nn.Module):
    """A hand-built goal policy whose action mean is its latent z (3,): the latent is the action."""

    def __init__(self):
        super().__init__()
        self.log_std = torch.nn.Parameter(torch.full((3,), math.log(0.5)))

    def mean(self, obs, z):
        return z.expand(*obs.shape[:-1], 3)

    def log_prob(self, obs, actions, z):
        mu, std = self.mean(obs, z), self.log_std.exp()
        return (-0.5 * ((actions - mu) / std).pow(2) - self.log_std - 0.5 * math.log(2 * math.pi)).sum((-1, -2))


def _reach_scene(gen):
    return world.index_scene(world.sample_scenes(1, gen, torch.tensor([0])), 0)


def test_only_z_moves_and_heldout_loss_is_kept_best():
    pol = _Direct()
    before = [p.detach().clone() for p in pol.parameters()]
    gen = torch.Generator().manual_seed(1)
    z_ref = torch.zeros(3)
    s, a, r = world.rollout(pol.mean, pol.log_std, z_ref, _reach_scene(gen), (12,), 8, gen)
    z, log = tune_latent(pol, z_ref, s, a, r, PGTConfig(epochs=5), gen)
    assert all(torch.equal(p, q) for p, q in zip(before, pol.parameters()))
    assert all(p.requires_grad for p in pol.parameters())  # unfrozen again for the caller
    assert not torch.equal(z, z_ref) and log["held_loss"][0] == pytest.approx(math.log(2))
    assert min(log["held_loss"]) <= log["held_loss"][0] and log["train_pairs"] <= 20 and log["eval_pairs"] <= 10


def test_pgt_raises_the_return_of_a_policy_that_reads_z():
    """PGT from z_ref = 0 on a reach task moves the latent of a policy that reads it (``_Direct``) so that the
    return rises: the preferred rollouts moved toward the object."""
    pol = _Direct()
    gen = torch.Generator().manual_seed(3)
    scene = _reach_scene(gen)

    def collect(z):
        return world.rollout(pol.mean, pol.log_std, z, scene, (30,), 8, gen)

    z_ref = torch.zeros(3)
    z, logs = pgt(pol, z_ref, collect, PGTConfig(epochs=10, rounds=2, lr=0.01), gen)
    eg = torch.Generator().manual_seed(9)
    before = float(world.rollout(pol.mean, pol.log_std, z_ref, scene, (200,), 8, eg)[2].mean())
    eg = torch.Generator().manual_seed(9)
    after = float(world.rollout(pol.mean, pol.log_std, z, scene, (200,), 8, eg)[2].mean())
    assert after > before + 0.02


def test_gymnasium_view_of_the_world():
    import gymnasium as gym

    env = gym.make("icml26/ProcWorld-v0", family="fetch", horizon=5)
    check_env(env.unwrapped)
    obs, info = env.reset(seed=0)
    assert info["family"] == "fetch" and obs.shape == (world.OBS_DIM,)
    obs2, r, term, trunc, _ = env.step([1.0, 0.0, -1.0])
    assert obs2[0] == pytest.approx(obs[0] + 0.1, abs=1e-6) and r < 0 and not term and not trunc
    with pytest.raises(ValueError, match="family"):
        world.ProcWorldEnv(family="teleport")


@pytest.mark.slow  # ~10 s on a quiet core, ~95 s at load average 19
def test_null_arm_fails_comparator(monkeypatch):
    cfg = ex.SPECS[0].tiers["smoke"]
    lrs = {"pgt": 1e-2, "full_ft": 1e-3, "lora": 3e-3, "bitfit": 3e-3, "vera": 1e-2}
    res = ex.run_arms(cfg, 0, lrs, world.ID, arms=("pgt", "prompt", "full_ft"))
    _, stats, checks = ex._stats(res)
    assert checks["policy_frozen"] == 1.0 and all(math.isfinite(v) for v in stats.values() if v == v)
    assert stats["forgetting_pgt"] == 0.0  # measured: theta untouched, same rollouts
    ex._RUNS.clear()
    monkeypatch.setattr(ex, "pgt_tasks", lambda policy, z_ref, collect, cfg, gens:
                        (z_ref, [[{"held_loss": [0.0]}] for _ in z_ref]))
    null = ex._stats(ex.run_arms(cfg, 0, lrs, world.ID, arms=("pgt", "prompt")))[1]
    ex._RUNS.clear()
    assert null["rel_improvement_vs_prompt"] == 0.0
    assert not ex.SPECS[0].comparator.holds(null["rel_improvement_vs_prompt"])
    # the forgetting claim's null arm: PGT against itself (no weight arm) gives a gap of 0
    spec = next(s for s in ex.SPECS if s.id == "pgt_no_forgetting")
    assert not spec.comparator.holds(null["forgetting_pgt"] - stats["forgetting_pgt"])
