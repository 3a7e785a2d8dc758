"""PGT room, batched paths: the K-task weight fine-tuning baselines against per-task GoalPolicy copies and peft's own
LoRA and VeRA (outputs and gradients, odd shapes), K independent Adams from one stacked Adam, the batched latent tuning
against K calls of the single-task loop (exact), rollouts, the forgetting measure, and bad input."""

import copy
import math

import pytest
import torch

from icml26.methods.pgt import experiments as ex
from icml26.methods.pgt import finetune as ft
from icml26.methods.pgt import world
from icml26.methods.pgt.config import PGTConfig
from icml26.methods.pgt.pgt import tune_latent, tune_latents
from icml26.methods.pgt.policy import GoalPolicy

pytestmark = pytest.mark.usefixtures("one_thread")


def _policy(z_dim=3, hidden=5, world_dims=False):
    """A tiny policy; 2-D observations and actions unless ``world_dims`` (the procedural world's 20 and 3)."""
    torch.manual_seed(0)
    dims = {} if world_dims else {"obs_dim": 2, "act_dim": 2}
    return GoalPolicy(z_dim=z_dim, hidden=hidden, **dims)


def _load(policy: GoalPolicy, params: dict, k: int) -> GoalPolicy:
    """Task copy k of stacked params as a plain GoalPolicy."""
    out = copy.deepcopy(policy)
    lin = [m for m in out.net if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for i, m in enumerate(lin):
            for name, attr in ((f"W{i}", "weight"), (f"b{i}", "bias")):
                v = params[name]
                getattr(m, attr).copy_(v[k] if v.dim() > getattr(m, attr).dim() else v)
        ls = params["log_std"]
        out.log_std.copy_(ls[k] if ls.dim() == 2 else ls)
    return out


@pytest.mark.parametrize("shape", [(3, 7), (2, 1, 5)])
def test_full_mode_matches_per_task_policy_values_and_gradients(shape):
    pol = _policy()
    k = shape[0]
    tr, fr = ft.stacked_params(pol, k, "full")
    with torch.no_grad():
        for v in tr.values():
            v.add_(0.1 * torch.randn(v.shape))  # copies differ
    s, a = torch.randn(*shape, 4, 2), torch.randn(*shape, 4, 2)
    z = torch.randn(k, *([1] * (len(shape) - 1)), 1, 3)
    lp = ft.batched_log_prob({**fr, **tr}, s, a, z)
    lp.sum().backward()
    for j in range(k):
        ref = _load(pol, {**fr, **tr}, j)
        want = ref.log_prob(s[j], a[j], z[j])
        torch.testing.assert_close(lp[j], want)
        want.sum().backward()
        lin = [m for m in ref.net if isinstance(m, torch.nn.Linear)]
        torch.testing.assert_close(tr["W1"].grad[j], lin[1].weight.grad)
        torch.testing.assert_close(tr["b2"].grad[j], lin[2].bias.grad)
        torch.testing.assert_close(tr["log_std"].grad[j], ref.log_std.grad)


def test_lora_mode_is_peft_lora_values_and_gradients():
    """The batched LoRA forward equals peft's LoraConfig/get_peft_model model for every task copy, with B != 0."""
    pol = _policy(hidden=6)
    k = 3
    tr, fr = ft.stacked_params(pol, k, "lora", lora_r=2, lora_alpha=6.0, seed=5)
    assert set(tr) == {"A0", "A1", "A2", "B0", "B1", "B2"} and float(fr["scale"]) == pytest.approx(3.0)
    assert all(float(tr[f"B{i}"].detach().abs().sum()) == 0 for i in range(3))  # peft's init: B = 0
    with torch.no_grad():
        for i in range(3):
            tr[f"B{i}"].normal_()
    s, zz = torch.randn(k, 4, 2), torch.randn(k, 1, 3)
    out = ft.batched_mean({**fr, **tr}, s, zz)
    out.pow(2).sum().backward()
    for j in range(k):
        pm = ft.peft_lora(pol, r=2, alpha=6.0, seed=5 + j)
        layers = [pm.base_model.model.net[int(n.split(".")[1])] for n in ft.LORA_TARGETS]
        with torch.no_grad():
            for i, m in enumerate(layers):
                torch.testing.assert_close(m.lora_A["default"].weight, tr[f"A{i}"][j])  # same init through peft
                m.lora_B["default"].weight.copy_(tr[f"B{i}"][j])
        want = pm.base_model.model.mean(s[j], zz[j])
        torch.testing.assert_close(out[j], want)
        want.pow(2).sum().backward()
        for i, m in enumerate(layers):
            torch.testing.assert_close(tr[f"A{i}"].grad[j], m.lora_A["default"].weight.grad)
            torch.testing.assert_close(tr[f"B{i}"].grad[j], m.lora_B["default"].weight.grad)
        assert all(p.grad is None for n, p in pm.named_parameters() if "lora_" not in n)  # base frozen by peft


def test_vera_mode_is_peft_vera_values_and_gradients():
    """The batched VeRA forward equals peft's VeraConfig/get_peft_model model for every task copy (lambda_b != 0,
    copies differ), with peft's shared A, B sliced to the three differently shaped layers; only lambdas train."""
    pol = _policy(hidden=6)
    k = 3
    tr, fr = ft.stacked_params(pol, k, "vera", vera_r=4, seed=7)
    assert set(tr) == {"ld0", "ld1", "ld2", "lb0", "lb1", "lb2"}
    assert all(float(tr[f"lb{i}"].detach().abs().sum()) == 0 for i in range(3))  # peft's init: lambda_b = 0
    assert all(torch.all(tr[f"ld{i}"].detach() == 0.1) for i in range(3))  # d_initial
    assert [tuple(fr[f"VA{i}"].shape) for i in range(3)] == [(4, 5), (4, 6), (4, 6)]
    with torch.no_grad():
        for i in range(3):
            tr[f"lb{i}"].normal_()
            tr[f"ld{i}"].normal_()
    s, zz = torch.randn(k, 4, 2), torch.randn(k, 1, 3)
    out = ft.batched_mean({**fr, **tr}, s, zz)
    out.pow(2).sum().backward()
    for j in range(k):
        pm = ft.peft_vera(pol, r=4, seed=7)
        layers = [pm.base_model.model.net[int(n.split(".")[1])] for n in ft.LORA_TARGETS]
        with torch.no_grad():
            for i, m in enumerate(layers):
                m.vera_lambda_b["default"].copy_(tr[f"lb{i}"][j])
                m.vera_lambda_d["default"].copy_(tr[f"ld{i}"][j])
        want = pm.base_model.model.mean(s[j], zz[j])
        torch.testing.assert_close(out[j], want)
        want.pow(2).sum().backward()
        for i, m in enumerate(layers):
            torch.testing.assert_close(tr[f"lb{i}"].grad[j], m.vera_lambda_b["default"].grad)
            torch.testing.assert_close(tr[f"ld{i}"].grad[j], m.vera_lambda_d["default"].grad)
        assert all(p.grad is None for n, p in pm.named_parameters() if "vera_lambda" not in n)


def test_bitfit_trains_biases_only():
    pol = _policy()
    tr, fr = ft.stacked_params(pol, 2, "bitfit")
    assert set(tr) == {"b0", "b1", "b2"} and {"W0", "W1", "W2", "log_std"} <= set(fr)
    assert all(not v.requires_grad for v in fr.values())


def test_stacked_adam_is_k_independent_adams():
    """Batched BC steps (one stacked Adam, summed loss) equal K separate Adam runs on GoalPolicy copies."""
    pol = _policy()
    k, steps = 3, 4
    tr, fr = ft.stacked_params(pol, k, "full")
    opt = ft.adam(tr.values(), 1e-2)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(k, 1, 5, 2, generator=gen), torch.randn(k, 1, 5, 2, generator=gen)) for _ in range(steps)]
    z = torch.randn(k, 1, 1, 3, generator=gen)
    for s, a in data:
        ft.bc_step(tr, fr, opt, s, a, z)
    for j in range(k):
        ref = copy.deepcopy(pol)
        o = torch.optim.Adam(ref.parameters(), lr=1e-2)
        for s, a in data:
            loss = -ref.log_prob(s[j], a[j], z[j]).mean() / 5
            o.zero_grad()
            loss.backward()
            o.step()
        got = _load(pol, {**fr, **{key: v.detach() for key, v in tr.items()}}, j)
        for p, q in zip(got.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)


def _rollouts(pol, k, n, ties=False):
    gen = torch.Generator().manual_seed(1)
    zr = torch.randn(k, 4)
    s, a, r = world.rollout(pol.mean, pol.log_std, zr[:, None], world.sample_scenes(k, gen), (k, n), 6, gen)
    if ties:
        r[0] = r[0].round(decimals=1)  # task 0: many tied returns, fewer pairs
    return zr, s, a, r


@pytest.mark.parametrize("ties", [False, True])
def test_tune_latents_equals_k_single_task_runs(ties):
    pol = _policy(z_dim=4, hidden=8, world_dims=True)
    k = 3
    zr, s, a, r = _rollouts(pol, k, 9, ties)
    cfg = (PGTConfig(epochs=2, max_train_pairs=None, max_eval_pairs=None) if ties  # unequal counts: fallback
           else PGTConfig(epochs=3, max_train_pairs=7, max_eval_pairs=3))
    before = [p.detach().clone() for p in pol.parameters()]
    zb, logs = tune_latents(pol, zr, s, a, r, cfg, [torch.Generator().manual_seed(10 + j) for j in range(k)])
    assert all(torch.equal(p, q) for p, q in zip(before, pol.parameters()))
    for j in range(k):
        z1, log1 = tune_latent(pol, zr[j], s[j], a[j], r[j], cfg, torch.Generator().manual_seed(10 + j))
        torch.testing.assert_close(zb[j], z1)
        torch.testing.assert_close(torch.tensor(logs[j]["held_loss"]), torch.tensor(log1["held_loss"]))
        assert logs[j]["pairs"] == log1["pairs"]


def test_tune_latents_rejects_mismatched_tasks():
    pol = _policy(z_dim=4, hidden=8, world_dims=True)
    zr, s, a, r = _rollouts(pol, 2, 5)
    with pytest.raises(ValueError, match="K=2"):
        tune_latents(pol, zr, s, a, r, PGTConfig(), [torch.Generator()])


def test_batched_rollout_of_one_task_is_the_policy_rollout():
    pol = _policy(world_dims=True)
    z = torch.randn(3)
    scene = world.sample_scenes(2, torch.Generator().manual_seed(0))
    one = world.index_scene(scene, 1)
    dyn = world.Dynamics((0.01, 0.0), 0.7)
    s1, a1, r1 = pol.rollout(z, one, 4, 5, torch.Generator().manual_seed(2), dyn)
    s2, a2, r2 = world.rollout(pol.mean, pol.log_std, z[None, None], world.index_scene(scene, slice(1, 2)), (1, 4),
                               5, torch.Generator().manual_seed(2), dyn)
    torch.testing.assert_close(s2[0], s1)
    torch.testing.assert_close(a2[0], a1)
    torch.testing.assert_close(r2[0], r1)


def test_finetune_bad_input_raises_before_work():
    pol = _policy(world_dims=True)
    with pytest.raises(ValueError, match="mode"):
        ft.stacked_params(pol, 2, "dora")
    with pytest.raises(ValueError, match="k"):
        ft.stacked_params(pol, 0, "full")
    scene = world.sample_scenes(2, torch.Generator().manual_seed(0))
    kw = dict(rounds=1, n_rollouts=5, steps=1, horizon=3, dyn=world.ID, gen=torch.Generator())
    with pytest.raises(ValueError, match="lr"):
        ft.finetune_tasks(pol, "full", torch.zeros(2, 3), scene, lr=0.0, **kw)
    with pytest.raises(ValueError, match="top_fraction"):
        ft.finetune_tasks(pol, "full", torch.zeros(2, 3), scene, lr=1e-3, top_fraction=0.0, **kw)
    with pytest.raises(ValueError, match="one scene per task"):
        ft.finetune_tasks(pol, "full", torch.zeros(3, 3), scene, lr=1e-3, **kw)


def test_finetune_tasks_moves_only_its_own_parameters():
    pol = _policy(world_dims=True)
    before = [p.detach().clone() for p in pol.parameters()]
    scene = world.sample_scenes(2, torch.Generator().manual_seed(0))
    kw = dict(lr=1e-2, rounds=1, n_rollouts=10, steps=5, horizon=4, dyn=world.ID, gen=torch.Generator())
    params = {m: ft.finetune_tasks(pol, m, torch.zeros(2, 3), scene, vera_r=4, **kw) for m in ft.MODES}
    assert all(torch.equal(p, q) for p, q in zip(before, pol.parameters()))  # the foundation is never written
    assert params["bitfit"]["W1"].dim() == 2 and params["bitfit"]["b1"].dim() == 2  # shared W, stacked b
    assert not torch.equal(params["bitfit"]["b1"][0], pol.net[2].bias)
    assert not torch.equal(params["full"]["W1"][1], pol.net[2].weight)
    assert params["vera"]["W1"].dim() == 2 and not torch.equal(params["vera"]["lb1"][0], torch.zeros(5))


def test_relative_forgetting_hand_values():
    before = torch.tensor([[-0.2, -0.4], [-0.5, -0.1]])
    after = torch.tensor([[-9.0, -0.5], [-0.4, -9.0]])  # diagonal (the tuned task itself) is ignored
    # off-diagonal: (-0.4 + 0.5) / 0.4 = 0.25 and (-0.5 + 0.4) / 0.5 = -0.2 -> mean 0.025
    assert ex._rel_forgetting(before, after) == pytest.approx(0.025)
    assert ex._rel_forgetting(before, before) == 0.0
    assert math.isnan(ex._rel_forgetting(before[:1, :1], after[:1, :1]))
