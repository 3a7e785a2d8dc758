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
from icml26.methods.pgt.policy import GoalPolicy, pretrain

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
    s, a = torch.randn(2, t, 2), torch.randn(2, t, 2)
    z = torch.randn(3, requires_grad=True)
    fast = pol.log_prob(s, a, z)
    slow = torch.stack([ref.trajectory_logprob(pol, s[i], a[i], z) for i in range(2)])
    torch.testing.assert_close(fast, slow)
    g_fast = torch.autograd.grad(fast.sum(), [z, pol.log_std])
    g_slow = torch.autograd.grad(slow.sum(), [z, pol.log_std])
    for x, y in zip(g_fast, g_slow):
        torch.testing.assert_close(x, y)


def _toy():
    torch.manual_seed(0)
    pol = GoalPolicy(z_dim=4, hidden=16)
    pretrain(pol, 30, horizon=10, batch=32, seed=0)
    return pol


def test_only_z_moves_and_heldout_loss_is_kept_best():
    pol = _toy()
    before = [p.detach().clone() for p in pol.parameters()]
    gen = torch.Generator().manual_seed(1)
    z_ref = torch.zeros(4)
    s, a = pol.rollout(z_ref, 12, 10, gen)
    goal = torch.tensor([0.5, 0.0])
    z, log = tune_latent(pol, z_ref, s, a, world.task_return(s, goal), PGTConfig(epochs=5), gen)
    assert all(torch.equal(p, q) for p, q in zip(before, pol.parameters()))
    assert all(p.requires_grad for p in pol.parameters())  # unfrozen again for the caller
    assert not torch.equal(z, z_ref) and log["held_loss"][0] == pytest.approx(math.log(2))
    assert min(log["held_loss"]) <= log["held_loss"][0] and log["train_pairs"] <= 20 and log["eval_pairs"] <= 10


def test_pgt_moves_the_policy_toward_the_goal():
    """A foundation pretrained briefly: PGT from a wrong prompt shortens the mean distance to the goal."""
    torch.manual_seed(0)
    pol = GoalPolicy(z_dim=8, hidden=32)
    pretrain(pol, 300, horizon=15, batch=64, seed=0)
    gen = torch.Generator().manual_seed(3)
    goal = torch.tensor([0.6, 0.3])
    z_ref = pol.encode(world.demos(torch.tensor([[-0.2, 0.6]]), 15, 0.0, gen)[0])[0].detach()

    def collect(z):
        s, a = pol.rollout(z, 30, 15, gen)
        return s, a, world.task_return(s, goal)

    z, logs = pgt(pol, z_ref, collect, PGTConfig(epochs=10, rounds=2), gen)
    eg = torch.Generator().manual_seed(9)
    before = float(world.task_return(pol.rollout(z_ref, 100, 15, eg)[0], goal).mean())
    eg = torch.Generator().manual_seed(9)
    after = float(world.task_return(pol.rollout(z, 100, 15, eg)[0], goal).mean())
    assert after > before + 0.02


def test_gymnasium_view_of_the_world():
    env = world.GoalReachEnv(goal=(0.5, 0.0), horizon=5)
    check_env(env)
    obs, _ = env.reset(seed=0)
    obs2, r, term, trunc, _ = env.step([1.0, 0.0])
    assert obs2[0] == pytest.approx(obs[0] + 0.1, abs=1e-6) and r < 0 and not term


def test_null_arm_fails_comparator(monkeypatch):
    cfg = ex.SPECS[0].tiers["smoke"]
    lrs = {"pgt": 1e-2, "full_ft": 1e-3, "lora": 3e-3, "bitfit": 3e-3}
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
