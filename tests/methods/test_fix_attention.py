"""FiX / FoX: fast paths == O(T^2) reference (outputs and gradients), decode == full forward, the reductions
(tied gates -> RMSNorm(FoX), gates at 1 -> RMSNorm(softmax), FoX without gate -> softmax), causality, overflow
safety with strong gates up to T = 16384, and config validation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from icml26.core.testing import assert_close, tiny_tensor, tiny_tokens
from icml26.methods.fix_attention import (FiXAttention, FixConfig, FoXAttention, attention_factory, build_tiny_lm,
                                          fix_attention_chunked, fox_attention_chunked)
from icml26.methods.fix_attention.reference import (fix_attention_reference, fox_attention_reference,
                                                    head_rms_norm, softmax_attention_reference)
from icml26.models.tiny_lm import CausalSelfAttention, TinyLM, TinyLMConfig

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=96)


pytestmark = pytest.mark.usefixtures("one_thread")


def _qkv(b: int, h: int, t: int, d: int, *, seed: int = 0, dtype=torch.float64, grad: bool = False):
    return [tiny_tensor(b, h, t, d, seed=seed + i, dtype=dtype, requires_grad=grad) for i in range(3)]


def _log_gates(shape, *, seed: int = 9, strength: float = 1.0, dtype=torch.float64, grad: bool = False):
    """log f <= 0 spanning weak and strong forgetting: logsigmoid of N(1, 3^2) logits, times ``strength``."""
    logits = tiny_tensor(*shape, seed=seed, dtype=torch.float64) * 3.0 + 1.0
    out = (F.logsigmoid(logits) * strength).to(dtype)
    return out.requires_grad_(grad)


def _grads(out: torch.Tensor, inputs, seed: int = 7):
    probe = tiny_tensor(*out.shape, seed=seed, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, probe)


# ---------------------------------------------------------------------------------------------------- kernels
# (T, leaf, score budget, rows cap): one super-block, budget-limited ones, the default 256-row cap (two blocks at
# T = 500) and one tall 512-row block.
@pytest.mark.parametrize("t,chunk,budget,rows", [(63, 4, 1 << 20, 256), (63, 7, 300, 256), (63, 1, 1 << 20, 256),
                                                 (500, 4, 20_000, 256), (500, 4, 1 << 20, 256),
                                                 (500, 16, 1 << 20, 1024)])
@pytest.mark.parametrize("tied", [False, True], ids=["per_channel", "tied"])
def test_fix_chunked_equals_reference_outputs_and_gradients(t, chunk, budget, rows, tied):
    b, h, d = (1, 2, 8) if t == 500 else (2, 3, 8)
    q, k, v = _qkv(b, h, t, d, grad=True)
    log_f = _log_gates((b, h, t, 1 if tied else d), grad=True)
    ref = fix_attention_reference(q, k, v, log_f)
    out = fix_attention_chunked(q, k, v, log_f, chunk_size=chunk, max_block_scores=budget, max_block_rows=rows)
    assert_close("u", ref, out, 1e-12)
    for name, g_ref, g_out in zip(("dq", "dk", "dv", "dlog_f"), _grads(ref, (q, k, v, log_f)),
                                  _grads(out, (q, k, v, log_f))):
        assert_close(name, g_ref, g_out, 1e-10)


def test_fix_chunked_float32_matches_float64_reference_with_strong_gates():
    q, k, v = _qkv(2, 2, 257, 16, seed=3)
    log_f = _log_gates((2, 2, 257, 16), strength=4.0)
    ref = fix_attention_reference(q, k, v, log_f)
    out = fix_attention_chunked(q.float(), k.float(), v.float(), log_f.float())
    assert out.dtype == torch.float32
    assert_close("u float32", ref, out, 2e-6)


def test_fix_gradcheck_with_decode_prefix():
    q, k, v = _qkv(1, 1, 7, 2, grad=True)
    log_f = _log_gates((1, 1, 7, 2), grad=True)
    prefix_k, prefix_v = (tiny_tensor(1, 1, 3, 2, seed=s, dtype=torch.float64, requires_grad=True) for s in (20, 21))
    # Leaves of 2 and super-blocks of 2 rows: leaves, one tree level, earlier keys and the prefix all take part.
    fn = lambda *a: fix_attention_chunked(*a[:4], prefix_k=a[4], prefix_v=a[5], chunk_size=2,  # noqa: E731
                                          max_block_scores=20)
    assert torch.autograd.gradcheck(fn, (q, k, v, log_f, prefix_k, prefix_v))


def test_fix_prefill_then_decode_equals_one_pass():
    q, k, v = _qkv(2, 2, 40, 8)
    log_f = _log_gates((2, 2, 40, 8), strength=2.0)
    full, full_state = fix_attention_chunked(q, k, v, log_f, return_state=True)
    out, state = fix_attention_chunked(q[:, :, :17], k[:, :, :17], v[:, :, :17], log_f[:, :, :17], return_state=True)
    outs = [out]
    for s, e in [(17, 18), (18, 25), (25, 26), (26, 40)]:
        out, state = fix_attention_chunked(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], log_f[:, :, s:e],
                                           prefix_k=k[:, :, :s], prefix_v=state, return_state=True)
        outs.append(out)
    assert_close("prefill + decode", full, torch.cat(outs, dim=2), 1e-12)
    # The value cache holds exp(Lambda_last - Lambda_j) v_j, the same count of numbers as a plain V cache.
    lam = log_f.cumsum(2)
    assert_close("pre-decayed values", (lam[:, :, -1:] - lam).exp() * v, state, 1e-12)
    assert_close("state", full_state, state, 1e-12)


def test_naive_factorised_form_overflows_where_the_kernel_does_not():
    """exp(Lambda_i) (.) Attn(q, K, exp(-Lambda) (.) V) is the textbook rewrite; it overflows in float32."""
    q, k, v = _qkv(1, 1, 512, 8, seed=5, dtype=torch.float32)
    log_f = _log_gates((1, 1, 512, 8), strength=2.0, dtype=torch.float32)
    lam = log_f.cumsum(2)
    naive = lam.exp() * softmax_attention_reference(q, k, (-lam).exp() * v)
    assert not torch.isfinite(naive).all()
    out = fix_attention_chunked(q, k, v, log_f)
    assert_close("u", fix_attention_reference(q.double(), k.double(), v.double(), log_f.double()), out, 2e-6)


@pytest.mark.parametrize("rows", [256, 1024], ids=["four_blocks", "one_block"])
def test_fix_float32_keeps_precision_when_strong_gates_precede_weak_ones(rows):
    """Strong forgetting early makes |Lambda| large; later weak gates give decays that are small differences of two
    large prefix sums. Those must not lose float32 digits: the kernel builds them from local sums."""
    t, d = 1024, 8
    q, k, v = _qkv(1, 2, t, d, seed=11)
    log_f = torch.full((1, 2, t, d), -1e-3, dtype=torch.float64)
    log_f[:, :, :300] = -30.0
    ref = fix_attention_reference(q, k, v, log_f)
    out = fix_attention_chunked(q.float(), k.float(), v.float(), log_f.float(), max_block_rows=rows)
    assert_close("u float32", ref, out, 2e-6)
    # The textbook float32 form (differences of float32 prefix sums) is measurably worse: the test can tell.
    naive = fix_attention_reference(q.float(), k.float(), v.float(), log_f.float())
    assert (naive.double() - ref).pow(2).mean().sqrt() > 10 * (out.double() - ref).pow(2).mean().sqrt()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fix_strong_gates_long_sequence_stays_finite_and_exact(dtype):
    """log f down to -60 per token over T = 16384, half the channels never forgetting (long-range terms)."""
    t, d = 16384, 8
    q, k, v = (x.to(dtype) for x in _qkv(1, 1, t, d, seed=5, dtype=torch.float32))
    log_f = _log_gates((1, 1, t, d), strength=20.0, dtype=torch.float32)
    log_f[..., : d // 2] = 0.0
    with torch.no_grad():
        out = fix_attention_chunked(q, k, v, log_f, max_block_scores=1 << 22)
    assert out.dtype == dtype and torch.isfinite(out).all()
    rows = torch.tensor([0, 1, 777, 8191, 12000, t - 1])
    ref = fix_attention_reference(q.double(), k.double(), v.double(), log_f.double(), rows=rows)
    assert_close(f"u rows {dtype}", ref, out[:, :, rows], 1e-5 if dtype == torch.float32 else 1e-2)


def test_fox_kernel_equals_reference_with_cache_offset():
    q, k, v = _qkv(2, 3, 63, 8, grad=True)
    log_f = _log_gates((2, 3, 63), grad=True)
    ref = fox_attention_reference(q, k, v, log_f)
    out = fox_attention_chunked(q, k, v, log_f)
    assert_close("fox", ref, out, 1e-12)
    for name, g_ref, g_out in zip(("dq", "dk", "dv", "dlog_f"), _grads(ref, (q, k, v, log_f)),
                                  _grads(out, (q, k, v, log_f))):
        assert_close(name, g_ref, g_out, 1e-10)
    assert_close("fox last 5 queries", ref[:, :, -5:], fox_attention_chunked(q[:, :, -5:], k, v, log_f), 1e-12)


def test_fix_with_channel_tied_gates_is_rmsnorm_of_fox():
    q, k, v = _qkv(2, 2, 63, 8)
    log_f = _log_gates((2, 2, 63))
    eps = 1e-30     # RMSNorm(c u) = RMSNorm(u) for c > 0 holds up to eps / mean(u^2)
    fix = head_rms_norm(fix_attention_chunked(q, k, v, log_f.unsqueeze(-1)), None, eps)
    fox = head_rms_norm(fox_attention_reference(q, k, v, log_f), None, eps)
    assert_close("RMSNorm(FoX)", fox, fix, 1e-10)


def test_fix_with_gates_at_one_is_rmsnorm_of_softmax_attention():
    q, k, v = _qkv(2, 2, 63, 8)
    zero = torch.zeros(2, 2, 63, 8, dtype=torch.float64)
    assert_close("softmax", F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 fix_attention_chunked(q, k, v, zero), 1e-12)
    assert_close("softmax (reference)", softmax_attention_reference(q, k, v), fix_attention_reference(q, k, v, zero),
                 1e-12)


# ----------------------------------------------------------------------------------------------------- layers
def _copy_qkv_out(src, dst) -> None:
    dst.qkv_proj.weight.data.copy_(src.qkv_proj.weight.data)
    dst.out_proj.weight.data.copy_(src.out_proj.weight.data)


def test_layer_with_tied_sigmoid_gates_equals_fox_with_rope_and_output_norm():
    torch.manual_seed(0)
    kw = dict(max_seq_len=64, norm_eps=1e-30, rope=True)   # RMSNorm(c u) = RMSNorm(u) up to eps / mean(u^2)
    fox = FoXAttention(32, 4, fox_output_norm=True, **kw).double()
    fix = FiXAttention(32, 4, gate_form="sigmoid", gate_granularity="head", gate_rank=0, gate_temperature=1.0,
                       **kw).double()
    _copy_qkv_out(fox, fix)
    fix.gate_proj.weight.data.copy_(fox.fgate_proj.weight.data)
    fix.gate_bias.data.copy_(tiny_tensor(4, seed=3, dtype=torch.float64))
    fox.fgate_proj.bias.data.copy_(fix.gate_bias.data)
    x = tiny_tensor(2, 50, 32, seed=1, dtype=torch.float64)
    assert_close("FiX(tied) == RMSNorm(FoX)", fox(x), fix(x), 1e-10)


def test_layer_with_gates_at_one_equals_rmsnorm_of_softmax_rope():
    torch.manual_seed(0)
    tiny = TinyLMConfig(**TINY)
    softmax = CausalSelfAttention(tiny, 0).double()
    fix = FiXAttention(32, 4, gate_form="none", max_seq_len=96, norm_eps=1e-6).double()
    _copy_qkv_out(softmax, fix)
    x = tiny_tensor(2, 40, 32, seed=2, dtype=torch.float64)
    # Run softmax attention without its output projection, normalise per head, then project.
    hook = {}
    softmax.out_proj.register_forward_hook(lambda m, inp, out: hook.update(y=inp[0]))
    softmax(x)
    y = hook["y"].view(2, 40, 4, 8).transpose(1, 2)
    expected = softmax.out_proj(head_rms_norm(y, None, 1e-6).transpose(1, 2).reshape(2, 40, 32))
    assert_close("FiX(f=1) == RMSNorm(softmax)", expected, fix(x), 1e-10)


def test_fox_without_forget_gate_is_softmax_attention():
    torch.manual_seed(0)
    tiny = TinyLMConfig(**TINY)
    softmax = CausalSelfAttention(tiny, 0).double()
    fox = FoXAttention(32, 4, fgate_type="none", rope=True, max_seq_len=96).double()
    _copy_qkv_out(softmax, fox)
    x = tiny_tensor(2, 40, 32, seed=2, dtype=torch.float64)
    assert_close("FoX(f=1) == softmax", softmax(x), fox(x), 1e-12)


def _lm(attention: str, **options) -> TinyLM:
    torch.manual_seed(0)
    return build_tiny_lm(TinyLMConfig(**TINY), attention=attention, **options).double().eval()


@pytest.mark.parametrize("attention", ["fix", "fox"])
def test_decode_token_by_token_equals_full_forward(attention):
    model = _lm(attention, gate_form="sigmoid", gate_temperature=0.5) if attention == "fix" else _lm(attention)
    idx = tiny_tokens(2, 45, 64, seed=4)
    full, _ = model(idx)
    cache = model.new_cache()
    chunks = [(0, 9)] + [(i, i + 1) for i in range(9, 30)] + [(30, 37)] + [(i, i + 1) for i in range(37, 45)]
    for s, e in chunks:
        step, _ = model(idx[:, s:e], cache=cache)
        assert_close(f"{attention} decode [{s}:{e}]", full[:, s:e], step, 1e-10)
    softmax_model = _lm("softmax")
    softmax_cache = softmax_model.new_cache()
    softmax_model(idx, cache=softmax_cache)
    plain = sum(t.numel() * t.element_size() for t in softmax_cache[0].values())
    kv = sum(cache[0][key].numel() * cache[0][key].element_size() for key in ("k", "v"))
    assert kv == plain, "FiX/FoX keys and values cost exactly what a plain KV cache costs"
    extra = set(cache[0]) - {"k", "v"}
    assert extra == (set() if attention == "fix" else {"log_f"})   # FoX: one float per head and token
    assert torch.equal(model.generate(idx[:, :5], 8, temperature=0),
                       model.generate(idx[:, :5], 8, temperature=0, use_cache=False))


@pytest.mark.parametrize("attention", ["fix", "fox"])
def test_future_tokens_never_change_past_outputs(attention):
    model = _lm(attention)
    idx = tiny_tokens(2, 40, 64, seed=5)
    logits, _ = model(idx)
    for t in (0, 13, 38):
        changed = idx.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 11) % 64
        logits2, _ = model(changed)
        assert torch.equal(logits2[:, : t + 1], logits[:, : t + 1])
        assert not torch.allclose(logits2[:, t + 1:], logits[:, t + 1:])


def test_gate_initialisation():
    torch.manual_seed(0)
    first = dict(gate_rank=16, gate_bottleneck_norm=False, a_init_range=(1.0, 16.0), output_norm_shared=False)
    fix = FiXAttention(64, 4, max_seq_len=32, **first)   # this room's first reconstruction
    x = F.rms_norm(torch.randn(2, 16, 64), (64,))
    f = fix.log_forget(x).exp()
    assert f.shape == (2, 4, 16, 16)
    # Mamba-style spectrum: A in [1, 16] and softplus(dt_bias) in [1e-3, 1e-1] give f in [exp(-1.6), exp(-1e-3)] at
    # g = 0; the small data-dependent g widens that a little.
    assert 0.1 < f.min() and f.max() < 1.0 and f.median() > 0.85
    # Official-kernel-benchmark defaults: rank ceil(64/16) = 4 with an RMSNorm bottleneck, A ~ U(0, 16], one
    # output-norm gain of size head_dim shared by the heads.
    bench = FiXAttention(64, 4, max_seq_len=32)
    assert bench.gate_down.weight.shape == (4, 64) and bench.bottleneck_norm
    assert bench.output_norm.weight.shape == (16,)
    a = bench.A_log.exp()
    assert 0 < a.min() and a.max() <= 16 and a.min() < 1.0   # 64 draws from U(0, 16]: some below Mamba's floor 1
    fb = bench.log_forget(x).exp()
    assert 0 < fb.min() and fb.max() < 1.0
    sig = FiXAttention(64, 4, max_seq_len=32, gate_form="sigmoid", **first).log_forget(x).exp()
    assert torch.allclose(sig, torch.full_like(sig, 0.5 ** (1 / 16)), atol=2e-2)   # logsigmoid(~0) / 16
    fox = FoXAttention(64, 4, fgate_type="bias_only", decay_time_min=2.0, decay_time_max=64.0)
    log_f = fox.log_forget(x)[0, :, 0]
    assert_close("-1/tau", -1.0 / torch.exp(torch.linspace(math.log(2.0), math.log(64.0), 4)), log_f, 1e-6)
    assert isinstance(fox.fgate_bias, torch.nn.Parameter)


def test_bfloat16_layer_runs_and_matches_float32():
    torch.manual_seed(0)
    layer = FiXAttention(32, 4, max_seq_len=64)
    x = tiny_tensor(2, 33, 32, seed=3)
    ref = layer(x)
    out = layer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert_close("bf16", ref, out, 3e-2)


def test_attention_factory_builds_each_kind_and_rejects_bad_options():
    tiny = TinyLMConfig(**TINY)
    kinds = {"softmax": CausalSelfAttention, "fox": FoXAttention, "fix": FiXAttention}
    for name, cls in kinds.items():
        assert isinstance(attention_factory(attention=name)(tiny, 1), cls)
    with pytest.raises(ValueError, match="rope"):
        attention_factory(attention="softmax", rope=False)
    with pytest.raises(TypeError, match="gate_rnk"):
        FiXAttention(32, 4, gate_rnk=3)


@pytest.mark.parametrize("field,value", [
    ("attention", "linear"), ("gate_form", "exp"), ("gate_granularity", "row"), ("gate_rank", -1),
    ("gate_rank", 2.5), ("gate_temperature", 0.0), ("norm_eps", 0.0), ("norm_eps", 2.0), ("chunk_size", 0),
    ("a_init_range", (16.0, 1.0)), ("dt_init_range", (0.0, 0.1)), ("fgate_type", "maybe"), ("rope", "yes"),
    ("rope_base", -1.0), ("output_gate", 1), ("decay_time_min", 2.0),
])
def test_bad_config_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field.split("_range")[0]):
        FixConfig(**{field: value})


def test_fixed_fox_gate_needs_decay_times():
    with pytest.raises(ValueError, match="decay_time_min"):
        FixConfig(attention="fox", fgate_type="fixed")
    FixConfig(attention="fox", fgate_type="fixed", decay_time_min=1.0, decay_time_max=100.0)


# ---------------------------------------------------------------------------------------------- new gate options
def test_token_gates_in_layer_zero_follow_the_token_ids():
    torch.manual_seed(0)
    model = build_tiny_lm(TinyLMConfig(**{**TINY, "max_seq_len": 40}), attention="fix")
    layers = [m for m in model.modules() if isinstance(m, FiXAttention)]
    assert layers[0].token_gates and layers[0].gate_embed is not None and layers[0].gate_down is None
    assert all(not layer.token_gates and layer.gate_down is not None for layer in layers[1:])
    ids = tiny_tokens(2, 12, vocab=TINY["vocab_size"], seed=5)
    model(ids)
    assert torch.equal(layers[0].token_ids, ids)
    # Same token, same layer-0 gate, whatever the hidden state: the gate is a function of the id alone.
    x = torch.randn(2, 12, TINY["d_model"])
    g1 = layers[0].log_forget(x)
    g2 = layers[0].log_forget(torch.randn(2, 12, TINY["d_model"]))
    assert torch.equal(g1, g2)
    standalone = FiXAttention(32, 4, max_seq_len=16)             # no host model, no ids: hidden-state gates
    assert not standalone.token_gates and standalone.gate_down is not None


def test_fox_qk_norm_uses_the_official_layer_norm_eps():
    layer = FoXAttention(32, 4, qk_norm=True)
    assert layer.q_norm.eps == 1e-5 and layer.k_norm.eps == 1e-5
    assert FoXAttention(32, 4, qk_norm=True, norm_eps=1e-6, fox_output_norm=True).output_norm.eps == 1e-6


def test_gate_strength_may_start_at_zero_and_rank_defaults_to_d_over_16():
    assert FixConfig(a_init_range=(0.0, 16.0)).a_init_range == (0.0, 16.0)
    with pytest.raises(ValueError, match="dt_init_range"):
        FixConfig(dt_init_range=(0.0, 0.1))
    assert FixConfig().rank_for(64) == 4 and FixConfig().rank_for(65) == 5 and FixConfig(gate_rank=0).rank_for(64) == 0


# ---------------------------------------------------------------------------------------------------- experiments
def _fixed_prepared(lr=3e-3):
    from icml26.methods.fix_attention.experiments import ARMS, DEFAULT_OPTION

    return {"tuning": {"lr": {"chosen": {a: lr for a in ARMS}, "on_edge": []},
                       "options": {"chosen": dict(DEFAULT_OPTION), "on_edge": []}}}


@pytest.mark.parametrize("index", [0, 1])
def test_null_arm_fix_switched_back_to_fox_fails_the_comparator(index):
    """The FiX slot trained as FoX (same option, lr, seed and batches): the statistic is exactly 0 and rejected."""
    from icml26.methods.fix_attention.experiments import SPECS

    spec = SPECS[index]
    result = spec.run(spec.tiers["smoke"], 0, _fixed_prepared(), method_as="fox")
    value = result["statistics"][spec.comparator.statistic]
    assert value == 0.0 and not spec.comparator.holds(value) and not spec.comparator.holds(spec.null_value)
    assert result["checks"]["fix_gate_channel_spread"] == 0.0        # and the mechanism check flags it


def test_claims_run_end_to_end_and_report_their_checks():
    from icml26.methods.fix_attention.experiments import SPECS

    for spec in SPECS:
        result = spec.run(spec.tiers["smoke"], 0, _fixed_prepared())
        assert math.isfinite(result["statistics"][spec.comparator.statistic])
        assert result["checks"]["param_gap"] <= 0.01 and result["checks"]["fix_gate_channel_spread"] > 0


def test_tuning_gives_both_arms_the_same_budget(monkeypatch):
    from icml26.methods.fix_attention import experiments

    calls = []
    monkeypatch.setattr(experiments, "_train", lambda key, seed, arm, option, lr, long: calls.append(
        (arm, option, lr, seed)) or {"val_loss": (math.log(lr) - math.log(3e-3)) ** 2 + len(option) * 1e-3})
    out = experiments.prepare(experiments.TIERS["smoke"])["tuning"]
    per_arm = {arm: sum(1 for c in calls if c[0] == arm) for arm in experiments.ARMS}
    assert per_arm["fix"] == per_arm["fox"] == 6 and all(c[3] >= 1000 for c in calls)
    assert out["lr"]["chosen"] == {"fix": 3e-3, "fox": 3e-3} and out["lr"]["on_edge"] == []
    assert set(out["options"]["chosen"]) == {"fix", "fox"}
