"""FedDTL room: the FedMaPLe-style baseline (MaPLe's multi-modal prompts, averaged)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from icml26.methods.feddtl.baselines import MultiModalPrompts, class_names, initial_context, run_fedmaple
from icml26.methods.feddtl.config import EncoderConfig, FedDTLConfig
from icml26.methods.feddtl.data import make_task, render_compositional
from icml26.methods.feddtl.model import pretrain

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = EncoderConfig(width=16, embed_dim=16, vision_layers=3, text_layers=2, heads=2, steps=10, batch_size=32,
                     per_class=2, use_mnist=False)


@pytest.fixture(scope="module")
def encoder():
    return pretrain(TINY, seed=0)


@pytest.fixture(scope="module")
def task():
    return make_task(0, n_base=4, n_novel=3, num_clients=3, train_per_class=8, val_per_class=2, test_per_class=4)


def _prompts(encoder, depth=2, seed=0):
    torch.manual_seed(seed)
    p = MultiModalPrompts(initial_context(encoder), TINY.width, depth)
    with torch.no_grad():  # move every prompt off its initial value so that no part is trivially zero
        for c in p.ctx:
            c.add_(0.3 * torch.randn_like(c))
        for layer in p.couple:
            layer.weight.add_(0.3 * torch.randn_like(layer.weight))
            layer.bias.add_(0.1 * torch.randn_like(layer.bias))
    return p


def _slow_image(encoder, prompts, images):
    """Per image, tokens assembled by index assignment (not concatenation): [CLS], patches, then n_ctx prompt
    slots overwritten with F_j(t_j) before block j < depth."""
    tower, n_ctx = encoder.vision, len(prompts.ctx[0])
    out = []
    for img in images:
        patches = F.unfold(img[None], kernel_size=tower.patch, stride=tower.patch)[0].T
        n_tok = 1 + len(patches)
        x = torch.zeros(1, n_tok + n_ctx, tower.pos.shape[-1])
        x[0, 0] = tower.cls[0, 0] + tower.pos[0, 0]
        x[0, 1:n_tok] = tower.embed(patches) + tower.pos[0, 1:]
        for j, block in enumerate(tower.blocks):
            if j < prompts.depth:
                x = x.clone()
                x[0, n_tok:] = prompts.couple[j](prompts.ctx[j])
            x = block(x)
        out.append(F.normalize(tower.head(tower.ln(x[0, 0])), dim=-1))
    return torch.stack(out)


def test_text_prompts_at_the_template_are_the_zero_shot_prompts(encoder, task):
    names = class_names(task.prompts)
    with torch.no_grad():
        shallow = MultiModalPrompts(initial_context(encoder), TINY.width, depth=1)
        assert torch.allclose(shallow.text_embeddings(encoder, names), encoder.encode_text(task.prompts), atol=1e-5)
        deep = _prompts(encoder, depth=2)
        e = deep.text_embeddings(encoder, names)
        deep.ctx[1].add_(torch.randn_like(deep.ctx[1]))  # the deep prompt replaces block 1's context positions
        assert not torch.allclose(e, deep.text_embeddings(encoder, names), atol=1e-4)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_vision_prompts_match_a_per_image_reference_with_gradients(encoder, depth):
    x = render_compositional(torch.tensor([0, 50, 107]), style="shifted", generator=torch.Generator().manual_seed(2))
    fast, slow = _prompts(encoder, depth), _prompts(encoder, depth)
    a, b = fast.encode_image(encoder, x), _slow_image(encoder, slow, x)
    assert torch.allclose(a, b, atol=1e-5)
    w = torch.randn_like(a)
    (a * w).sum().backward()
    (b * w).sum().backward()
    for (name, p), q in zip(fast.named_parameters(), slow.parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name


def test_fedmaple_trains_averages_and_reports_its_own_accuracy(encoder, task):
    cfg = FedDTLConfig(rounds=2, sft_rounds=1, sft_epochs=1, rl_epochs=1, batch_size=16, lr=1e-2)
    out = run_fedmaple(encoder, task, cfg, seed=0)
    start = MultiModalPrompts(initial_context(encoder), TINY.width, 2)
    assert not torch.allclose(out["prompts"].ctx[0], start.ctx[0])
    assert not any(p.requires_grad for p in encoder.parameters())              # towers stay frozen
    with torch.no_grad():
        emb = out["prompts"].text_embeddings(encoder, class_names(task.prompts))
        pred = (out["prompts"].encode_image(encoder, task.test_base_x) @ emb[: task.n_base].T).argmax(-1)
    assert out["final"]["base_accuracy"] == pytest.approx(float((pred == task.test_base_y).float().mean()))
    again = run_fedmaple(encoder, task, cfg, seed=0)
    assert again["final"] == out["final"]
