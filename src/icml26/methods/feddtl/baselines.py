"""PromptFL baseline (Guo et al., 2023): federated prompt learning with CLIP frozen.

Each client learns ``n_ctx`` continuous context vectors that replace the words "a photo of a" in the prompt
(CoOp-style, one context shared by all classes, initialised from the embeddings of those words so that round 0 is the
zero-shot model exactly); the server averages the context vectors (sample-weighted FedAvg). Both towers stay frozen,
so the image embeddings are computed once. Local epochs and rounds are the same as for the other arms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import FedDTLConfig
from .data import FederatedTask
from .model import CLS, PAD, DualEncoder
from .reference import _seed, fedavg

TEMPLATE = "a photo of a"


def class_names(prompts: list[str]) -> list[str]:
    """Strip the template from "a photo of a {name}" prompts; other prompts are rejected."""
    out = []
    for p in prompts:
        if not p.startswith(TEMPLATE + " "):
            raise ValueError(f"PromptFL expects prompts of the form '{TEMPLATE} <name>', got {p!r}")
        out.append(p[len(TEMPLATE) + 1:])
    return out


def initial_context(model: DualEncoder) -> torch.Tensor:
    """``(n_ctx, width)`` token embeddings of the template words (n_ctx = 4)."""
    ids = model.tokenizer([TEMPLATE])[0, 1:].to(model.logit_scale.device)
    return model.text.tok(ids).detach().clone()


def prompt_text_embeddings(model: DualEncoder, ctx: torch.Tensor, names: list[str]) -> torch.Tensor:
    """Unit text embeddings ``(C, d)`` of ``[CLS] ctx_1..ctx_n name-words`` (differentiable in ``ctx``)."""
    ids = model.tokenizer(names).to(ctx.device)                   # (C, 1 + words)
    tok = model.text.tok(ids)
    c = len(names)
    x = torch.cat([tok[:, :1], ctx[None].expand(c, -1, -1), tok[:, 1:]], 1)
    pad = torch.cat([torch.zeros(c, 1 + len(ctx), dtype=torch.bool, device=ctx.device), ids[:, 1:] == PAD], 1)
    return F.normalize(model.text.forward_embedded(x, pad), dim=-1)


def run_promptfl(encoder: DualEncoder, task: FederatedTask, cfg: FedDTLConfig, seed: int) -> dict:
    """PromptFL for ``cfg.rounds`` rounds x ``cfg.sft_epochs`` local epochs at ``cfg.lr`` (Adam); returns
    ``{"final": {base_accuracy, novel_accuracy, hm, val_accuracy}, "ctx": global context}``."""
    model = encoder
    for p in model.parameters():
        p.requires_grad_(False)
    dev = model.logit_scale.device
    names = class_names(task.prompts)
    base_names = names[: task.n_base]
    with torch.no_grad():
        feats = [torch.cat([model.encode_image(x[i:i + 256].to(dev)) for i in range(0, len(x), 256)])
                 for x in task.client_x]
    ctx = initial_context(model)
    assert CLS == 1  # the prompt layout above assumes the tokenizer's [CLS] first
    for t in range(1, cfg.rounds + 1):
        states, weights = [], []
        for k, (z, y) in enumerate(zip(feats, task.client_y)):
            g = torch.Generator().manual_seed(_seed(seed, t, k, 7))
            local = ctx.clone().requires_grad_(True)
            opt = torch.optim.Adam([local], lr=cfg.lr)
            y = y.to(dev)
            for _ in range(cfg.sft_epochs):
                order = torch.randperm(len(z), generator=g).to(dev)
                for i in range(0, len(z), cfg.batch_size):
                    idx = order[i:i + cfg.batch_size]
                    logits = model.scale * z[idx] @ prompt_text_embeddings(model, local, base_names).T
                    loss = F.cross_entropy(logits, y[idx])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
            states.append({"ctx": local.detach()})
            weights.append(len(z))
        ctx = fedavg(states, weights)["ctx"]
    with torch.no_grad():
        emb = prompt_text_embeddings(model, ctx, names)

        def acc(x, y, e, offset):
            z = torch.cat([model.encode_image(x[i:i + 256].to(dev)) for i in range(0, len(x), 256)])
            return float(((z @ e.T).argmax(-1).cpu() + offset == y).float().mean())

        nb = task.n_base
        base = acc(task.test_base_x, task.test_base_y, emb[:nb], 0)
        novel = acc(task.test_novel_x, task.test_novel_y, emb[nb:], nb)
        val = acc(task.val_x, task.val_y, emb[:nb], 0)
    hm = 2 * base * novel / (base + novel) if base + novel > 0 else 0.0
    return {"final": {"base_accuracy": base, "novel_accuracy": novel, "hm": hm, "val_accuracy": val}, "ctx": ctx}
