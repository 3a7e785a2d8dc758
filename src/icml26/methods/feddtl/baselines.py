"""Baselines with CLIP frozen: PromptFL (Guo et al., 2023) and a FedCLIP-style adapter (Lu et al., 2023).

PromptFL: federated prompt learning.

Each client learns ``n_ctx`` continuous context vectors that replace the words "a photo of a" in the prompt
(CoOp-style, one context shared by all classes, initialised from the embeddings of those words so that round 0 is the
zero-shot model exactly); the server averages the context vectors (sample-weighted FedAvg). Both towers stay frozen,
so the image embeddings are computed once. Local epochs and rounds are the same as for the other arms.

FedCLIP (arXiv 2302.13485): an attention-based adapter on the image features (AttAI), the only trained and averaged
part; the text embeddings stay the pretrained ones. See :class:`AttentionAdapter` for the reconstructed details.

FedMaPLe: MaPLe (Khattak et al., CVPR 2023, arXiv 2210.03117) multi-modal prompt learning, federated by FedAvg of
all its prompt parameters. See :class:`MultiModalPrompts` for the reconstructed details.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
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


def federated_cross_entropy(global_part: nn.Module, new_local: Callable[[], nn.Module], client_data, logits,
                            cfg: FedDTLConfig, seed: int, tag: int) -> None:
    """The local-training and averaging loop the frozen-CLIP baselines share, updating ``global_part`` in place.

    Each of ``cfg.rounds`` rounds: every client k starts a fresh ``new_local()`` from the global state, trains it for
    ``cfg.sft_epochs`` epochs of Adam (``cfg.lr``) on minibatches of ``cfg.batch_size`` with cross-entropy of
    ``logits(local, inputs[idx])`` (``(b, C_base)``) against its labels, shuffled by a generator seeded from
    (seed, round, k, ``tag``); the server then loads the sample-weighted FedAvg of the clients' states.

    ``client_data``: one ``(inputs, labels)`` pair per client (inputs may be images or precomputed features).
    """
    dev = next(iter(global_part.parameters())).device
    for t in range(1, cfg.rounds + 1):
        states, weights = [], []
        for k, (x, y) in enumerate(client_data):
            g = torch.Generator().manual_seed(_seed(seed, t, k, tag))
            local = new_local()
            local.load_state_dict(global_part.state_dict())
            opt = torch.optim.Adam(local.parameters(), lr=cfg.lr)
            x, y = x.to(dev), y.to(dev)
            for _ in range(cfg.sft_epochs):
                order = torch.randperm(len(x), generator=g).to(dev)
                for i in range(0, len(x), cfg.batch_size):
                    idx = order[i:i + cfg.batch_size]
                    loss = F.cross_entropy(logits(local, x[idx]), y[idx])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
            states.append({n: v.detach() for n, v in local.state_dict().items()})
            weights.append(len(x))
        global_part.load_state_dict(fedavg(states, weights))


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
    context = nn.ParameterDict({"ctx": nn.Parameter(ctx.clone())})
    federated_cross_entropy(
        context, lambda: nn.ParameterDict({"ctx": nn.Parameter(torch.empty_like(ctx))}),
        list(zip(feats, task.client_y)),
        lambda local, z: model.scale * z @ prompt_text_embeddings(model, local["ctx"], base_names).T, cfg, seed, tag=7)
    ctx = context["ctx"].detach()
    with torch.no_grad():
        emb = prompt_text_embeddings(model, ctx, names)
    return {"final": accuracies(model.encode_image, emb, task), "ctx": ctx}


@torch.no_grad()
def accuracies(encode, text_emb: torch.Tensor, task: FederatedTask) -> dict:
    """Base, novel, HM and validation accuracy of ``argmax_c <encode(x), text_emb_c>`` (as ``reference.evaluate``).

    ``encode``: images ``(n, 3, S, S)`` -> embeddings ``(n, d)``; ``text_emb``: ``(C_base + C_novel, d)``.
    """
    dev = text_emb.device

    def acc(x, y, e, offset):
        z = torch.cat([encode(x[i:i + 256].to(dev)) for i in range(0, len(x), 256)])
        return float(((z @ e.T).argmax(-1).cpu() + offset == y).float().mean())

    nb = task.n_base
    base = acc(task.test_base_x, task.test_base_y, text_emb[:nb], 0)
    novel = acc(task.test_novel_x, task.test_novel_y, text_emb[nb:], nb)
    val = acc(task.val_x, task.val_y, text_emb[:nb], 0)
    hm = 2 * base * novel / (base + novel) if base + novel > 0 else 0.0
    return {"base_accuracy": base, "novel_accuracy": novel, "hm": hm, "val_accuracy": val}


class AttentionAdapter(nn.Module):
    """FedCLIP's attention-based adapter (AttAI) on the image features: ``I * softmax(W2 tanh(W1 I + b1) + b2)``.

    Input and output ``(n, d)`` (``d`` = joint embedding size); the attention is over the ``d`` feature
    dimensions. The last layer starts at zero ([REC]), so the attention starts uniform (1/d) and, after the unit
    normalisation CLIP applies, round 0 is the zero-shot model exactly (as PromptFL's context starts at the
    template words).
    """

    def __init__(self, dim: int):
        super().__init__()
        self.attn = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim), nn.Softmax(dim=-1))
        nn.init.zeros_(self.attn[2].weight)
        nn.init.zeros_(self.attn[2].bias)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return feats * self.attn(feats)


def run_fedclip(encoder: DualEncoder, task: FederatedTask, cfg: FedDTLConfig, seed: int) -> dict:
    """FedCLIP-style baseline: both towers frozen, each client trains an :class:`AttentionAdapter` on its image
    features with cross-entropy against the frozen base-class text embeddings (``cfg.sft_epochs`` local epochs, Adam
    ``cfg.lr``), the server takes the sample-weighted FedAvg of the adapter, for ``cfg.rounds`` rounds.

    Returns ``{"final": {base_accuracy, novel_accuracy, hm, val_accuracy}, "adapter": the global AttentionAdapter}``.
    """
    model = encoder
    for p in model.parameters():
        p.requires_grad_(False)
    dev = model.logit_scale.device
    with torch.no_grad():
        text = model.encode_text(task.prompts)
        feats = [torch.cat([model.vision(x[i:i + 256].to(dev)) for i in range(0, len(x), 256)])
                 for x in task.client_x]                          # (n_k, d), before CLIP's normalisation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(seed, 23))
        adapter = AttentionAdapter(text.shape[1]).to(dev)
    federated_cross_entropy(
        adapter, lambda: AttentionAdapter(text.shape[1]).to(dev), list(zip(feats, task.client_y)),
        lambda local, f: model.scale * F.normalize(local(f), dim=-1) @ text[: task.n_base].T, cfg, seed, tag=11)
    adapter.eval()
    return {"final": accuracies(lambda x: F.normalize(adapter(model.vision(x)), dim=-1), text, task),
            "adapter": adapter}


class MultiModalPrompts(nn.Module):
    """MaPLe's prompts: text context ``t_j`` (n_ctx, width_text) for the first ``depth`` text blocks, and vision
    prompts ``v_j = F_j(t_j)`` made from them by linear coupling functions ``F_j`` (width_text -> width_vision).

    Block 0 of the text tower sees ``[CLS] t_0 name-words`` (``t_0`` initialised from the template words, as in
    PromptFL); block j < depth has its context positions replaced by ``t_j`` (deep prompts, ``t_j`` for j >= 1
    start at N(0, 0.02^2)). The vision tower sees ``[CLS] patches v_0``, the last ``n_ctx`` tokens replaced by
    ``v_j`` before block j < depth, and carried on unchanged after. Reconstructed ([REC]): depth 2 of our 2 text /
    4 vision blocks (MaPLe: 9 of 12), n_ctx 4 (MaPLe: 2, but our template has 4 words), prompt tokens without
    position embeddings, coupling ``F_j`` initialised at N(0, 0.02^2) with zero bias.
    """

    def __init__(self, ctx0: torch.Tensor, vision_width: int, depth: int = 2):
        super().__init__()
        n_ctx, width = ctx0.shape
        self.ctx = nn.ParameterList([nn.Parameter(ctx0.detach().clone())] +
                                    [nn.Parameter(torch.randn(n_ctx, width) * 0.02) for _ in range(depth - 1)])
        self.couple = nn.ModuleList(nn.Linear(width, vision_width) for _ in range(depth))
        for layer in self.couple:
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)

    @property
    def depth(self) -> int:
        return len(self.ctx)

    def text_embeddings(self, model: DualEncoder, names: list[str]) -> torch.Tensor:
        """Unit text embeddings ``(C, d)`` of the class ``names`` with the deep text prompts."""
        tower, n_ctx, c = model.text, len(self.ctx[0]), len(names)
        ids = model.tokenizer(names).to(self.ctx[0].device)
        tok = tower.tok(ids)
        x = torch.cat([tok[:, :1], self.ctx[0][None].expand(c, -1, -1), tok[:, 1:]], 1)
        pad = torch.cat([torch.zeros(c, 1 + n_ctx, dtype=torch.bool, device=x.device), ids[:, 1:] == PAD], 1)
        x = x + tower.pos[:, : x.shape[1]]
        for j, block in enumerate(tower.blocks):
            if 0 < j < self.depth:
                x = torch.cat([x[:, :1], self.ctx[j][None].expand(c, -1, -1), x[:, 1 + n_ctx:]], 1)
            x = block(x, pad)
        return F.normalize(tower.head(tower.ln(x[:, 0])), dim=-1)

    def encode_image(self, model: DualEncoder, images: torch.Tensor) -> torch.Tensor:
        """Unit image embeddings ``(n, d)`` of ``images`` ``(n, 3, S, S)`` with the coupled vision prompts."""
        tower, n = model.vision, images.shape[0]
        n_ctx = len(self.ctx[0])
        x = F.unfold(images, kernel_size=tower.patch, stride=tower.patch).transpose(1, 2)
        x = torch.cat([tower.cls.expand(n, -1, -1), tower.embed(x)], 1) + tower.pos
        x = torch.cat([x, self.couple[0](self.ctx[0])[None].expand(n, -1, -1)], 1)
        for j, block in enumerate(tower.blocks):
            if 0 < j < self.depth:
                x = torch.cat([x[:, :-n_ctx], self.couple[j](self.ctx[j])[None].expand(n, -1, -1)], 1)
            x = block(x)
        return F.normalize(tower.head(tower.ln(x[:, 0])), dim=-1)


def run_fedmaple(encoder: DualEncoder, task: FederatedTask, cfg: FedDTLConfig, seed: int, depth: int = 2) -> dict:
    """FedMaPLe-style baseline: both towers frozen; each client trains :class:`MultiModalPrompts` (text context,
    deep prompts and coupling functions) with cross-entropy over the base-class prompts, ``cfg.sft_epochs`` local
    epochs of Adam ``cfg.lr``; the server takes the sample-weighted FedAvg of every prompt parameter, for
    ``cfg.rounds`` rounds. Costs about as much as FedLoRA (the image tower runs forward and backward every step).

    Returns ``{"final": {base_accuracy, novel_accuracy, hm, val_accuracy}, "prompts": the global prompts}``.
    """
    model = encoder
    for p in model.parameters():
        p.requires_grad_(False)
    dev = model.logit_scale.device
    names = class_names(task.prompts)
    base_names = names[: task.n_base]
    vision_width = model.vision.pos.shape[-1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(seed, 29))
        prompts = MultiModalPrompts(initial_context(model), vision_width, depth).to(dev)
    federated_cross_entropy(
        prompts, lambda: MultiModalPrompts(initial_context(model), vision_width, depth).to(dev),
        list(zip(task.client_x, task.client_y)),
        lambda local, x: model.scale * local.encode_image(model, x) @ local.text_embeddings(model, base_names).T,
        cfg, seed, tag=13)
    with torch.no_grad():
        emb = prompts.text_embeddings(model, names)
        final = accuracies(lambda im: prompts.encode_image(model, im), emb, task)
    return {"final": final, "prompts": prompts}
