"""FiX kernel paths (issue 15): the fused flash-kernel path for keys before a super-block, the fused large tree
levels over chunked super-blocks, and the plain-matmul fallback (one chunk or several) all equal the float64
reference (outputs and gradients, odd T, one or several super-blocks, d != dv, a decode prefix, key masks, strong
gates, bfloat16 inputs); the one-token decode step equals the full forward and rejects bad input."""

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


# Module settings per path. The defaults fuse only levels of >= 256 positions and chunk super-blocks by 256 rows,
# which these small shapes never reach, so two paths shrink them: small fused levels inside and above chunks, and
# plain-matmul levels above several chunks.
PATHS = {"fused": {"FUSED_EARLY": True},
         "matmul": {"FUSED_EARLY": False},
         "fused-levels": {"FUSED_EARLY": True, "FUSED_LEVEL_MIN": 8, "CHUNK_ROWS": 16},
         "matmul-chunks": {"FUSED_EARLY": False, "CHUNK_ROWS": 8}}


@pytest.fixture(params=list(PATHS))
def fused(request, monkeypatch):
    for name, value in PATHS[request.param].items():
        monkeypatch.setattr(chunked, name, value)
    return request.param


@pytest.mark.parametrize("t,d,dv,rows", [(101, 8, 8, 16), (77, 6, 10, 8), (120, 8, 8, None), (128, 6, 10, None)])
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


@pytest.mark.parametrize("path", ["fused", "fused-levels", "matmul-chunks"])
@pytest.mark.parametrize("t,rows", [(300, 64), (256, None)])
def test_paths_agree_with_matmul_in_float32(monkeypatch, path, t, rows):
    q, k, v = (tiny_tensor(1, 3, t, 32, seed=s, requires_grad=True) for s in (1, 2, 3))
    log_f = _gates((1, 3, t, 32), dtype=torch.float32, grad=True)
    results = []
    for name in (path, "matmul"):
        for setting, value in {**PATHS["matmul-chunks"], "FUSED_LEVEL_MIN": 256, "CHUNK_ROWS": 256,
                               **PATHS[name]}.items():
            monkeypatch.setattr(chunked, setting, value)
        out = fix_attention_chunked(q, k, v, log_f, max_block_rows=rows)
        results.append((out, *torch.autograd.grad(out, (q, k, v, log_f), torch.ones_like(out))))
    for name, a, b in zip(("u", "dq", "dk", "dv", "dlog_f"), *results):
        assert_close(name, a, b, 1e-5)


def test_fused_levels_gradcheck_with_prefix_and_key_mask(monkeypatch):
    """Leaves of one position, chunks of two, every level above them fused, a decode prefix with a masked key."""
    for name, value in {"FUSED_EARLY": True, "FUSED_LEVEL_MIN": 2, "CHUNK_ROWS": 2}.items():
        monkeypatch.setattr(chunked, name, value)
    q, k, v = (tiny_tensor(1, 2, 8, 3, seed=s, dtype=torch.float64, requires_grad=True) for s in (1, 2, 3))
    log_f = _gates((1, 2, 8, 3), grad=True)
    prefix_k, prefix_v = (tiny_tensor(1, 2, 3, 3, seed=s, dtype=torch.float64, requires_grad=True) for s in (20, 21))
    key_mask = torch.ones(1, 11, dtype=torch.bool)
    key_mask[0, 1] = False
    fn = lambda *a: fix_attention_chunked(*a[:4], prefix_k=a[4], prefix_v=a[5], chunk_size=1,  # noqa: E731
                                          key_mask=key_mask)
    assert torch.autograd.gradcheck(fn, (q, k, v, log_f, prefix_k, prefix_v))


@pytest.mark.parametrize("n_pre", [0, 5])
def test_paths_with_key_mask_equal_reference(fused, n_pre):
    """Masked keys (a hole, right padding) with and without a decode prefix: outputs and gradients."""
    b, h, t, d = 2, 2, 64, 8
    total = n_pre + t
    q, k, v = (tiny_tensor(b, h, total, d, seed=s, dtype=torch.float64) for s in (1, 2, 3))
    key_mask = torch.ones(b, total, dtype=torch.bool)
    key_mask[0, n_pre + 10:n_pre + 13] = False
    key_mask[1, total - 2:] = False
    log_f = _gates((b, h, total, d)).masked_fill(~key_mask[:, None, :, None], 0.0)
    new = [x[:, :, n_pre:].clone().requires_grad_() for x in (q, k, v, log_f)]
    prefix = {}
    if n_pre:
        decay = (log_f[:, :, :n_pre].flip(2).cumsum(2).flip(2) - log_f[:, :, :n_pre]).exp()
        prefix = dict(prefix_k=k[:, :, :n_pre], prefix_v=v[:, :, :n_pre] * decay)
    out = fix_attention_chunked(*new, key_mask=key_mask, max_block_rows=None if n_pre else 32, **prefix)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, log_f)]
    ref = fix_attention_reference(*leaves, rows=torch.arange(n_pre, total), key_mask=key_mask)
    assert_close("u", ref, out, 1e-12)
    probe = tiny_tensor(*out.shape, seed=7, dtype=out.dtype)
    want = [g[:, :, n_pre:] for g in torch.autograd.grad(ref, leaves, probe)]
    for name, a, w in zip(("dq", "dk", "dv", "dlog_f"), torch.autograd.grad(out, new, probe), want):
        assert_close(name, w, a, 1e-10)


def test_plan_spans_the_sequence_only_with_fused_levels():
    """With fused large levels a power-of-two T is one super-block (no short, wide earlier-key calls); the plain
    path keeps ``MAX_BLOCK_ROWS``; padding stays within 1/8 of T."""
    assert chunked._plan(4096, 0, 4, chunked.MAX_BLOCK_SCORES, chunked.MAX_FUSED_ROWS, True) == 4096
    assert chunked._plan(4096, 0, 4, chunked.MAX_BLOCK_SCORES, chunked.MAX_BLOCK_ROWS, False) == 256
    rows = chunked._plan(1100, 0, 4, chunked.MAX_BLOCK_SCORES, chunked.MAX_FUSED_ROWS, True)
    assert -(-1100 // rows) * rows <= 1100 + 1100 // 8
    assert chunked._chunks(4096, 4) == [(c, c + 256) for c in range(0, 4096, 256)]
    assert chunked._chunks(12, 3) == [(0, 12)]


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
