"""FiX kernel paths (issue 15): the fused flash-kernel path for keys before a super-block and the plain-matmul
fallback both equal the float64 reference (outputs and gradients, odd T, several super-blocks, d != dv, a decode
prefix, strong gates, bfloat16 inputs); the one-token decode step equals the full forward and rejects bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import icml26.methods.fix_attention.chunked as chunked
from icml26.core.testing import assert_close, tiny_tensor
from icml26.methods.fix_attention import fix_attention_chunked
from icml26.methods.fix_attention.chunked import fix_decode_step
from icml26.methods.fix_attention.reference import fix_attention_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def _gates(shape, *, seed: int = 9, strength: float = 1.0, dtype=torch.float64, grad: bool = False):
    logits = tiny_tensor(*shape, seed=seed, dtype=torch.float64) * 3.0 + 1.0
    return (F.logsigmoid(logits) * strength).to(dtype).requires_grad_(grad)


@pytest.fixture(params=[True, False], ids=["fused", "matmul"])
def fused(request, monkeypatch):
    monkeypatch.setattr(chunked, "FUSED_EARLY", request.param)
    return request.param


@pytest.mark.parametrize("t,d,dv,rows", [(101, 8, 8, 16), (77, 6, 10, 8)])
def test_paths_equal_reference_outputs_and_gradients(fused, t, d, dv, rows):
    q, k = (tiny_tensor(2, 2, t, d, seed=s, dtype=torch.float64, requires_grad=True) for s in (1, 2))
    v = tiny_tensor(2, 2, t, dv, seed=3, dtype=torch.float64, requires_grad=True)
    log_f = _gates((2, 2, t, dv), grad=True)
    ref = fix_attention_reference(q, k, v, log_f)
    out = fix_attention_chunked(q, k, v, log_f, chunk_size=4, max_block_rows=rows)
    assert_close("u", ref, out, 1e-12)
    probe = tiny_tensor(*out.shape, seed=7, dtype=out.dtype)
    for name, a, b in zip(("dq", "dk", "dv", "dlog_f"), torch.autograd.grad(ref, (q, k, v, log_f), probe),
                          torch.autograd.grad(out, (q, k, v, log_f), probe)):
        assert_close(name, a, b, 1e-10)


def test_paths_gradcheck_with_decode_prefix(fused):
    q, k, v = (tiny_tensor(1, 2, 9, 3, seed=s, dtype=torch.float64, requires_grad=True) for s in (1, 2, 3))
    log_f = _gates((1, 2, 9, 3), grad=True)
    prefix_k, prefix_v = (tiny_tensor(1, 2, 4, 3, seed=s, dtype=torch.float64, requires_grad=True) for s in (20, 21))
    fn = lambda *a: fix_attention_chunked(*a[:4], prefix_k=a[4], prefix_v=a[5], chunk_size=2,  # noqa: E731
                                          max_block_rows=4)
    assert torch.autograd.gradcheck(fn, (q, k, v, log_f, prefix_k, prefix_v))


def test_paths_float32_strong_gates_and_bfloat16(fused):
    q, k, v = (tiny_tensor(1, 2, 301, 16, seed=s, dtype=torch.float64) for s in (4, 5, 6))
    log_f = _gates((1, 2, 301, 16), strength=4.0)
    ref = fix_attention_reference(q, k, v, log_f)
    out32 = fix_attention_chunked(q.float(), k.float(), v.float(), log_f.float(), max_block_rows=64)
    assert out32.dtype == torch.float32
    assert_close("u float32", ref, out32, 2e-6)
    bf = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    out16 = fix_attention_chunked(*bf, log_f.float(), max_block_rows=64)
    assert out16.dtype == torch.bfloat16
    ref16 = fix_attention_reference(*(x.detach().double() for x in bf), log_f)
    assert (out16.double() - ref16).abs().max() < 3e-2
    out16.float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all() for x in bf)


def test_fused_and_matmul_paths_agree_in_float32(monkeypatch):
    q, k, v = (tiny_tensor(1, 3, 300, 32, seed=s, requires_grad=True) for s in (1, 2, 3))
    log_f = _gates((1, 3, 300, 32), dtype=torch.float32, grad=True)
    results = []
    for flag in (True, False):
        monkeypatch.setattr(chunked, "FUSED_EARLY", flag)
        out = fix_attention_chunked(q, k, v, log_f, max_block_rows=64)
        results.append((out, *torch.autograd.grad(out, (q, k, v, log_f), torch.ones_like(out))))
    for name, a, b in zip(("u", "dq", "dk", "dv", "dlog_f"), *results):
        assert_close(name, a, b, 1e-5)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_decode_step_equals_full_forward(grad):
    t, d = 12, 4
    q, k, v = (tiny_tensor(2, 2, t, d, seed=s, dtype=torch.float64) for s in (1, 2, 3))
    log_f = _gates((2, 2, t, d))
    full = fix_attention_chunked(q, k, v, log_f)
    _, state = fix_attention_chunked(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], log_f[:, :, :-1], return_state=True)
    last = slice(t - 1, t)
    with torch.set_grad_enabled(grad):
        inputs = [x[:, :, last].clone().requires_grad_(grad) for x in (q, k, v, log_f)]
        u, keys, cache_v = fix_decode_step(*inputs, k[:, :, :-1], state)
    assert_close("u", full[:, :, -1:], u, 1e-12)
    assert_close("keys", k, keys, 0.0)
    _, full_state = fix_attention_chunked(q, k, v, log_f, return_state=True)
    assert_close("state", full_state, cache_v, 1e-12)


def test_decode_step_rejects_more_than_one_token():
    q, k, v = (tiny_tensor(1, 1, 2, 4, seed=s) for s in (1, 2, 3))
    prefix = tiny_tensor(1, 1, 3, 4, seed=4)
    with pytest.raises(ValueError, match="one new token"):
        fix_decode_step(q, k, v, torch.zeros(1, 1, 2, 4), prefix, prefix)
