"""SALAAD bad input, through the public API: each refused call raises a ValueError/TypeError naming the problem,
and leaves the model's weights and the hook's L, S, Y, controllers and counters as they were. Also runs the card's
Usage snippet verbatim."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from icml26.methods.salaad import (SALAAD, SALAADConfig, ialm_rpca, magnitude_prune, rpca_components, svd_truncate,
                                   truncate_to_budget)

pytestmark = pytest.mark.usefixtures("one_thread")
README = Path(__file__).resolve().parents[2] / "src/icml26/methods/salaad/README.md"


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(model, weights) -> bool:
    return all(torch.equal(a, b.detach()) for a, b in zip(weights, model.parameters()))


def _hook_state(hook):
    return {n: (b.L.clone(), b.S.clone(), b.Y.clone(), b.rho, b.alpha.value, b.beta.value, b.epoch)
            for n, b in hook.blocks.items()}, hook.num_steps, hook.num_updates


def _same_hook(hook, state) -> bool:
    blocks, steps, updates = state
    now = _hook_state(hook)
    return (steps, updates) == now[1:] and all(
        all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(blocks[n], now[0][n]))
        for n in blocks)


def _trained_hook(model):
    hook = SALAAD(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(5, 8, generator=gen)
        loss = model(x).pow(2).mean() + hook.penalty()
        opt.zero_grad()
        loss.backward()
        opt.step()
        hook.step()
    return hook


# ---------------------------------------------------------------------------------------------- construction
def test_bad_construction_arguments_raise_before_any_weight_changes():
    model = _model()
    weights = _weights(model)
    cases = [
        (lambda: SALAAD("model"), TypeError, "model must be an nn.Module"),
        (lambda: SALAAD(model, dtype=torch.int64), TypeError, "floating torch.dtype"),
        (lambda: SALAAD(model, dtype="float32"), TypeError, "floating torch.dtype"),
        (lambda: SALAAD(model, config={"num_freq": 2}), ValueError, "config must be a SALAADConfig"),
        (lambda: SALAAD(model, {"(": "linear"}), ValueError, "not a valid regular expression"),
        (lambda: SALAAD(model, {r".*weight": "conv"}), ValueError, "kind must be one of"),
        (lambda: SALAAD(model, {r".*weight": 3}), ValueError, "must be a BlockConfig or a kind name"),
        (lambda: SALAAD(model, {r"nope\.weight": "linear"}), ValueError, "match no 2-D parameter"),
        (lambda: SALAADConfig(num_freq=0), ValueError, "num_freq"),
        (lambda: SALAADConfig(hpa_gamma=True), ValueError, "hpa_gamma"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    assert _same(model, weights)


def test_nan_weight_refused_before_truncate_init_rewrites_the_other_blocks():
    model = _model()
    with torch.no_grad():
        model[2].weight[1, 1] = math.nan
    weights = _weights(model)
    for config in (SALAADConfig(), SALAADConfig(truncate_init=True)):
        with pytest.raises(ValueError, match=r"weight of block\(s\) \['2.weight'\] has NaN or inf"):
            SALAAD(model, config=config)
    assert all(torch.equal(a, b) or (a.isnan() == b.isnan()).all() for a, b in zip(weights, _weights(model)))
    assert torch.equal(weights[0], model[0].weight.detach())  # the healthy block was not truncated


# ---------------------------------------------------------------------------------------------- training time
def test_diverged_weight_stops_the_admm_update_before_any_block_or_counter_moves():
    model = _model()
    hook = _trained_hook(model)
    assert hook.num_steps == 4 and hook.num_updates == 2
    with torch.no_grad():
        model[2].weight[0, 0] = math.inf
    assert hook.step() is False  # odd step: no ADMM block is due, nothing to check
    state = _hook_state(hook)
    with pytest.raises(ValueError, match=r"weight X of block\(s\) \['2.weight'\] has NaN or inf"):
        hook.step()
    assert _same_hook(hook, state)
    with pytest.raises(ValueError, match="NaN or inf"):
        hook.admm_update()
    assert _same_hook(hook, state)
    with torch.no_grad():
        model[2].weight[0, 0] = 0.0
    assert hook.step() is True and hook.num_steps == 6 and hook.num_updates == 3  # retried after the fix


def test_load_state_dict_checks_every_block_before_loading_any():
    model = _model()
    hook = _trained_hook(model)
    good = hook.state_dict()
    fresh = SALAAD(_model(seed=3))
    state = _hook_state(fresh)

    def edited(block, key, value):
        bad = fresh.state_dict() | {"blocks": {n: dict(b) for n, b in good["blocks"].items()}}
        bad["num_steps"], bad["num_updates"] = good["num_steps"], good["num_updates"]
        bad["blocks"][block][key] = value
        return bad

    cases = [
        (edited("2.weight", "L", torch.zeros(9, 9)), r"block 2.weight: L has shape \(9, 9\), expected \(4, 6\)"),
        (edited("2.weight", "Y", torch.full((4, 6), math.nan)), "block 2.weight: Y has NaN or inf"),
        (edited("2.weight", "rho", -1.0), "rho must be a positive finite number"),
        (edited("2.weight", "alpha", {"value": math.nan, "dvalue": 0.0, "updates": 1, "previous_rate": 0.0}),
         "alpha controller state is not finite"),
        (edited("2.weight", "S", [[0.0]]), "S must be a tensor"),
        (good | {"num_steps": -1}, "num_steps must be an int >= 0"),
        ({"blocks": {}}, "state must be a SALAAD.state_dict()"),
        (good | {"blocks": {"0.weight": good["blocks"]["0.weight"]}}, "differ from this hook's"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            fresh.load_state_dict(bad)
        assert _same_hook(fresh, state)  # in particular block 0.weight, checked first, was not loaded
    fresh.load_state_dict(good)
    assert fresh.num_updates == 2


# ---------------------------------------------------------------------------------------------- deployment
def test_truncate_to_budget_refuses_bad_fractions_and_components():
    model = _model()
    hook = _trained_hook(model)
    weights = _weights(model)
    L, S = hook.blocks["0.weight"].L, hook.blocks["0.weight"].S
    cases = [
        (dict(fraction=0.0, components=hook), ValueError, r"fraction .* must lie in \(0, 1\]"),
        (dict(fraction=math.nan, components=hook), ValueError, "fraction"),
        (dict(fraction=1.5, components=hook), ValueError, "fraction"),
        (dict(fraction=0.5, components={}), ValueError, "components is empty"),
        (dict(fraction=0.5, components=[1, 2]), ValueError, "SALAAD hook, its state_dict"),
        (dict(fraction=0.5, components={"nope": (L, S)}), ValueError, r"\['nope'\] are not parameters"),
        (dict(fraction=0.5, components={"0.weight": (L[:5], S[:5])}), ValueError, r"parameter's shape \(6, 8\)"),
        (dict(fraction=0.5, components={"0.weight": (L, S.T)}), ValueError, r"S \(8, 6\)"),
        (dict(fraction=0.5, components={"0.weight": (L * math.nan, S)}), ValueError, "NaN or inf"),
        (dict(fraction=0.5, components=hook, config={"hpa_gamma": 0.5}), TypeError, "must be a SALAADConfig"),
        (dict(fraction=0.5, components=hook, method=""), TypeError, "non-empty str"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            truncate_to_budget(model, **kwargs)
    assert _same(model, weights)
    small, report = truncate_to_budget(model, 0.5, components=hook.state_dict())
    assert report.params <= report.target_params


def test_baselines_refuse_bad_blocks_and_options():
    model = _model()
    weights = _weights(model)
    for fn in (lambda b: svd_truncate(model, 0.5, b), lambda b: magnitude_prune(model, 0.5, b),
               lambda b: rpca_components(model, b)):
        with pytest.raises(ValueError, match="blocks is empty"):
            fn([])
        with pytest.raises(ValueError, match=r"\['nope'\] are not parameters"):
            fn(["nope"])
        with pytest.raises(ValueError, match="not 2-D"):
            fn(["0.bias"])
        with pytest.raises(TypeError, match="list of parameter names"):
            fn("0.weight")
    with pytest.raises(ValueError, match="allocation must be one of"):
        svd_truncate(model, 0.5, ["0.weight"], allocation="best")
    for kwargs, match in ((dict(eps1=-1.0), "eps1"), (dict(eps2=math.nan), "eps2"), (dict(max_iter=0), "max_iter"),
                          (dict(lam_scale=math.inf), "lam_scale")):
        with pytest.raises(ValueError, match=match):
            rpca_components(model, ["0.weight"], **kwargs)
    assert _same(model, weights)
    with torch.no_grad():
        model[0].weight[2, 2] = math.nan
    with pytest.raises(ValueError, match=r"\['0.weight'\] have NaN or inf"):
        svd_truncate(model, 0.5, ["0.weight"])


def test_ialm_rpca_input_checks_and_the_zero_matrix():
    for d, match in ((torch.ones(4), "2-D floating"), (torch.ones(3, 3, dtype=torch.long), "2-D floating"),
                     (torch.ones(0, 3), "empty"), (torch.full((3, 3), math.inf), "NaN or inf")):
        with pytest.raises(ValueError, match=match):
            ialm_rpca(d)
    for kwargs, match in ((dict(lam=math.nan), "lam"), (dict(mu=0.0), "mu"), (dict(rho=0.5), "rho"),
                          (dict(max_iter=2.5), "max_iter")):
        with pytest.raises(ValueError, match=match):
            ialm_rpca(torch.randn(3, 3), **kwargs)
    a, e, it = ialm_rpca(torch.zeros(3, 4))
    assert it == 0 and not a.any() and not e.any()


# ------------------------------------------------------------------------------------------------- the card
def test_readme_usage_snippet_runs(run_card_snippet):
    """Executes the card's Usage block verbatim."""
    scope = run_card_snippet(README, "## Usage\n")
    report, salaad = scope["report"], scope["salaad"]
    assert salaad.num_updates == 10 and set(salaad.blocks) == {"0.weight", "2.weight"}
    assert report.params <= report.target_params and type(scope["small"]) is nn.Sequential
