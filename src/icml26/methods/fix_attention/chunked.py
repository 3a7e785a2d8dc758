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
    C x C x dv decay, exponentiated only where j <= i. Keys before the super-block (earlier tokens, and a decode
    cache) use the super-block's start as boundary: that part is plain softmax attention over values decayed to the
    boundary (one in-place decay buffer, ``_EarlyDecay``), run on CPU by torch's fused flash-attention kernel and
    merged by its log-sum-exp (``_early_attend``, ``_early_grads``; ``FUSED_EARLY = False`` or another device uses
    plain matmuls). Nothing overflows; underflow to 0 is real forgetting. The log
    decays are float32 sums local to each tree block, never differences of long prefix sums, so they keep float32
    precision relative to their own size however large |Lambda| grows (see ``_Geometry``).

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
# Rows per super-block. Each tree level costs about ten element-wise passes over the rows (R/2 x d values), so
# taller super-blocks add levels; keys before a super-block cost a dense pass instead. 256 was fastest on CPU at
# d = 64 for T = 1024 and T = 4096 (benchmarks/fix_attention_speed.py; 1024 rows were 15-20% slower). With the
# fused earlier-key path (issue 15) 512 rows were no faster at T = 1024 and cost more memory (README, Speed).
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


def _plan(t: int, n_pre: int, leaf: int, max_block_scores: int, max_rows: int) -> int:
    """Super-block rows R = leaf * 2^L: the largest that is at most ``max_rows``, whose padding adds at most 1/8 to
    T (or one leaf) and whose score rows fit ``max_block_scores`` per (batch, head)."""
    limit = max(t + t // 8, -(-t // leaf) * leaf)
    rows, best = leaf, leaf
    while rows < t and 2 * rows <= max_rows:
        rows *= 2
        padded = -(-t // rows) * rows
        if rows * (n_pre + padded) > max_block_scores:
            break
        if padded <= limit:
            best = rows
    return best


def _reverse_exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """out_j = sum_{t > j} x_t along ``dim`` (the log decay from j to the end of the span)."""
    suffix = x.flip(dim).cumsum(dim).flip(dim)
    # Shift by one instead of subtracting x_j, which would cost digits when x_j dominates the sum.
    return torch.cat((suffix.narrow(dim, 1, x.shape[dim] - 1), torch.zeros_like(x.narrow(dim, 0, 1))), dim)


class _Geometry:
    """Shapes, views and decay factors of one super-block, shared by the forward and the backward pass.

    Precision without float64: every log gate is <= 0, so a running sum of them only grows in magnitude and a
    float32 prefix or suffix sum is accurate *relative to its own value*. A difference Lambda_i - Lambda_j of two
    long prefix sums is not (it cancels digits when the gates were strong earlier and weak in between). So no decay
    here is formed as such a difference: the tree levels use decays local to their blocks, built bottom-up from
    block totals (``levels``), and only leaves (at most C - 1 terms) take differences.

    Attributes after construction: ``to_start`` (B, H, R, dv) exp(Lambda_i - Lambda_{s0-1}), the decay from the
    position before the super-block; ``leaf_decay`` (B, H, R/C, C, C, dv) the explicit decay inside leaves (1 where
    j > i, where the weights are 0); ``causal`` (C, C).
    """

    def __init__(self, lf_s: torch.Tensor, leaf: int) -> None:
        b, h, r, dv = lf_s.shape
        self.shape, self.leaf, self.dtype = (b, h, r, dv), leaf, lf_s.dtype
        self.log_f = lf_s
        self.to_start = lf_s.cumsum(2).exp_()
        self.causal = torch.ones(leaf, leaf, dtype=torch.bool, device=lf_s.device).tril()
        lam_leaf = lf_s.view(b, h, r // leaf, leaf, dv).cumsum(3)
        # For j > i the difference is >= 0; clamping it to 0 keeps the exp finite, and the softmax weight of
        # those pairs is exactly 0 wherever the decay is used, so no mask is needed here.
        self.leaf_decay = (lam_leaf.unsqueeze(4) - lam_leaf.unsqueeze(3)).clamp_max_(0.0).exp_()
        self._leaf_prefix = lam_leaf

    def leaf_view(self, x: torch.Tensor) -> torch.Tensor:
        b, h, r, _ = self.shape
        return x.view(b, h, r // self.leaf, self.leaf, x.shape[-1])

    def levels(self):
        """Yield (pair, q_decay, k_decay) per tree level: ``pair(x)`` splits (B, H, R, .) into the (right, left)
        blocks of every sibling pair; q_decay = exp(Lambda_i - Lambda_b) on the right block, k_decay =
        exp(Lambda_b - Lambda_j) on the left block, b the last position of the left block.

        With blocks of M positions, ``prefix`` holds the decay from each block's start to i inclusive and
        ``suffix`` the decay from j (exclusive) to its block's end: q_decay is the right block's prefix and k_decay
        the left block's suffix. Merging two siblings into a block of 2M multiplies the right prefix by the left
        block's total decay and the left suffix by the right block's: in log terms, sums of same-sign terms only.
        Keeping decays rather than log sums means one multiply per level instead of an exp.
        """
        b, h, r, dv = self.shape
        prefix = self._leaf_prefix.reshape(b, h, r, dv).exp()
        suffix = _reverse_exclusive_cumsum(self.leaf_view(self.log_f), 3).exp_().view(b, h, r, dv)
        size = self.leaf
        while size < r:
            split = (b, h, r // (2 * size), 2, size)

            def pair(x: torch.Tensor, split=split) -> tuple[torch.Tensor, torch.Tensor]:
                halves = x.view(*split, x.shape[-1])
                return halves[:, :, :, 1], halves[:, :, :, 0]

            pre, suf = prefix.view(*split, dv), suffix.view(*split, dv)
            # Views: the caller uses them within its loop iteration, before the merge below changes them.
            yield pair, pre[:, :, :, 1], suf[:, :, :, 0]
            suf[:, :, :, 0] *= pre[:, :, :, 1, -1:]          # right block's total, before its prefix moves
            pre[:, :, :, 1] *= pre[:, :, :, 0, -1:]          # left block's total
            size *= 2


# Earlier keys of a super-block through torch's fused flash-attention CPU kernel (it returns the row log-sum-exp,
# which the merge with the tree needs). False forces the plain-matmul path everywhere (tests run both).
FUSED_EARLY = True


def _fused(x: torch.Tensor) -> bool:
    return (FUSED_EARLY and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


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


def _early_grads(q_s: torch.Tensor, early_k: torch.Tensor, early_v: torch.Tensor, qg: torch.Tensor,
                 neg_delta: torch.Tensor, lse_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the earlier-key part: (dq (B, H, R, d) unscaled, d early_k (B, H, N, d), d early_v (B, H, N, dv)).

    With p_ij = exp(s_ij - lse_i) (the full row's lse) and qg_i = exp(Lambda_i - Lambda_b) (.) g_i:
    ds_ij = p_ij (qg_i . v~_j - delta_i), d v~_j = sum_i p_ij qg_i. The fused backward kernel computes its own
    delta as grad_out . out; one extra column makes that the full row's delta_i: grad_out = [qg, delta], out =
    [0, 1], v~ = [v~, 0] (so the extra column adds nothing to dp_ij).
    """
    if _fused(q_s):
        d, dv = q_s.shape[-1], early_v.shape[-1]
        width = max(d, dv) + 1
        grad_out = torch.cat((_pad_to(qg, width - 1), -neg_delta), dim=-1)
        out = torch.zeros_like(grad_out)
        out[..., -1] = 1.0
        dq, dk, dv_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, _pad_to(q_s, width), _pad_to(early_k, width), _pad_to(early_v, width), out,
            lse_s.squeeze(-1), 0.0, False, scale=1.0)
        return dq[..., :d], dk[..., :d], dv_[..., :dv]
    p = _mm(q_s, early_k.transpose(-1, -2), -lse_s).exp_()
    ds = _mm(qg, early_v.transpose(-1, -2), neg_delta).mul_(p)
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

    def advance(self, geo: _Geometry) -> None:
        r = geo.shape[2]
        self.c[:, :, :self.n] *= geo.to_start[:, :, -1:]
        self.c[:, :, self.n:self.n + r] = _reverse_exclusive_cumsum(geo.log_f, 2).exp_()
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


def _superblock_forward(q_s: torch.Tensor, k_s: torch.Tensor, v_s: torch.Tensor, geo: _Geometry,
                        early_k: torch.Tensor | None,
                        early_v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, H, R, dv) and row log-sum-exp (B, H, R, 1) of one super-block, softmax accumulated online.

    ``q_s`` is already multiplied by the softmax scale; ``early_v`` holds the earlier values decayed to the
    super-block's boundary.
    """
    b, h, r, dv = geo.shape
    lq, lk, lv = geo.leaf_view(q_s), geo.leaf_view(k_s), geo.leaf_view(v_s)
    w = _mm(lq, lk.transpose(-1, -2)).masked_fill_(~geo.causal, float("-inf"))
    m = w.amax(-1, keepdim=True)
    w.sub_(m).exp_()
    # In place: the leaf decays are not needed again in this pass (saves two (R, C, dv) buffers).
    u = geo.leaf_decay.mul_(w.unsqueeze(-1)).mul_(lv.unsqueeze(3)).sum(4).view(b, h, r, dv)
    z = w.sum(-1).view(b, h, r, 1)
    m = m.view(b, h, r, 1)
    for pair, q_decay, k_decay in geo.levels():
        q_right, _ = pair(q_s)
        _, k_left = pair(k_s)
        _, v_left = pair(v_s)
        u_right, _ = pair(u)
        z_right, _ = pair(z)
        m_right, _ = pair(m)
        w = _mm(q_right, k_left.transpose(-1, -2))
        m_new = torch.maximum(m_right, w.amax(-1, keepdim=True))
        w.sub_(m_new).exp_()
        rescale = (m_right - m_new).exp_()
        # The pair views alias u, z, m: only the right block of each pair is updated.
        u_right.mul_(rescale).addcmul_(q_decay, _mm(w, k_decay * v_left))
        z_right.mul_(rescale).add_(w.sum(-1, keepdim=True))
        m_right.copy_(m_new)
    if early_k is not None:
        # Merge the normalised earlier-key output o_e (weight exp(lse_e)) into the running (u, z, m).
        o_e, lse_e = _early_attend(q_s, early_k, early_v)
        m_new = torch.maximum(m, lse_e)
        rescale = (m - m_new).exp_()
        w_e = (lse_e - m_new).exp_()
        u = u.mul_(rescale).addcmul_(geo.to_start * o_e, w_e)
        z = z.mul_(rescale).add_(w_e)
        m = m_new
    return u.div_(z), m + z.log()


def _superblock_backward(q_s: torch.Tensor, k_s: torch.Tensor, v_s: torch.Tensor, geo: _Geometry,
                         early_k: torch.Tensor | None, early_v: torch.Tensor | None, g_s: torch.Tensor,
                         o_s: torch.Tensor, lse_s: torch.Tensor):
    """Gradients of one super-block: (dq, dk, dv) of its own rows and (d early_k, d early_v) of earlier keys.

    ``q_s`` is already multiplied by the softmax scale; dq comes back without the scale (the caller applies it).
    """
    neg_delta = -(g_s * o_s).sum(-1, keepdim=True)                             # -delta_i, (B, H, R, 1)
    neg_lse = -lse_s
    dq, dk, dv = torch.zeros_like(q_s), torch.zeros_like(k_s), torch.zeros_like(v_s)
    lq, lk, lv, lg = geo.leaf_view(q_s), geo.leaf_view(k_s), geo.leaf_view(v_s), geo.leaf_view(g_s)
    p = _mm(lq, lk.transpose(-1, -2), geo.leaf_view(neg_lse)).masked_fill_(~geo.causal, float("-inf")).exp_()
    # In place on the leaf decays (not needed again in this pass): p_ij D_ij (.) g_i, (B, H, n, C, C, dv).
    pdg = geo.leaf_decay.mul_(p.unsqueeze(-1)).mul_(lg.unsqueeze(4))
    geo.leaf_view(dv).add_(pdg.sum(3))                                          # sum_i p_ij D_ij (.) g_i
    ds = pdg.mul_(lv.unsqueeze(3)).sum(-1)                                      # p_ij (g_i . D_ij v_j)
    ds.addcmul_(p, geo.leaf_view(neg_delta))
    geo.leaf_view(dq).add_(_mm(ds, lk))
    geo.leaf_view(dk).add_(_mm(ds.transpose(-1, -2), lq))
    for pair, q_decay, k_decay in geo.levels():
        q_right, _ = pair(q_s)
        _, k_left = pair(k_s)
        _, v_left = pair(v_s)
        g_right, _ = pair(g_s)
        dq_right, _ = pair(dq)
        _, dk_left = pair(dk)
        _, dv_left = pair(dv)
        p = _mm(q_right, k_left.transpose(-1, -2), pair(neg_lse)[0]).exp_()
        qg = q_decay * g_right
        ds = _mm(qg, (k_decay * v_left).transpose(-1, -2), pair(neg_delta)[0]).mul_(p)
        dq_right.add_(_mm(ds, k_left))
        dk_left.add_(_mm(ds.transpose(-1, -2), q_right))
        dv_left.addcmul_(k_decay, _mm(p.transpose(-1, -2), qg))
    d_early_k = d_early_v = None
    if early_k is not None:
        dq_e, d_early_k, d_early_v = _early_grads(q_s, early_k, early_v, geo.to_start * g_s, neg_delta, lse_s)
        dq.add_(dq_e)
    return dq, dk, dv, d_early_k, d_early_v


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
            geo = _Geometry(_rows(log_f, s0, s1), leaf)
            early = decay.n > 0
            o[:, :, s0:s1], lse[:, :, s0:s1] = _superblock_forward(
                q[:, :, s0:s1] * scale, _rows(k, s0, s1), _rows(v, s0, s1), geo,
                keys[:, :, :decay.n] if early else None, decay.values(vals) if early else None)
            if s1 < t:
                decay.advance(geo)
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
            geo = _Geometry(_rows(log_f, s0, s1), leaf)
            n = decay.n
            early_v = decay.values(vals) if n else None
            grads = _superblock_backward(q[:, :, s0:s1] * scale, _rows(k, s0, s1), _rows(v, s0, s1), geo,
                                         keys[:, :, :n] if n else None, early_v,
                                         *(_rows(x, s0, s1) for x in (g, o, lse)))
            dq[:, :, s0:s1] = grads[0]
            dk_all[:, :, n:n + rows] += grads[1]
            dv_all[:, :, n:n + rows] += grads[2]
            if n:
                dk_all[:, :, :n] += grads[3]
                # v~_j = c_j v_j, so dv_j gets c_j (.) d v~_j.
                dv_all[:, :, :n].addcmul_(grads[4], decay.c[:, :, :n])
            if s1 < t:
                decay.advance(geo)
        dk, dv = dk_all[:, :, n_pre:], dv_all[:, :, n_pre:]
        # dLambda_i = g_i o_i - v_i dv_i; log f_t enters every Lambda_i with i >= t: a reverse cumulative sum,
        # accumulated in float64 one super-block at a time (last first) to keep the buffers small.
        d_log_f = torch.empty_like(log_f)
        carry = None
        for s0 in reversed(range(0, t, rows)):
            s1 = s0 + rows
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
                          max_block_scores: int = MAX_BLOCK_SCORES, max_block_rows: int = MAX_BLOCK_ROWS,
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
        max_block_rows: the largest super-block (rows), a speed setting (see ``MAX_BLOCK_ROWS``).
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
    rows = _plan(t, n_pre, leaf, max_block_scores, max_block_rows)
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
