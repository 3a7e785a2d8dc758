"""Tests for the TinyLM testbed: shapes, loss, causality, KV cache, plug-in contracts, validation, training."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from icml26.models.tiny_lm import CausalSelfAttention, PlainResidual, TinyLM, TinyLMConfig

SMALL = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)


def make_model(seed: int = 0, **overrides) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(TinyLMConfig(**{**SMALL, **overrides})).eval()


def tokens(b: int, t: int, vocab: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_loss_matches_cross_entropy():
    model = make_model()
    idx, targets = tokens(3, 10), tokens(3, 10, seed=2)
    logits, loss = model(idx)
    assert logits.shape == (3, 10, 32) and loss is None
    logits, loss = model(idx, targets)
    expected = -logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1)))


def test_causality():
    model = make_model()
    idx = tokens(2, 16)
    logits, _ = model(idx)
    for t in (0, 5, 14):
        changed = idx.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 7) % 32
        logits2, _ = model(changed)
        torch.testing.assert_close(logits2[:, : t + 1], logits[:, : t + 1], atol=1e-6, rtol=0)
        assert not torch.allclose(logits2[:, t + 1 :], logits[:, t + 1 :])


def test_kv_cache_matches_full_forward():
    model = make_model()
    idx = tokens(2, 20)
    full, _ = model(idx)
    cache = model.new_cache()
    # Prefill 6, single steps, then a 4-token chunk (needs the offset mask), then single steps again.
    chunks = [(0, 6)] + [(i, i + 1) for i in range(6, 10)] + [(10, 14)] + [(i, i + 1) for i in range(14, 20)]
    for start, stop in chunks:
        step, _ = model(idx[:, start:stop], cache=cache)
        torch.testing.assert_close(step, full[:, start:stop], atol=1e-5, rtol=0)
    assert cache[0]["k"].shape == (2, 4, 20, 8)


def test_greedy_generate_with_and_without_cache_agree():
    model = make_model()
    prompt = tokens(2, 5)
    cached = model.generate(prompt, 12, temperature=0.0)
    uncached = model.generate(prompt, 12, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 17)
    assert torch.equal(cached[:, :5], prompt)
    assert torch.equal(cached, uncached)


def test_sampling_is_deterministic_and_top_k_restricts():
    model = make_model()
    prompt = tokens(4, 3)
    a = model.generate(prompt, 8, generator=torch.Generator().manual_seed(5))
    b = model.generate(prompt, 8, generator=torch.Generator().manual_seed(5))
    c = model.generate(prompt, 8, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # top_k=1 sampling is greedy decoding.
    top1 = model.generate(prompt, 8, top_k=1, generator=torch.Generator().manual_seed(7))
    assert torch.equal(top1, model.generate(prompt, 8, temperature=0.0))


def test_same_seed_same_model():
    a, b = make_model(seed=3), make_model(seed=3)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    idx = tokens(2, 8)
    assert torch.equal(a(idx)[0], b(idx)[0])
    assert not torch.equal(make_model(seed=4).tok_emb.weight, a.tok_emb.weight)


def test_custom_attention_factory_is_used():
    calls: list[tuple[int, tuple[int, ...], bool]] = []

    class Recording(CausalSelfAttention):
        def forward(self, x, cache=None):
            calls.append((self.layer_idx, tuple(x.shape), cache is not None))
            return super().forward(x, cache=cache)

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(**SMALL), attention_factory=Recording)
    model(tokens(2, 7))
    assert calls == [(0, (2, 7, 32), False), (1, (2, 7, 32), False)]
    calls.clear()
    model.generate(tokens(1, 4), 3, temperature=0.0)
    assert [c[1][1] for c in calls] == [4, 4, 1, 1, 1, 1] and all(c[2] for c in calls)


class TwoStreamResidual(nn.Module):
    """Two residual streams (B, T, 2, D); branches read the mean and write to stream 0; reduce averages."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.tensor(0.5))
        self.wrapped: list[tuple[int, str]] = []
        self.reduced_shapes: list[tuple[int, ...]] = []

    def expand(self, x):
        return torch.stack((x, x), dim=2)

    def reduce(self, stream):
        self.reduced_shapes.append(tuple(stream.shape))
        return self.mix * stream[:, :, 0] + (1 - self.mix) * stream[:, :, 1]

    def wrap(self, branch, layer_idx, kind):
        self.wrapped.append((layer_idx, kind))
        return _TwoStreamBranch(branch)


class _TwoStreamBranch(nn.Module):
    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.branch = branch

    def forward(self, stream, **kw):
        out = self.branch(stream.mean(dim=2), **kw)
        return stream + torch.stack((out, torch.zeros_like(out)), dim=2)


def test_custom_residual_is_used_and_cache_passes_through():
    residual = TwoStreamResidual()
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(**SMALL), residual=residual).eval()
    assert residual.wrapped == [(0, "attn"), (0, "mlp"), (1, "attn"), (1, "mlp")]
    assert model.num_parameters() == make_model().num_parameters() + 1  # the registered mixing scalar
    idx = tokens(2, 9)
    full, _ = model(idx)
    assert residual.reduced_shapes == [(2, 9, 2, 32)]
    cache = model.new_cache()
    prefill, _ = model(idx[:, :5], cache=cache)
    rest = [model(idx[:, t : t + 1], cache=cache)[0] for t in range(5, 9)]
    torch.testing.assert_close(torch.cat([prefill, *rest], dim=1), full, atol=1e-5, rtol=0)
    assert cache[1]["k"].shape[2] == 9


def test_plain_residual_is_identity_plus_branch():
    residual, branch = PlainResidual(), nn.Linear(4, 4)
    x = torch.randn(2, 3, 4)
    assert residual.expand(x) is x and residual.reduce(x) is x
    torch.testing.assert_close(residual.wrap(branch, 0, "mlp")(x), x + branch(x))


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_matches_formula(tie):
    cfg = TinyLMConfig(tie_embeddings=tie)
    v, d, layers, h = cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.hidden_dim
    assert h == 352  # 8/3 * 128 = 341.3, nearest multiple of 32
    per_layer = 4 * d * d + 3 * d * h + 2 * d  # qkv + out, gate/up/down, two norms
    expected = v * d * (1 if tie else 2) + layers * per_layer + d
    model = TinyLM(cfg)
    assert model.num_parameters() == expected
    assert (model.lm_head.weight is model.tok_emb.weight) == tie


def test_init_scales_output_projections():
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(n_layers=8))
    attn, mlp = model.blocks[0].attn.branch.fn, model.blocks[0].mlp.branch.fn
    out_std = 0.02 / math.sqrt(16)
    assert attn.qkv_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert attn.out_proj.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert mlp.down_proj.weight.std().item() == pytest.approx(out_std, rel=0.05)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("vocab_size", dict(vocab_size=0)),
        ("d_model", dict(d_model=-8)),
        ("n_layers", dict(n_layers=0)),
        ("n_heads", dict(n_heads=3)),
        ("head_dim", dict(d_model=36, n_heads=4)),
        ("max_seq_len", dict(max_seq_len=0)),
        ("mlp_hidden", dict(mlp_hidden=0)),
        ("rope_base", dict(rope_base=0.0)),
        ("norm_eps", dict(norm_eps=-1e-6)),
    ],
)
def test_config_validation_mentions_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        TinyLMConfig(**kwargs)


def test_input_validation():
    model = make_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(1, 65))
    with pytest.raises(ValueError, match="long"):
        model(tokens(1, 4).int())
    with pytest.raises(ValueError, match="2-D"):
        model(tokens(1, 4)[0])
    cache = model.new_cache()
    model(tokens(1, 60), cache=cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(1, 5), cache=cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(tokens(1, 60), 10)


def test_training_reduces_loss_on_fixed_batch():
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig())
    data = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    _, first = model(x, y)
    assert first.item() == pytest.approx(math.log(256), abs=0.1)  # small init -> near-uniform predictions
    for _ in range(30):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
    assert model(x, y)[1].item() < 0.5 * first.item()
