"""SHERPA (reconstructed): fine-tune a large promptable segmenter on a specialised task with guidance from a small
one already fine-tuned on that task, restricted to the large model's task-relevant query/key channels.

* FRS (Fisher Ratio Separation): label each encoder token foreground/background from the downsampled ground-truth
  mask; per channel c of the large model's queries and keys at the guided layer,
  FR_c = (mu_fg,c - mu_bg,c)^2 / (var_fg,c + var_bg,c), estimated on m task images; U = top-k channels by
  FR_q + FR_k (:func:`frs_channels`).
* GFE (Guiding Feature Extraction): the fine-tuned small model's head-averaged attention map at its guiding layer,
  G_S = mean_h softmax(Q_h K_h^T / sqrt(d_h)) (:meth:`EncoderBlock.attention_map`).
* Guided loss: L = L_seg + lambda_g KL(G_S || A_L^U) + lambda_p ||Delta W_{q,k}[U_perp]||^2 with
  A_L^U = softmax(Q_L[:, U] K_L[:, U]^T / sqrt(k)) (:func:`guided_finetune`).

All of it is a reconstruction from the abstract and the public ICLR 2026 reviews (see README and config.py).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from ...core.progress import progress
from .config import SherpaConfig
from .data import Batch
from .model import LoRALinear, PromptableSegmenter, add_lora, seg_loss


def token_labels(mask: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, S, S) masks -> (B, N) bool: a token is foreground when more than half of its pixels are."""
    return F.avg_pool2d(mask[:, None].float(), patch)[:, 0].flatten(1) > 0.5


def fisher_ratio(features: torch.Tensor, labels: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(n, C) features, (n,) bool labels -> (C,) (mu_1 - mu_0)^2 / (var_1 + var_0 + eps)."""
    fg, bg = features[labels], features[~labels]
    if len(fg) < 2 or len(bg) < 2:
        raise ValueError(f"Fisher ratio needs at least 2 foreground and 2 background tokens, got {len(fg)} and "
                         f"{len(bg)}; use more samples (m_samples)")
    return (fg.mean(0) - bg.mean(0)) ** 2 / (fg.var(0) + bg.var(0) + eps)


@torch.no_grad()
def frs_channels(model: PromptableSegmenter, batch: Batch, cfg: SherpaConfig, *, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, scores): the k = ceil(k_frac d) channels of the guided layer's queries/keys with the highest Fisher ratio
    between foreground and background tokens of ``cfg.m_samples`` task images, and every channel's score."""
    block = model.blocks[cfg.large_layer]
    d = model.size.dim
    k = max(1, math.ceil(cfg.k_frac * d))
    b = batch.subset(slice(0, cfg.m_samples))
    model.encode(b.image)
    labels = token_labels(b.mask, model.size.patch).flatten()
    if cfg.frs_features == "qk":
        scores = (fisher_ratio(block.last_q.flatten(0, 1), labels)
                  + fisher_ratio(block.last_k.flatten(0, 1), labels))
    elif cfg.frs_features == "hidden":
        scores = fisher_ratio(block.last_in.flatten(0, 1), labels)
    else:
        scores = torch.rand(d, generator=torch.Generator().manual_seed(seed)).to(block.last_q.device)
    return scores.topk(k).indices.sort().values, scores


def restricted_attention(q: torch.Tensor, k: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """(B, N, C) queries and keys, channel index U -> (B, N, N) softmax(Q[:, U] K[:, U]^T / sqrt(|U|))."""
    qu, ku = q[..., channels], k[..., channels]
    return torch.softmax(qu @ ku.transpose(-1, -2) / math.sqrt(len(channels)), -1)


def attention_kl(target: torch.Tensor, pred: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """KL(target || pred) of row-stochastic (B, N, N) maps, summed over keys, averaged over batch and queries."""
    return (target * (torch.log(target + eps) - torch.log(pred + eps))).sum(-1).mean()


def complement_penalty(model: PromptableSegmenter, layer: int, channels: torch.Tensor) -> torch.Tensor:
    """||Delta W_q[U_perp]||^2 + ||Delta W_k[U_perp]||^2 of the guided layer (LoRA deltas; 0 for full updates)."""
    attn = model.blocks[layer].attn
    out = torch.zeros((), device=attn.proj.weight.device)
    for lin in (attn.q, attn.k):
        if isinstance(lin, LoRALinear):
            keep = torch.ones(lin.base.out_features, dtype=torch.bool, device=out.device)
            keep[channels] = False
            out = out + (lin.delta()[keep] ** 2).sum()
    return out


def l2sp_penalty(params: list[torch.Tensor], anchors: list[torch.Tensor]) -> torch.Tensor:
    """L2-SP (Li et al. 2018): sum over tensors of ||theta - theta_0||^2, theta_0 the pretrained (starting) values."""
    return sum(((p - a) ** 2).sum() for p, a in zip(params, anchors))


def trainable_parameters(model: PromptableSegmenter, cfg: SherpaConfig, *, generator: torch.Generator | None = None
                         ) -> list[torch.nn.Parameter]:
    """Set ``requires_grad`` by ``cfg.update`` (adding LoRA adapters for 'lora') and return the trained tensors."""
    if cfg.update == "lora":
        return add_lora(model, cfg.lora_rank, generator=generator)
    for p in model.parameters():
        p.requires_grad_(True)
    if cfg.update == "decoder":
        for p in [model.patch_embed.weight, model.patch_embed.bias, model.pos, *model.blocks.parameters()]:
            p.requires_grad_(False)
    return [p for p in model.parameters() if p.requires_grad]


def finetune(model: PromptableSegmenter, data: Batch, *, steps: int, batch: int, lr: float, seed: int,
             cfg: SherpaConfig, guide: PromptableSegmenter | None = None, channels: torch.Tensor | None = None,
             desc: str = "fine-tune") -> PromptableSegmenter:
    """Fine-tune a copy of ``model`` on ``data`` (task images with prompts) for ``steps`` AdamW steps.

    With ``guide`` (the fine-tuned small model, frozen) and ``cfg.lambda_g > 0``, adds the guidance KL between the
    guide's attention at ``cfg.small_layer`` and this model's attention at ``cfg.large_layer`` restricted to
    ``channels`` (all channels when None). ``cfg.update`` picks LoRA (encoder frozen + LoRA, decoder trainable) or
    full fine-tuning, or the decoder only; ``cfg.lambda_sp > 0`` adds the L2-SP pull towards the starting weights.
    ``lambda_g = lambda_p = lambda_sp = 0`` is exactly plain fine-tuning.
    """
    if guide is not None and guide.size.image_size != model.size.image_size:
        raise ValueError(f"guide works on {guide.size.image_size}px images, the model on {model.size.image_size}px")
    if channels is not None and (channels.numel() == 0 or int(channels.max()) >= model.size.dim
                                 or int(channels.min()) < 0):
        raise ValueError(f"channels must be non-empty indices in [0, {model.size.dim}), got {channels.tolist()}")
    model = copy.deepcopy(model)
    lora_gen = torch.Generator().manual_seed(seed + 7)  # adapters start the same for every arm of a seed
    params = trainable_parameters(model, cfg, generator=lora_gen)
    anchors = [p.detach().clone() for p in params] if cfg.lambda_sp > 0 else None
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    U = (channels if channels is not None else torch.arange(model.size.dim)).to(device)
    use_guide = guide is not None and cfg.lambda_g > 0
    if use_guide:
        guide.eval()
    for step in progress(range(steps), desc=desc):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / steps))
        b = data.subset(torch.randint(len(data), (batch,), generator=gen))
        loss = seg_loss(model(b.image, b.point), b.mask)
        if use_guide:
            with torch.no_grad():
                guide.encode(b.image)
                target = guide.blocks[cfg.small_layer].attention_map()
            blk = model.blocks[cfg.large_layer]
            loss = loss + cfg.lambda_g * attention_kl(target, restricted_attention(blk.last_q, blk.last_k, U))
        if cfg.lambda_p > 0 and channels is not None:
            loss = loss + cfg.lambda_p * complement_penalty(model, cfg.large_layer, channels)
        if anchors is not None:
            loss = loss + cfg.lambda_sp * l2sp_penalty(params, anchors)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return model
