"""Fast paths for FiX and FoX in plain PyTorch: exact, overflow-free, O(T) training memory for FiX.

FiX (per-channel decay, ``fix_attention_chunked``)
    u_i = sum_{j <= i} p_ij exp(Lambda_i - Lambda_j) (.) v_j with p_ij = softmax_j(s_ij). Writing it as
    exp(Lambda_i) (.) Attn(q, K, exp(-Lambda) (.) V) overflows once -Lambda_j > 88 in float32 (after about
    130 tokens at f = 0.5). Instead every pair (i, j) is assigned a boundary position b with j <= b < i and

        exp(Lambda_i - Lambda_j) = exp(Lambda_i - Lambda_b) * exp(Lambda_b - Lambda_j),   both exponents <= 0,

    so the query factor multiplies output rows and the key factor multiplies values, around a plain matmul. The
    boundaries come from a dyadic tree over a super-block of R = C 2^L rows: at level l (blocks of M = C 2^l) the
    right block of every sibling pair attends to the left block through the boundary between them. Every pair is
    covered once, with O(R dv) element-wise work per level; pairs inside a leaf of C positions use the explicit
    decay exp(Lambda_i - Lambda_j), formed one diagonal (i - j = 1 .. C - 1) at a time. Keys before the super-block
    (earlier tokens, and a decode cache) use the super-block's start as boundary: that part is plain softmax
    attention over values decayed to the boundary (one in-place decay buffer, ``_EarlyDecay``), run on CPU by
    torch's fused flash-attention kernel and merged by its log-sum-exp (``_early_attend``, ``_early_grads``;
    ``FUSED_EARLY = False`` or another device uses plain matmuls). A tree level has the same structure (the right
    blocks attend to the left blocks through one boundary), so on the fused path the levels of at least
    ``FUSED_LEVEL_MIN`` positions run through the same kernel, all sibling pairs of a level in one call; a
    super-block then spans the whole sequence (up to ``MAX_FUSED_ROWS``), its leaves and small levels done chunk by
    chunk (``CHUNK_ROWS``) and its large levels over all rows at once. Nothing overflows; underflow to 0 is real
    forgetting. The log decays are float32 sums local to each tree block, never differences of long prefix sums, so
    they keep float32 precision relative to their own size however large |Lambda| grows (see ``_Geometry``).

    The softmax is accumulated online (flash-attention style: running row max, rescaled partial sums), and a custom
    autograd function recomputes the scores in the backward pass, so training memory is O(T d) per head, not
    O(T^2). With o the output, g its gradient and delta_i = g_i . o_i (the FlashAttention identity):

        dv_j = sum_i p_ij D_ij (.) g_i,          dp_ij = g_i . (D_ij (.) v_j),      ds_ij = p_ij (dp_ij - delta_i),
        dq_i = scale sum_j ds_ij k_j,            dk_j = scale sum_i ds_ij q_i,
        dLambda_i = g_i (.) o_i - v_i (.) dv_i,  dlog f_t = sum_{i >= t} dLambda_i.

    Each factorises through the same boundaries. A decode cache holds values already decayed to the position before
    the first new token (``prefix_k``/``prefix_v``), so it costs the bytes of a plain KV cache.

FoX (scalar decay per head, ``fox_attention_chunked``)
    o_i = sum_j softmax_j(s_ij + Lambda_i - Lambda_j) v_j. The bias has rank two, so it is folded into the dot
    product and the fused ``scaled_dot_product_attention`` kernel runs FoX unchanged (O(T) memory). As in the official
    kernel, Lambda is one float32 cumulative sum; the fused dot product adds Lambda_i and -Lambda_j separately, so a
    logit carries an absolute error of about float32 eps * |Lambda| (the official code's float32 Lambda has one of
    the same order).

Both compute in float32 (float64 for float64 inputs) and return the input dtype, so bfloat16 inputs are safe.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

# Attention scores per (batch, head) held at once: 2^20 floats = 4 MiB.
MAX_BLOCK_SCORES = 1 << 20
# Rows per super-block on the plain path (no fused kernel: other devices, or FUSED_EARLY = False). Each tree level
# costs about ten element-wise passes over the rows (R/2 x d values), so taller super-blocks add levels; keys before
# a super-block cost a dense pass instead. 256 was fastest on CPU at d = 64 for T = 1024 and T = 4096
# (benchmarks/fix_attention_speed.py; 1024 rows were 15-20% slower). The fused path uses MAX_FUSED_ROWS.
MAX_BLOCK_ROWS = 256


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# Logit offset of a masked key. Finite, so 0 * offset stays 0 in the backward pass; far below any real logit, so
# exp(offset + s - max) is exactly 0 in float32 and float64 whenever a row has one unmasked key.
MASKED_LOGIT = -1e30


def _key_mask_column(key_mask: torch.Tensor, b: int, n_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, n_keys) bool, True = attend -> (B, 1, n_keys, 1) logit offsets 0 / ``MASKED_LOGIT`` in ``dtype``."""
    if key_mask.dtype != torch.bool or key_mask.shape != (b, n_keys):
        raise ValueError(f"key_mask must be a bool tensor of shape (batch, cached + new keys) = {(b, n_keys)}, got "
                         f"{key_mask.dtype} {tuple(key_mask.shape)}")
    zero = torch.zeros((), dtype=dtype, device=key_mask.device)
    return torch.where(key_mask, zero, MASKED_LOGIT).to(dtype)[:, None, :, None]


def _plan(t: int, n_pre: int, leaf: int, max_block_scores: int, max_rows: int, fused: bool) -> int:
    """Super-block rows R = leaf * 2^L: the largest that is at most ``max_rows``, whose padding adds at most 1/8 to
    T (or one leaf) and whose scores fit ``max_block_scores`` per (batch, head): all R (P + T) of them on the plain
    path, the largest manual tree level's R/2 x M when large levels and earlier keys are fused."""
    limit = max(t + t // 8, -(-t // leaf) * leaf)
    rows, best = leaf, leaf
    while rows < t and 2 * rows <= max_rows:
        rows *= 2
        padded = -(-t // rows) * rows
        scores = rows // 2 * min(rows // 2, FUSED_LEVEL_MIN // 2) if fused else rows * (n_pre + padded)
        if scores > max_block_scores:
            break
        if padded <= limit:
            best = rows
    return best


def _reverse_exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """out_j = sum_{t > j} x_t along ``dim`` (the log decay from j to the end of the span)."""
    suffix = x.flip(dim).cumsum(dim).flip(dim)
    # Shift by one instead of subtracting x_j, which would cost digits when x_j dominates the sum.
    return torch.cat((suffix.narrow(dim, 1, x.shape[dim] - 1), torch.zeros_like(x.narrow(dim, 0, 1))), dim)


def _leaf_suffix(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``_reverse_exclusive_cumsum(x, 3)`` of (B, H, n, C, dv) leaves by C - 1 slice additions, summed in the same
    order (no flip copies; C is small), into ``out`` if given."""
    out = torch.empty_like(x) if out is None else out
    c = x.shape[3]
    out[:, :, :, c - 1].zero_()
    for j in range(c - 2, -1, -1):
        torch.add(out[:, :, :, j + 1], x[:, :, :, j + 1], out=out[:, :, :, j])
    return out


class _Geometry:
    """Shapes, views and decay factors of one chunk of a super-block (at most ``CHUNK_ROWS`` rows), shared by the
    forward and the backward pass.

    Precision without float64: every log gate is <= 0, so a running sum of them only grows in magnitude and a
    float32 prefix or suffix sum is accurate *relative to its own value*. A difference Lambda_i - Lambda_j of two
    long prefix sums is not (it cancels digits when the gates were strong earlier and weak in between). So no decay
    here is formed as such a difference: the tree levels use decays local to their blocks, built bottom-up from
    block totals (``levels``), and only leaves (at most C - 1 terms) take differences.

    Attributes after construction: ``causal`` (C, C); ``leaf_decay(o)`` gives the explicit decays inside leaves at
    offset o = i - j. After ``levels`` is exhausted: ``prefix`` (B, H, R, dv)
    exp(Lambda_i - Lambda_{c0-1}), the decay from the position before the chunk, and ``suffix`` exp(Lambda_{c1-1} -
    Lambda_j), the decay to the chunk's last position.
    """

    def __init__(self, lf_s: torch.Tensor, leaf: int) -> None:
        b, h, r, dv = lf_s.shape
        self.shape, self.leaf, self.dtype = (b, h, r, dv), leaf, lf_s.dtype
        self.log_f = lf_s
        self.causal = torch.ones(leaf, leaf, dtype=torch.bool, device=lf_s.device).tril()
        self._leaf_prefix = lf_s.view(b, h, r // leaf, leaf, dv).cumsum(3)

    def leaf_decay(self, offset: int) -> torch.Tensor:
        """exp(Lambda_i - Lambda_j) for the pairs i = j + offset inside each leaf: (B, H, R/C, C - offset, dv), row
        k of a leaf being the pair (k + offset, k). Only pairs with j < i are formed (the diagonal's decay is 1), so
        every exponent is <= 0 and no (C, C, dv) tensor exists."""
        lam = self._leaf_prefix
        return (lam[:, :, :, offset:] - lam[:, :, :, :-offset]).exp_()

    def leaf_view(self, x: torch.Tensor) -> torch.Tensor:
        b, h, r, _ = self.shape
        return x.view(b, h, r // self.leaf, self.leaf, x.shape[-1])

    def levels(self, prefix: torch.Tensor | None = None, suffix: torch.Tensor | None = None):
        """The chunk's tree levels above its leaves (``_tree_levels``); ``prefix`` and ``suffix``: optional
        (B, H, R, dv) views (a chunk's rows of the super-block's buffers) to build the decays in."""
        b, h, r, dv = self.shape
        self.prefix = torch.exp(self._leaf_prefix.view(b, h, r, dv), out=prefix)
        self.suffix = _leaf_suffix(self.leaf_view(self.log_f),
                                   None if suffix is None else self.leaf_view(suffix)).exp_().view(b, h, r, dv)
        return _tree_levels(self.prefix, self.suffix, self.leaf)


def _tree_levels(prefix: torch.Tensor, suffix: torch.Tensor, size: int):
    """Yield (size, pair, q_decay, k_decay) per tree level over (B, H, R, .) rows, from blocks of ``size`` = M
    positions up to M = R/2: ``pair(x)`` splits (B, H, R, .) into the (right, left) blocks of every sibling pair;
    q_decay = exp(Lambda_i - Lambda_b) on the right block, k_decay = exp(Lambda_b - Lambda_j) on the left block, b the
    last position of the left block.

    With blocks of M positions, ``prefix`` holds the decay from each block's start to i inclusive and ``suffix``
    the decay from j (exclusive) to its block's end: q_decay is the right block's prefix and k_decay the left
    block's suffix. Merging two siblings into a block of 2M multiplies the right prefix by the left block's total
    decay and the left suffix by the right block's: in log terms, sums of same-sign terms only. Keeping decays
    rather than log sums means one multiply per level instead of an exp. Both are updated in place: once exhausted,
    they hold the decays to the start and the end of the R rows.
    """
    b, h, r, dv = prefix.shape
    while size < r:
        split = (b, h, r // (2 * size), 2, size)

        def pair(x: torch.Tensor, split=split) -> tuple[torch.Tensor, torch.Tensor]:
            halves = x.view(*split, x.shape[-1])
            return halves[:, :, :, 1], halves[:, :, :, 0]

        pre, suf = prefix.view(*split, dv), suffix.view(*split, dv)
        # Views: the caller uses them within its loop iteration, before the merge below changes them.
        yield size, pair, pre[:, :, :, 1], suf[:, :, :, 0]
        suf[:, :, :, 0] *= pre[:, :, :, 1, -1:]          # right block's total, before its prefix moves
        pre[:, :, :, 1] *= pre[:, :, :, 0, -1:]          # left block's total
        size *= 2


# Earlier keys of a super-block through torch's fused flash-attention CPU kernel (it returns the row log-sum-exp,
# which the merge with the tree needs). False forces the plain-matmul path everywhere (tests run both).
FUSED_EARLY = True


def _fused(x: torch.Tensor) -> bool:
    return (FUSED_EARLY and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


# Tree levels with blocks of at least this many positions go through the fused kernel too (when ``_fused``): all
# sibling pairs of a level in the batch dim, one call per level, the same boundary trick as the earlier keys. Below
# it the kernel was slower than the plain matmuls (per level, CPU, d = 64: 1.0-1.7x slower forward and backward for
# M = 4..128, issue 15), so small levels stay manual. With fused levels a super-block can span the whole sequence
# (``MAX_FUSED_ROWS``): every pair of super-blocks then meets at one tree level, in a square kernel call, instead
# of each super-block attending to all keys before it in a short, wide call (the kernel's backward costs 16-18 ns
# per pair and head in square calls of 512-1024 rows, 24-35 ns for 256 rows against 2048-4096 keys).
FUSED_LEVEL_MIN = 256
# The largest super-block when tree levels are fused: bounded by the manual levels' scores (R/2 x M) and the leaf
# decays (R C dv), both well below ``MAX_BLOCK_SCORES`` per (batch, head) at this size.
MAX_FUSED_ROWS = 1 << 13
# Rows of a chunk: the leaves and the tree levels inside a chunk are many small element-wise ops, done chunk by
# chunk so that their operands stay in cache (256 rows, B = 1, H = 8, d = 64: 0.5 MiB per tensor).
CHUNK_ROWS = 256


def _pairs4(x: torch.Tensor) -> torch.Tensor:
    """(B, H, n, M, e) sibling-pair view -> (B H n, 1, M, e) without a copy (the pair dims merge: stride 2 M e)."""
    return x.reshape(-1, 1, *x.shape[-2:])


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _early_attend(q_s: torch.Tensor, early_k: torch.Tensor, early_v: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain (non-causal) softmax attention of a super-block's rows over the keys before it: (B, H, R, dv) output
    and (B, H, R, 1) row log-sum-exp. ``q_s`` is already scaled; ``early_v`` is already decayed to the boundary."""
    dv = early_v.shape[-1]
    if _fused(q_s):
        # The fused kernel needs one head dim for q, k and v: zero columns change neither scores nor outputs.
        width = max(q_s.shape[-1], dv)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _pad_to(q_s, width), _pad_to(early_k, width), _pad_to(early_v, width), 0.0, False, scale=1.0)
        return o[..., :dv], lse.unsqueeze(-1)
    w = _mm(q_s, early_k.transpose(-1, -2))
    lse = w.logsumexp(-1, keepdim=True)
    return _mm(w.sub_(lse).exp_(), early_v), lse


def _early_grads(q_s: torch.Tensor, early_k: torch.Tensor, early_v: torch.Tensor, g_factor: torch.Tensor,
                 g_s: torch.Tensor, neg_delta: torch.Tensor, lse_s: torch.Tensor, v_factor: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the earlier-key part: (dq (B, H, R, d) unscaled, d early_k (B, H, N, d), d v~ (B, H, N, dv)).

    With p_ij = exp(s_ij - lse_i) (the full row's lse), qg_i = exp(Lambda_i - Lambda_b) (.) g_i (``g_factor`` times
    ``g_s``) and v~_j = ``v_factor`` (.) ``early_v`` (or ``early_v`` itself when v_factor is None):
    ds_ij = p_ij (qg_i . v~_j - delta_i), d v~_j = sum_i p_ij qg_i. The fused backward kernel computes its own
    delta as grad_out . out; one extra column makes that the full row's delta_i: grad_out = [qg, delta], out =
    [0, 1] (one broadcast row), v~ = [v~, 0] (so the extra column adds nothing to dp_ij). The products are written
    straight into the padded buffers.
    """
    if _fused(q_s):
        d, dv = q_s.shape[-1], early_v.shape[-1]
        width = max(d, dv) + 1
        grad_out = g_s.new_empty(*g_s.shape[:-1], width)
        torch.mul(g_factor, g_s, out=grad_out[..., :dv])
        grad_out[..., dv:-1].zero_()
        torch.neg(neg_delta, out=grad_out[..., -1:])
        if v_factor is None:
            v_pad = _pad_to(early_v, width)
        else:
            v_pad = early_v.new_empty(*early_v.shape[:-1], width)
            torch.mul(v_factor, early_v, out=v_pad[..., :dv])
            v_pad[..., dv:].zero_()
        unit = grad_out.new_zeros(width)
        unit[-1] = 1.0
        dq, dk, dv_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, _pad_to(q_s, width), _pad_to(early_k, width), v_pad, unit.expand_as(grad_out),
            lse_s.squeeze(-1), 0.0, False, scale=1.0)
        return dq[..., :d], dk[..., :d], dv_[..., :dv]
    qg = g_factor * g_s
    v_t = early_v if v_factor is None else v_factor * early_v
    p = _mm(q_s, early_k.transpose(-1, -2), -lse_s).exp_()
    ds = _mm(qg, v_t.transpose(-1, -2), neg_delta).mul_(p)
    return _mm(ds, early_k), _mm(ds.transpose(-1, -2), q_s), _mm(p.transpose(-1, -2), qg)


class _EarlyDecay:
    """Decays of all keys before the current super-block to its boundary b = s0 - 1 (the position before it),
    updated in place from one super-block to the next: (B, H, P + T, dv), valid on the first P + s0 rows.

    c_j = exp(Lambda_b - Lambda_j) (cache rows: exp(Lambda_b - Lambda_{-1}), their values being stored decayed to
    position -1). Moving past a super-block multiplies the valid rows by its total decay and appends its own rows'
    decays to its end (a reverse cumulative sum local to the block). Each step is one pass over the earlier rows
    and only multiplies factors <= 1, never divides, so an underflowed decay stays an exact 0.
    """

    def __init__(self, like: torch.Tensor, n_pre: int, t: int) -> None:
        b, h, _, dv = like.shape
        self.c = like.new_empty(b, h, n_pre + t, dv)
        self.c[:, :, :n_pre] = 1.0
        self.n = n_pre

    def advance(self, to_start: torch.Tensor, to_end: torch.Tensor) -> None:
        """Move past a super-block, given its decays (B, H, R, dv) to its start and to its end."""
        r = to_start.shape[2]
        self.c[:, :, :self.n] *= to_start[:, :, -1:]
        self.c[:, :, self.n:self.n + r] = to_end
        self.n += r

    def values(self, vals: torch.Tensor) -> torch.Tensor:
        """Earlier values decayed to the boundary, (B, H, P + s0, dv)."""
        return self.c[:, :, :self.n] * vals[:, :, :self.n]


def _mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``bias + a @ b`` over any leading dims, as one 3-D (b)addbmm so the bias is fused into the GEMM.

    a: (..., n, k), b: (..., k, m), bias: (..., n, 1) or None -> (..., n, m).
    """
    lead = a.shape[:-2]
    a3, b3 = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    if bias is None:
        out = torch.bmm(a3, b3)
    else:
        out = torch.baddbmm(bias.reshape(-1, bias.shape[-2], 1), a3, b3)
    return out.view(*lead, *out.shape[-2:])


def _pad_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """(B, H, T, .) -> (B, H, T + pad, .) contiguous, zeros appended; no copy when it is already both."""
    return (F.pad(x, (0, 0, 0, pad)) if pad else x).contiguous()


def _rows(x: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
    """Rows s0:s1 of a (B, H, T, .) tensor, contiguous. With several super-blocks a slice is not viewable as one
    batch of matrices, so every matmul on it would copy it; one copy per super-block instead."""
    return x[:, :, s0:s1].contiguous()


def _merge(u: torch.Tensor, z: torch.Tensor, m: torch.Tensor, o_d: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge a normalised partial output into the running (u, z, m) in place, by its log-sum-exp.

    u (..., dv), z and m (..., 1): unnormalised output, softmax denominator and row max so far. o_d (..., dv): the
    partial attention output with its query-side decay applied; lse (..., 1): its log-sum-exp (weight exp(lse)).
    """
    m_new = torch.maximum(m, lse)
    rescale = (m - m_new).exp_()
    w = lse.sub_(m_new).exp_()
    u.mul_(rescale).addcmul_(o_d, w)
    z.mul_(rescale).add_(w)
    m.copy_(m_new)


def _rights(pair, *xs: torch.Tensor) -> list[torch.Tensor]:
    """The right block of every sibling pair of each tensor: views, so in-place updates reach the tensor."""
    return [pair(x)[0] for x in xs]


def _lefts(pair, *xs: torch.Tensor) -> list[torch.Tensor]:
    """The left block of every sibling pair of each tensor (views)."""
    return [pair(x)[1] for x in xs]


def _level_forward(size: int, pair, q_decay: torch.Tensor, k_decay: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, u: torch.Tensor, z: torch.Tensor, m: torch.Tensor, fused: bool) -> None:
    """One tree level of the forward pass: the right block of every sibling pair attends to the left block through
    the boundary between them, merged into the running (u, z, m) of the right block in place."""
    q_right, u_right, z_right, m_right = _rights(pair, q, u, z, m)
    k_left, v_left = _lefts(pair, k, v)
    if fused and size >= FUSED_LEVEL_MIN:
        # All sibling pairs of the level in one fused call; merged by log-sum-exp like the earlier keys.
        o_l, lse_l = _early_attend(_pairs4(q_right), _pairs4(k_left), _pairs4(k_decay * v_left))
        _merge(u_right, z_right, m_right, q_decay * o_l.view_as(u_right), lse_l.view_as(m_right))
        return
    w = _mm(q_right, k_left.transpose(-1, -2))
    m_new = torch.maximum(m_right, w.amax(-1, keepdim=True))
    w.sub_(m_new).exp_()
    rescale = (m_right - m_new).exp_()
    # The pair views alias u, z, m: only the right block of each pair is updated.
    u_right.mul_(rescale).addcmul_(q_decay, _mm(w, k_decay * v_left))
    z_right.mul_(rescale).add_(w.sum(-1, keepdim=True))
    m_right.copy_(m_new)


def _level_backward(size: int, pair, q_decay: torch.Tensor, k_decay: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, g: torch.Tensor, neg_delta: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor, fused: bool) -> None:
    """One tree level of the backward pass, accumulated into (dq, dk, dv) in place (dq without the scale)."""
    q_right, g_right, dq_right, neg_delta_right, lse_right = _rights(pair, q, g, dq, neg_delta, lse)
    k_left, v_left, dk_left, dv_left = _lefts(pair, k, v, dk, dv)
    if fused and size >= FUSED_LEVEL_MIN:
        dq_l, dk_l, dv_l = _early_grads(_pairs4(q_right), _pairs4(k_left), _pairs4(v_left), _pairs4(q_decay),
                                        _pairs4(g_right), _pairs4(neg_delta_right), _pairs4(lse_right),
                                        v_factor=_pairs4(k_decay))
        dq_right.add_(dq_l.view_as(dq_right))
        dk_left.add_(dk_l.view_as(dk_left))
        dv_left.addcmul_(k_decay, dv_l.view_as(dv_left))
        return
    p = _mm(q_right, k_left.transpose(-1, -2), lse_right.neg()).exp_()
    qg = q_decay * g_right
    ds = _mm(qg, (k_decay * v_left).transpose(-1, -2), neg_delta_right).mul_(p)
    dq_right.add_(_mm(ds, k_left))
    dk_left.add_(_mm(ds.transpose(-1, -2), q_right))
    dv_left.addcmul_(k_decay, _mm(p.transpose(-1, -2), qg))


def _chunk_forward(q_c: torch.Tensor, k_c: torch.Tensor, v_c: torch.Tensor, geo: _Geometry, fused: bool,
                   u: torch.Tensor, z: torch.Tensor, m: torch.Tensor, prefix: torch.Tensor,
                   suffix: torch.Tensor) -> None:
    """Unnormalised output u (B, H, R, dv), denominator z and row max m (B, H, R, 1) of the pairs inside one chunk
    (its leaves, then its tree levels), written into the given views (the chunk's rows of the super-block's
    buffers); ``prefix``/``suffix`` as in ``_Geometry.levels``."""
    b, h, r, dv = geo.shape
    lq, lk, lv = geo.leaf_view(q_c), geo.leaf_view(k_c), geo.leaf_view(v_c)
    lu, lz, lm = geo.leaf_view(u), geo.leaf_view(z), geo.leaf_view(m)
    w = _mm(lq, lk.transpose(-1, -2)).masked_fill_(~geo.causal, float("-inf"))
    torch.amax(w, -1, keepdim=True, out=lm)
    w.sub_(lm).exp_()
    # u_i = sum_{j <= i} w_ij D_ij v_j, one diagonal of the leaf's (C, C) weights at a time (D = 1 on the main one).
    torch.mul(lv, w.diagonal(0, -2, -1).unsqueeze(-1), out=lu)
    for offset in range(1, geo.leaf):
        decay = geo.leaf_decay(offset).mul_(w.diagonal(-offset, -2, -1).unsqueeze(-1))
        lu[:, :, :, offset:].addcmul_(decay, lv[:, :, :, :-offset])
    torch.sum(w, -1, keepdim=True, out=lz)
    for level in geo.levels(prefix, suffix):
        _level_forward(*level, q_c, k_c, v_c, u, z, m, fused)


def _chunk_backward(q_c: torch.Tensor, k_c: torch.Tensor, v_c: torch.Tensor, g_c: torch.Tensor,
                    neg_delta: torch.Tensor, lse_c: torch.Tensor, geo: _Geometry, fused: bool, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor, prefix: torch.Tensor | None = None,
                    suffix: torch.Tensor | None = None) -> None:
    """Add the gradients of the pairs inside one chunk to (dq, dk, dv) (the chunk's rows of the super-block's
    buffers, views; dq without the scale); ``prefix``/``suffix`` as in ``_Geometry.levels``."""
    lq, lk, lv, lg = geo.leaf_view(q_c), geo.leaf_view(k_c), geo.leaf_view(v_c), geo.leaf_view(g_c)
    p = _mm(lq, lk.transpose(-1, -2), geo.leaf_view(lse_c.neg())).masked_fill_(~geo.causal, float("-inf")).exp_()
    # One diagonal of the leaf at a time, as in the forward pass: gv_ij = g_i . (D_ij (.) v_j) into a (C, C) matrix
    # (zero above the diagonal, where p is 0), and dv_j += sum_i p_ij D_ij (.) g_i.
    ldv = geo.leaf_view(dv)
    gv = torch.zeros_like(p)
    gv.diagonal(0, -2, -1).copy_((lg * lv).sum(-1))
    ldv.addcmul_(lg, p.diagonal(0, -2, -1).unsqueeze(-1))
    for offset in range(1, geo.leaf):
        dg = geo.leaf_decay(offset).mul_(lg[:, :, :, offset:])                     # D_ij (.) g_i
        ldv[:, :, :, :-offset].addcmul_(dg, p.diagonal(-offset, -2, -1).unsqueeze(-1))
        gv.diagonal(-offset, -2, -1).copy_(dg.mul_(lv[:, :, :, :-offset]).sum(-1))
    ds = gv.add_(geo.leaf_view(neg_delta)).mul_(p)                              # p_ij (gv_ij - delta_i)
    geo.leaf_view(dq).add_(_mm(ds, lk))
    geo.leaf_view(dk).add_(_mm(ds.transpose(-1, -2), lq))
    for level in geo.levels(prefix, suffix):
        _level_backward(*level, q_c, k_c, v_c, g_c, neg_delta, lse_c, dq, dk, dv, fused)


def _chunks(r: int, leaf: int) -> list[tuple[int, int]]:
    """Row ranges of the chunks of a super-block of r = leaf * 2^L rows: leaf * 2^j rows each, at most
    ``CHUNK_ROWS`` (or one leaf)."""
    step = leaf
    while 2 * step <= min(r, CHUNK_ROWS):
        step *= 2
    return [(c0, c0 + step) for c0 in range(0, r, step)]


def _superblock_forward(q_s: torch.Tensor, k_s: torch.Tensor, v_s: torch.Tensor, lf_s: torch.Tensor, leaf: int,
                        early_k: torch.Tensor | None, early_v: torch.Tensor | None):
    """Output (B, H, R, dv) and row log-sum-exp (B, H, R, 1) of one super-block, softmax accumulated online, and the
    decays (B, H, R, dv) to its start and to its end (for the earlier-key buffer).

    The pairs inside each chunk of ``CHUNK_ROWS`` rows (leaves and small tree levels, many small element-wise ops
    that stay in cache) are done chunk by chunk; the tree levels above the chunks run over the whole super-block.
    ``q_s`` is already multiplied by the softmax scale; ``early_v`` holds the earlier values decayed to the
    super-block's boundary.
    """
    fused = _fused(q_s)
    chunks = _chunks(q_s.shape[2], leaf)
    b, h, r, dv = v_s.shape
    u, prefix, suffix = torch.empty_like(v_s), torch.empty_like(lf_s), torch.empty_like(lf_s)
    z, m = v_s.new_empty(b, h, r, 1), v_s.new_empty(b, h, r, 1)
    if len(chunks) == 1:
        _chunk_forward(q_s, k_s, v_s, _Geometry(lf_s, leaf), fused, u, z, m, prefix, suffix)
    else:
        for c0, c1 in chunks:
            geo = _Geometry(_rows(lf_s, c0, c1), leaf)
            _chunk_forward(*(_rows(x, c0, c1) for x in (q_s, k_s, v_s)), geo, fused,
                           *(x[:, :, c0:c1] for x in (u, z, m, prefix, suffix)))
        for level in _tree_levels(prefix, suffix, chunks[0][1]):
            _level_forward(*level, q_s, k_s, v_s, u, z, m, fused)
    if early_k is not None:
        o_e, lse_e = _early_attend(q_s, early_k, early_v)
        _merge(u, z, m, prefix * o_e, lse_e)
    return u.div_(z), m + z.log(), prefix, suffix


def _superblock_backward(q_s: torch.Tensor, k_s: torch.Tensor, v_s: torch.Tensor, lf_s: torch.Tensor, leaf: int,
                         early_k: torch.Tensor | None, early_v: torch.Tensor | None, g_s: torch.Tensor,
                         o_s: torch.Tensor, lse_s: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
    """Gradients of one super-block: (dq, dk, dv) of its own rows written into the given (B, H, R, .) views (dk and
    dv must hold zeros, dq is overwritten; dq without the scale: the caller applies it). Returns (d early_k,
    d early_v) of the earlier keys and the decays to the super-block's start and end (as ``_superblock_forward``).

    ``q_s`` is already multiplied by the softmax scale.
    """
    fused = _fused(q_s)
    neg_delta = -(g_s * o_s).sum(-1, keepdim=True)                             # -delta_i, (B, H, R, 1)
    chunks = _chunks(q_s.shape[2], leaf)
    dq.zero_()
    prefix, suffix = torch.empty_like(lf_s), torch.empty_like(lf_s)
    if len(chunks) == 1:
        _chunk_backward(q_s, k_s, v_s, g_s, neg_delta, lse_s, _Geometry(lf_s, leaf), fused, dq, dk, dv, prefix, suffix)
    else:
        for c0, c1 in chunks:
            geo = _Geometry(_rows(lf_s, c0, c1), leaf)
            _chunk_backward(*(_rows(x, c0, c1) for x in (q_s, k_s, v_s, g_s, neg_delta, lse_s)), geo, fused,
                            *(x[:, :, c0:c1] for x in (dq, dk, dv, prefix, suffix)))
        for level in _tree_levels(prefix, suffix, chunks[0][1]):
            _level_backward(*level, q_s, k_s, v_s, g_s, neg_delta, lse_s, dq, dk, dv, fused)
    d_early_k = d_early_v = None
    if early_k is not None:
        dq_e, d_early_k, d_early_v = _early_grads(q_s, early_k, early_v, prefix, g_s, neg_delta, lse_s)
        dq.add_(dq_e)
    return d_early_k, d_early_v, prefix, suffix


class _FixAttention(torch.autograd.Function):
    """Exact FiX with recomputation in the backward pass (inputs padded to a multiple of ``rows``).

    Keys before a super-block (cache rows first, then earlier new tokens) share one decay buffer
    (:class:`_EarlyDecay`); nothing of size T x T or (T / R) x T x dv is kept.
    """

    @staticmethod
    def forward(ctx, q, k, v, log_f, pre_k, pre_v, scale: float, leaf: int, rows: int):
        b, h, t, dv = v.shape
        n_pre = 0 if pre_k is None else pre_k.shape[2]
        keys = k if pre_k is None else torch.cat((pre_k, k), dim=2)
        vals = v if pre_v is None else torch.cat((pre_v, v), dim=2)
        o, lse = torch.empty_like(v), v.new_empty(b, h, t, 1)
        decay = _EarlyDecay(v, n_pre, t)
        for s0 in range(0, t, rows):
            s1 = s0 + rows
            early = decay.n > 0
            o[:, :, s0:s1], lse[:, :, s0:s1], to_start, to_end = _superblock_forward(
                q[:, :, s0:s1] * scale, _rows(k, s0, s1), _rows(v, s0, s1), _rows(log_f, s0, s1), leaf,
                keys[:, :, :decay.n] if early else None, decay.values(vals) if early else None)
            if s1 < t:
                decay.advance(to_start, to_end)
        ctx.save_for_backward(q, k, v, log_f, pre_k, pre_v, o, lse)
        ctx.scale, ctx.leaf, ctx.rows = scale, leaf, rows
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        q, k, v, log_f, pre_k, pre_v, o, lse = ctx.saved_tensors
        scale, leaf, rows = ctx.scale, ctx.leaf, ctx.rows
        g = g.contiguous()
        t = q.shape[2]
        n_pre = 0 if pre_k is None else pre_k.shape[2]
        keys = k if pre_k is None else torch.cat((pre_k, k), dim=2)
        vals = v if pre_v is None else torch.cat((pre_v, v), dim=2)
        # Gradients of all keys and values, cache rows first.
        dq, dk_all, dv_all = torch.empty_like(q), torch.zeros_like(keys), torch.zeros_like(vals)
        decay = _EarlyDecay(v, n_pre, t)
        for s0 in range(0, t, rows):
            s1 = s0 + rows
            n = decay.n
            early_v = decay.values(vals) if n else None
            # This super-block's rows of dk_all and dv_all are still zero (earlier ones only reach rows < n).
            grads = _superblock_backward(q[:, :, s0:s1] * scale, _rows(k, s0, s1), _rows(v, s0, s1),
                                         _rows(log_f, s0, s1), leaf, keys[:, :, :n] if n else None, early_v,
                                         *(_rows(x, s0, s1) for x in (g, o, lse)),
                                         dq[:, :, s0:s1], dk_all[:, :, n:n + rows], dv_all[:, :, n:n + rows])
            if n:
                dk_all[:, :, :n] += grads[0]
                # v~_j = c_j v_j, so dv_j gets c_j (.) d v~_j.
                dv_all[:, :, :n].addcmul_(grads[1], decay.c[:, :, :n])
            if s1 < t:
                decay.advance(*grads[2:])
        dk, dv = dk_all[:, :, n_pre:], dv_all[:, :, n_pre:]
        # dLambda_i = g_i o_i - v_i dv_i; log f_t enters every Lambda_i with i >= t: a reverse cumulative sum,
        # accumulated in float64 one chunk at a time (last first) to keep the buffers small.
        d_log_f = torch.empty_like(log_f)
        carry = None
        step = _chunks(rows, leaf)[0][1]
        for s0 in reversed(range(0, t, step)):
            s1 = s0 + step
            d_lam = (g[:, :, s0:s1] * o[:, :, s0:s1]).sub_(v[:, :, s0:s1] * dv[:, :, s0:s1]).double()
            d_lam = d_lam.flip(2).cumsum(2).flip(2)
            if carry is not None:
                d_lam += carry
            carry = d_lam[:, :, :1]
            d_log_f[:, :, s0:s1] = d_lam
        d_pre_k = None if pre_k is None else dk_all[:, :, :n_pre]
        d_pre_v = None if pre_v is None else dv_all[:, :, :n_pre]
        return dq.mul_(scale), dk, dv, d_log_f, d_pre_k, d_pre_v, None, None, None


def fix_attention_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor, *,
                          prefix_k: torch.Tensor | None = None, prefix_v: torch.Tensor | None = None,
                          scale: float | None = None, chunk_size: int = 4, return_state: bool = False,
                          key_mask: torch.Tensor | None = None,
                          max_block_scores: int = MAX_BLOCK_SCORES, max_block_rows: int | None = None,
                          ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fine-grained forgetting attention before the output norm (see module docstring).

    Args:
        q, k: (B, H, T, d) new queries and keys (RoPE already applied).
        v: (B, H, T, dv) new values.
        log_f: (B, H, T, dv) per-channel log forget gates (<= 0), or (B, H, T, 1) tied across channels.
        prefix_k: (B, H, P, d) cached keys before the new tokens, or None.
        prefix_v: (B, H, P, dv) cached values, each already multiplied by exp(Lambda_{-1} - Lambda_j), i.e. decayed
            to the position just before the first new token (the decode cache).
        chunk_size: leaf size C of the dyadic tree (clipped to T); element-wise work grows with C, matmul
            efficiency with it too (4 was fastest on CPU for T = 1024, d = 64).
        return_state: also return the updated value cache.
        key_mask: (B, P + T) bool, False for keys no query may attend to (padding), or None. Give padding positions
            log f = 0 as well, so that they decay nothing. Folded into the dot product like FoX's bias:
            q~ = [q, 1 / scale], k~ = [k, 0 or ``MASKED_LOGIT``], exact for every row with an unmasked key (a row
            whose keys are all masked, a padding query, gets finite values that nothing should read).
        max_block_scores: attention scores per (batch, head) held at once; bounds the super-block size.
        max_block_rows: the largest super-block (rows), a speed setting; None: ``MAX_FUSED_ROWS`` where the fused
            CPU kernel runs the large tree levels, else ``MAX_BLOCK_ROWS``.
    Returns:
        u: (B, H, T, dv) in q's dtype; with ``return_state`` also the value cache (B, H, P + T, dv) in v's dtype:
        every value decayed to the last new position, ready to be the next call's ``prefix_v``.
    """
    b, h, t, _ = q.shape
    dv = v.shape[-1]
    if (prefix_k is None) != (prefix_v is None):
        raise ValueError("prefix_k and prefix_v must be given together")
    out_dtype, cache_dtype = q.dtype, v.dtype
    cdt = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if key_mask is not None:
        n_pre = 0 if prefix_k is None else prefix_k.shape[2]
        offsets = _key_mask_column(key_mask, b, n_pre + t, cdt).expand(b, h, n_pre + t, 1)
        q = torch.cat((q.to(cdt), torch.full((b, h, t, 1), 1.0 / scale, dtype=cdt, device=q.device)), dim=-1)
        k = torch.cat((k.to(cdt), offsets[:, :, n_pre:]), dim=-1)
        if prefix_k is not None:
            prefix_k = torch.cat((prefix_k.to(cdt), offsets[:, :, :n_pre]), dim=-1)
    if t == 1 and prefix_k is not None:
        u, _, state = fix_decode_step(q, k, v, log_f, prefix_k, prefix_v, scale=scale)
        return (u, state) if return_state else u
    leaf = max(1, min(chunk_size, t))
    n_pre = 0 if prefix_k is None else prefix_k.shape[2]
    fused = _fused(torch.empty(0, dtype=cdt, device=q.device))
    if max_block_rows is None:
        max_block_rows = MAX_FUSED_ROWS if fused else MAX_BLOCK_ROWS
    rows = _plan(t, n_pre, leaf, max_block_scores, max_block_rows, fused)
    pad = -(-t // rows) * rows - t
    # Padded positions carry log f = 0, so they change no decay; being last, no real query sees them.
    qp, kp, vp, lfp = (_pad_rows(x.to(cdt), pad) for x in (q, k, v, log_f.to(cdt).expand(b, h, t, dv)))
    pre_k = None if prefix_k is None else prefix_k.to(cdt).contiguous()
    pre_v = None if prefix_v is None else prefix_v.to(cdt).contiguous()
    u = _FixAttention.apply(qp, kp, vp, lfp, pre_k, pre_v, scale, leaf, rows)[:, :, :t].to(out_dtype)
    if not return_state:
        return u
    lf = lfp[:, :, :t]
    state = vp[:, :, :t] * _reverse_exclusive_cumsum(lf, 2).exp()
    if pre_v is not None:
        state = torch.cat((pre_v * lf.sum(2, keepdim=True).exp(), state), dim=2)
    return u, state.to(cache_dtype)


def fix_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor,
                    prefix_k: torch.Tensor, prefix_v: torch.Tensor, *, scale: float | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One FiX decode step: decay the value cache by f_t, append v_t; the output is plain attention over the cache.

    Args:
        q, k: (B, H, 1, d); v: (B, H, 1, dv); log_f: (B, H, 1, dv) or (B, H, 1, 1).
        prefix_k: (B, H, P, d) cached keys; prefix_v: (B, H, P, dv) cached values decayed to the previous token.
    Returns:
        u (B, H, 1, dv) in q's dtype, and the new caches: keys (B, H, P + 1, d) (``torch.cat`` of prefix_k and k)
        and values (B, H, P + 1, dv) in v's dtype. Each cache is written once (the layer need not concatenate the
        keys again), so a step moves the bytes of a softmax step: the same order as reading the cache.
    """
    if q.shape[2] != 1 or k.shape[2] != 1 or v.shape[2] != 1 or log_f.shape[2] != 1:
        raise ValueError(f"fix_decode_step takes one new token, got q/k/v/log_f lengths {q.shape[2]}, {k.shape[2]}, "
                         f"{v.shape[2]}, {log_f.shape[2]}")
    cdt = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, h, n, dv = prefix_v.shape
    if any(x.dtype != cdt for x in (prefix_k, prefix_v, k, v)):
        # Low-precision caches: attend over the float32 state before it is rounded into the cache (v's dtype).
        state = torch.cat((prefix_v.to(cdt) * log_f.to(cdt).exp(), v.to(cdt)), dim=2)
        keys = torch.cat((prefix_k.to(cdt), k.to(cdt)), dim=2)
        u = F.scaled_dot_product_attention(q.to(cdt), keys, state, scale=scale).to(q.dtype)
        return u, torch.cat((prefix_k, k), dim=2), state.to(v.dtype)
    keys = torch.cat((prefix_k, k), dim=2)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (prefix_v, log_f, v)):
        state = torch.cat((prefix_v * log_f.to(cdt).exp(), v), dim=2)
    else:
        # Write the decayed cache straight into the new one (one pass instead of a multiply and a copy).
        state = prefix_v.new_empty(b, h, n + 1, dv)
        torch.mul(prefix_v, log_f.to(cdt).exp(), out=state[:, :, :n])
        state[:, :, n:] = v
    u = F.scaled_dot_product_attention(q.to(cdt), keys, state, scale=scale).to(q.dtype)
    return u, keys, state


def fox_attention_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor, *,
                          scale: float | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Forgetting attention (FoX) with the queries at the last Tq of Tk positions (Tq = Tk without a cache).

    The decay bias is folded into the dot product: with q~_i = [scale q_i, Lambda_i, 1] and k~_j = [k_j, 1, -Lambda_j],
    q~_i . k~_j = s_ij + Lambda_i - Lambda_j, so ``scaled_dot_product_attention`` (scale 1, causal) computes FoX exactly
    with its fused kernel: the max over s + D, O(T) memory, and gradients to Lambda through the extra columns.
    Values get two zero columns so q, k and v share a head dim (the fused CPU kernel needs that).

    Args:
        q: (B, H, Tq, d); k: (B, H, Tk, d); v: (B, H, Tk, dv) (cached keys first, RoPE already applied).
        log_f: (B, H, Tk) log forget gates of every key position, float32 as in the official code.
        key_mask: (B, Tk) bool, False for keys no query may attend to (padding), or None; it adds ``MASKED_LOGIT``
            to k~'s last column. Give padding positions log f = 0 as well, so that they decay nothing.
    Returns:
        (B, H, Tq, dv) in q's dtype.
    """
    out_dtype, cdt = q.dtype, _compute_dtype(q.dtype)
    tq, tk, dv = q.shape[2], k.shape[2], v.shape[-1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    lam = log_f.to(cdt).cumsum(-1).unsqueeze(-1)   # one cumulative sum, as in the official kernel
    ones = torch.ones_like(lam)
    q_aug = torch.cat((q.to(cdt) * scale, lam[:, :, tk - tq:], ones[:, :, tk - tq:]), dim=-1)
    key_col = -lam if key_mask is None else _key_mask_column(key_mask, k.shape[0], tk, cdt) - lam
    k_aug = torch.cat((k.to(cdt), ones, key_col), dim=-1)
    v_aug = F.pad(v.to(cdt), (0, q_aug.shape[-1] - dv))
    if tq == tk:
        out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, is_causal=True, scale=1.0)
    else:
        # is_causal aligns the mask top-left; query i (position tk - tq + i) sees keys j <= tk - tq + i.
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
        out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, attn_mask=mask, scale=1.0)
    return out[..., :dv].to(out_dtype)
