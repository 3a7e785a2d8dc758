"""Janus-LoRA bad input, through the public API: every refused call raises a ValueError/TypeError naming the
problem, and leaves the model's parameters, the trainer's momentum buffers, task counter and bases, and the
prototype memory exactly as they were. Also runs the card's Usage snippet verbatim."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from icml26.core.adapters import AdapterConfig, inject_adapters
from icml26.methods.janus_lora import (JanusLoRAConfig, JanusLoRALinear, JanusTrainer, OnlineSubspace,
                                       PrototypeMemory, decoupled_margin_loss, janus_make, project_off,
                                       rectify_min_norm)

pytestmark = pytest.mark.usefixtures("one_thread")
README = Path(__file__).resolve().parents[2] / "src/icml26/methods/janus_lora/README.md"


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    inject_adapters(model, AdapterConfig(r=2, alpha=4, target_modules=["0", "2"]), janus_make())
    return model


def _trained(config: JanusLoRAConfig | None = None):
    """A model, its trainer and head after one finished task and two steps of the next (non-empty bases,
    non-empty momentum buffers)."""
    model, head = _model(), nn.Linear(3, 2)
    trainer = JanusTrainer(model, config or JanusLoRAConfig(), extra_params=head.parameters())
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 2, (8,), generator=gen)
    for _ in range(2):
        trainer.begin_task()
        for _ in range(2):
            trainer.step(nn.functional.cross_entropy(head(model(x)), y))
        if trainer.task == 0:
            trainer.end_task(data=lambda: [x])
    return model, head, trainer, x, y


def _snapshot(model, head, trainer):
    return ([p.detach().clone() for p in [*model.parameters(), *head.parameters()]],
            {k: v.clone() for k, v in trainer.buffers.items()},
            {n: s.basis.clone() for n, s in trainer.subspaces.items()}, trainer.task, len(trainer.nv_history))


def _assert_unchanged(model, head, trainer, snap) -> None:
    params, buffers, bases, task, history = snap
    assert all(torch.equal(a, b.detach()) for a, b in zip(params, [*model.parameters(), *head.parameters()]))
    assert buffers.keys() == trainer.buffers.keys()
    assert all(torch.equal(buffers[k], trainer.buffers[k]) for k in buffers)
    assert all(torch.equal(bases[n], s.basis) for n, s in trainer.subspaces.items())
    assert (task, history) == (trainer.task, len(trainer.nv_history))


# ------------------------------------------------------------------------------------------------ the adapter
@pytest.mark.parametrize("r, alpha, error, match", [
    (0, 4.0, ValueError, "must be >= 1"), (-2, 4.0, ValueError, "must be >= 1"),
    (2.5, 4.0, TypeError, "must be an int"), (True, 4.0, TypeError, "must be an int"),
    (4, 4.0, ValueError, r"exceeds min\(in_features, out_features\) = 3"),
    (2, math.inf, ValueError, "alpha must be a finite number > 0"), (2, math.nan, ValueError, "alpha"),
    (2, 0.0, ValueError, "alpha"), (2, -1.0, ValueError, "alpha")])
def test_bad_rank_or_alpha_refused_before_the_base_is_frozen(r, alpha, error, match):
    base = nn.Linear(5, 3)
    with pytest.raises(error, match=match):
        JanusLoRALinear(base, r, alpha)
    assert base.weight.requires_grad and base.bias.requires_grad


def test_inject_with_a_rank_above_the_layer_refuses_and_leaves_the_model():
    model = nn.Sequential(nn.Linear(5, 3))
    with pytest.raises(ValueError, match="rank r=4 exceeds"):
        inject_adapters(model, AdapterConfig(r=4, alpha=4, target_modules=["0"]), janus_make())
    assert type(model[0]) is nn.Linear and model[0].weight.requires_grad


def test_wrong_input_width_and_non_finite_tracked_input_raise_before_the_covariance_changes():
    model, head, trainer, x, _ = _trained()
    layer = model[0]
    with pytest.raises(ValueError, match=r"expects inputs \(\.\.\., 5\), got shape \(8, 7\)"):
        model(torch.randn(8, 7))
    with pytest.raises(ValueError, match="input is on meta but the adapter is on cpu"):
        model(torch.randn(8, 5, device="meta"))
    cov, count = layer.input_cov.clone(), layer.input_count
    bad = x.clone()
    bad[3, 1] = math.inf
    with pytest.raises(ValueError, match="non-finite input .* Online Estimation"):
        model(bad)
    assert torch.equal(layer.input_cov, cov) and layer.input_count == count
    for janus in trainer.layers.values():  # outside OE a NaN input is the loss's problem: step() refuses it
        janus.track_inputs = False
    out = model(bad)
    with pytest.raises(ValueError, match="loss is not finite"):
        trainer.step(out.sum())


# ------------------------------------------------------------------------------------------------ the trainer
def test_trainer_refuses_a_config_that_is_not_a_janus_config():
    with pytest.raises(TypeError, match="config must be a JanusLoRAConfig, got dict"):
        JanusTrainer(_model(), {"projection": "gr"})
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        JanusTrainer("model", JanusLoRAConfig())
    with pytest.raises(ValueError, match="no JanusLoRALinear layers"):
        JanusTrainer(nn.Linear(3, 3), JanusLoRAConfig())


@pytest.mark.parametrize("projection", ["gr", "gpm", "none"])
def test_bad_losses_update_nothing(projection):
    model, head, trainer, x, y = _trained(JanusLoRAConfig(projection=projection))
    snap = _snapshot(model, head, trainer)
    logits = head(model(x))
    with pytest.raises(ValueError, match=r"loss is not finite \(nan\)"):
        trainer.step(nn.functional.cross_entropy(logits, y) * math.nan)
    with pytest.raises(ValueError, match="loss is not finite"):
        trainer.step(logits.sum() + math.inf)
    with pytest.raises(ValueError, match=r"must be a scalar, got shape \(8, 2\)"):
        trainer.step(logits)
    with pytest.raises(ValueError, match="does not depend on any trainable parameter"):
        trainer.step(torch.tensor(1.0))
    with pytest.raises(TypeError, match="scalar tensor, got float"):
        trainer.step(1.0)
    # finite loss, NaN gradient: sqrt at 0 has an infinite derivative, times 0 is NaN
    with pytest.raises(ValueError, match=r"non-finite gradient in \[.*janus_A.*\]: no parameter was updated"):
        trainer.step(torch.sqrt(0.0 * logits.sum().abs()) + nn.functional.cross_entropy(logits, y))
    _assert_unchanged(model, head, trainer, snap)
    trainer.step(nn.functional.cross_entropy(head(model(x)), y))  # still usable
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_end_task_bad_data_or_poisoned_covariance_changes_no_basis():
    model, head, trainer, x, _ = _trained()
    snap = _snapshot(model, head, trainer)
    with pytest.raises(TypeError, match="data must be a function"):
        trainer.end_task(data=[x])
    model[2].input_cov[0, 0] = math.nan  # e.g. overflow in a long task
    with pytest.raises(ValueError, match=r"input covariance of layer '2' has NaN or inf"):
        trainer.end_task()
    _assert_unchanged(model, head, trainer, snap)
    gpm = JanusTrainer(_model(), JanusLoRAConfig(subspace="gpm"))
    gpm.begin_task()
    with pytest.raises(ValueError, match=r"subspace='gpm' needs end_task\(data=\.\.\.\)"):
        gpm.end_task()
    assert gpm.nv_history == []


def test_load_state_dict_checks_everything_before_loading():
    model, head, trainer, *_ = _trained()
    good = trainer.state_dict()
    other = JanusTrainer(_model(seed=3), JanusLoRAConfig())
    before = {n: s.basis.clone() for n, s in other.subspaces.items()}
    name = next(iter(good["bases"]))
    cases = [
        ({"task": 5, "bases": {**good["bases"], name: torch.zeros(99, 1, dtype=torch.float64)}}, "99 rows"),
        ({"task": 5, "bases": {**good["bases"], name: torch.full((5, 1), math.nan, dtype=torch.float64)}}, "NaN"),
        ({"task": 5, "bases": {**good["bases"], name: torch.ones(5, 2, dtype=torch.float64)}}, "not orthonormal"),
        ({"task": 5, "bases": {**good["bases"], name: torch.ones(5)}}, "2-D tensor"),
        ({"task": "5", "bases": good["bases"]}, "task must be an int"),
        ({"task": 5, "bases": {name: good["bases"][name]}}, "do not match"),
        ({"bases": good["bases"]}, "keys 'task' and 'bases'"),
    ]
    for state, match in cases:
        with pytest.raises(ValueError, match=match):
            other.load_state_dict(state)
        assert other.task == -1
        assert all(torch.equal(before[n], s.basis) for n, s in other.subspaces.items())
    other.load_state_dict(good)
    assert other.task == trainer.task


# -------------------------------------------------------------------------------- memory, DML, OE, GR pieces
def test_prototype_memory_refuses_bad_batches_and_keeps_its_prototypes():
    memory = PrototypeMemory()
    with pytest.raises(ValueError, match="no prototypes stored yet"):
        memory.predict(torch.randn(2, 3))
    memory.add(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]))
    classes, means = list(memory.classes), [m.clone() for m in memory.means]
    cases = [
        ((torch.full((2, 3), math.nan), torch.tensor([2, 2])), ValueError, "NaN or inf"),
        ((torch.randn(3, 3), torch.tensor([2, 3])), ValueError, r"\(n, D\) and labels \(n,\)"),
        ((torch.randn(3), torch.tensor([2, 3, 4])), ValueError, r"\(n, D\)"),
        ((torch.randn(0, 3), torch.zeros(0, dtype=torch.long)), ValueError, "empty batch"),
        ((torch.randn(2, 3), torch.tensor([2.0, 3.0])), TypeError, "integer class ids"),
        ((torch.randn(2, 4), torch.tensor([2, 3])), ValueError, "dimension 4, the stored prototypes 3"),
        (([[1.0, 2.0, 3.0]], [2]), TypeError, "must be tensors"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            memory.add(*args)
    assert memory.classes == classes and all(torch.equal(a, b) for a, b in zip(means, memory.means))
    with pytest.raises(ValueError, match=r"features must be \(n, 3\)"):
        memory.predict(torch.randn(2, 4))
    assert memory.predict(torch.randn(2, 3)).shape == (2,)


def test_dml_refuses_mismatched_features_and_margins():
    memory = PrototypeMemory()
    memory.add(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]))
    _, _, trainer, *_ = _trained()
    with pytest.raises(ValueError, match="features have dimension 5 but the prototypes are"):
        trainer.dml_loss(torch.randn(4, 5), memory)
    with pytest.raises(ValueError, match=r"features must be \(n, D\)"):
        decoupled_margin_loss(torch.randn(3), memory.matrix(), 0.1)
    for margin in (1.0, -1.5, math.nan, True):
        with pytest.raises(ValueError, match=r"margin must be a cosine in \[-1, 1\)"):
            decoupled_margin_loss(torch.randn(4, 3), memory.matrix(), margin)


def test_online_subspace_and_gr_helpers_refuse_bad_shapes_and_values():
    for dim, tau, match in ((0, 0.9, "dim"), (-3, 0.9, "dim"), (3.0, 0.9, "dim"), (3, 0.0, "tau"),
                            (3, 1.5, "tau"), (3, math.nan, "tau")):
        with pytest.raises(ValueError, match=match):
            OnlineSubspace(dim, tau)
    sub = OnlineSubspace(3, 0.9)
    with pytest.raises(ValueError, match=r"must be a \(3, 3\) input covariance, got \(4, 4\)"):
        sub.update(torch.eye(4))
    with pytest.raises(ValueError, match="NaN or inf"):
        sub.update(torch.full((3, 3), math.inf))
    assert sub.basis.shape == (3, 0)
    A, B, V = torch.randn(2, 3), torch.randn(4, 2), torch.linalg.qr(torch.randn(3, 1))[0]
    with pytest.raises(ValueError, match=r"the basis V must be \(d_in=3, k\), got shape \(5, 1\)"):
        rectify_min_norm(A, B, torch.randn(5, 1), A, B)
    with pytest.raises(ValueError, match="the steps must have the factors' shapes"):
        rectify_min_norm(A, B, V, A.T, B)
    with pytest.raises(ValueError, match=r"A \(r, d_in\) and B \(d_out, r\)"):
        rectify_min_norm(A, B.T, V, A, B.T)
    for rcond in (0.0, -1.0, 1.0, math.nan):
        with pytest.raises(ValueError, match=r"rcond must lie in \(0, 1\)"):
            rectify_min_norm(A, B, V, A, B, rcond=rcond)
    with pytest.raises(ValueError, match="project_off: the basis V"):
        project_off(A, torch.randn(4, 1))


@pytest.mark.parametrize("field, value", [("lr", True), ("lr", -0.1), ("lr", math.inf), ("momentum", 1.0),
                                          ("dml_weight", math.nan), ("energy_threshold", 0.0),
                                          ("projection", "GR"), ("subspace", "stream"), ("gr_solver", "ridge")])
def test_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        JanusLoRAConfig(**{field: value})


# ------------------------------------------------------------------------------------------------ the card
def test_readme_usage_snippet_runs(run_card_snippet):
    """Executes the card's Usage block verbatim."""
    scope = run_card_snippet(README, "## Usage\n")
    assert scope["trainer"].task == 1 and len(scope["trainer"].nv_history) == 2
    assert scope["predicted"].shape == (64,) and set(scope["predicted"].tolist()) <= {0, 1, 2, 3}
    assert all(s.basis.shape[1] > 0 for s in scope["trainer"].subspaces.values())
