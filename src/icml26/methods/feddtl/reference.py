"""FedDTL in plain PyTorch: the client update, the server update and the round loop, one function each.

Paper: "FedDTL: Decoupled Training with Local Reinforcement Fine-Tuning in Federated Learning" (Ma, Cheng, Xu;
arXiv 2605.27900). No official code exists; everything here follows the paper notes in
../shared/papers/rl-federated-science.md §2 ([SEC]) and marks reconstructed choices ([REC]) as config options.

One global round t (paper §2.2):
1. downlink: global vision LoRA dW_g and the base-class text embeddings z̄_text (C_base, d);
2. client k: local training of its vision LoRA on its own data; SFT (cross-entropy) for t <= M, then the
   GRPO-style RL stage with latent-noise actions and a KL to a hybrid reference;
3. uplink: the vision LoRA, the number of samples n_k, and normalised class-token image embeddings with labels;
4. server: sample-weighted FedAvg of the vision LoRA only; cross-entropy training of the text-encoder LoRA on the
   uploaded embeddings against the base-class prompts; recompute z̄_text for every class and broadcast.

Baselines are the same loop with switches (config.FedDTLConfig): FedLoRA = decoupled False, two_stage False.
The Flower layer (flower.py) calls exactly these functions, so the two paths are equal for a seed (tested).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import FedDTLConfig
from .data import FederatedTask
from .model import DualEncoder, add_lora, load_lora, lora_state

VISION_LORA_FROM = -2
"""LoRA on the last two vision blocks (paper: ViT-B/16 from layer 10 of 12 [SEC])."""
TEXT_LORA_FROM = -1
"""Server text LoRA on the last text block ([REC]: the paper does not say which text layers)."""

State = dict[str, torch.Tensor]


def _seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (same on every process: no Python ``hash`` randomisation)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def build_model(encoder: DualEncoder, cfg: FedDTLConfig, seed: int) -> DualEncoder:
    """A copy of the pretrained ``encoder`` with vision LoRA (and text LoRA) added, everything else frozen.

    The LoRA ``A`` matrices are drawn from ``seed`` so every client and the server start from the same adapters.
    """
    model = copy.deepcopy(encoder)
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(seed, 17))
        add_lora(model.vision, len(model.vision.blocks) + VISION_LORA_FROM, cfg.lora_rank, cfg.lora_alpha)
        add_lora(model.text, len(model.text.blocks) + TEXT_LORA_FROM, cfg.lora_rank, cfg.lora_alpha)
    for p in model.parameters():  # the client and server updates switch on only the LoRA they train
        p.requires_grad_(False)
    return model.to(encoder.logit_scale.device)


def policy_logits(model: DualEncoder, x: torch.Tensor, text_emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z̄_v (n, d), logits (n, C))`` with ``logits = sim(z̄_v, z̄_text) / tau``."""
    z = model.encode_image(x)
    return z, model.scale * z @ text_emb.T


@torch.no_grad()
def _log_probs(model: DualEncoder, lora: State, x: torch.Tensor, text_emb: torch.Tensor, bs: int) -> torch.Tensor:
    """Log pi(.|x) ``(n, C)`` of the vision LoRA ``lora`` (deterministic, noise-free)."""
    load_lora(model.vision, lora)
    return torch.cat([policy_logits(model, x[i:i + bs], text_emb)[1].log_softmax(-1) for i in range(0, len(x), bs)])


@dataclass
class ClientResult:
    """What a client sends back (plus the SFT snapshot it keeps locally, never uploaded).

    Attributes:
        vision_lora: the locally trained vision LoRA dW_k.
        num_examples: n_k, the FedAvg weight.
        embeddings: uploaded normalised class-token image embeddings ``(m, d)``; labels: their base labels ``(m,)``.
        metrics: train accuracy, and for RL rounds reward, clip fraction and KL.
        snapshot: the client's final-SFT LoRA to keep in its persistent state (updated after every SFT round).
    """

    vision_lora: State
    num_examples: int
    embeddings: torch.Tensor
    labels: torch.Tensor
    metrics: dict = field(default_factory=dict)
    snapshot: State | None = None


def rl_loss(logits: torch.Tensor, z: torch.Tensor, text_emb: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
            old_logp: torch.Tensor, ref_logp: torch.Tensor, cfg: FedDTLConfig,
            g: torch.Generator) -> tuple[torch.Tensor, dict]:
    """The RL-stage loss on one batch (paper §2.2, RL stage).

    Args:
        logits: ``(n, C)`` deterministic policy logits (with grad); z: ``(n, d)`` their unit image embeddings.
        text_emb: ``(C, d)``; scale: 1/tau; y: ``(n,)`` labels.
        old_logp: ``(n, C)`` log pi_old (ratio denominator); ref_logp: ``(n, C)`` log pi_ref (hybrid reference).
        g: generator for the latent noise (and sampled actions).

    Actions: G noisy embeddings z + sigma eps, eps ~ N(0, I); a_ij = argmax of their logits (or a sample).
    Reward r_ij = 1[a_ij = y_i]; advantage A_ij = (r_ij - mean_j r_ij) / std_j r_ij (0 when the group is uniform).
    L = -(1/G)(1/n) sum_ij [ min(rho A, clip(rho, 1-eps, 1+eps) A) - beta KL_ij ],
    rho_ij = pi_theta(a_ij|x_i) / pi_old(a_ij|x_i) from the noise-free model.
    """
    n, G = len(y), cfg.group_size
    with torch.no_grad():
        eps = torch.randn((n, G, z.shape[-1]), generator=g).to(z.device)
        noisy = z.detach()[:, None, :] + cfg.sigma * eps                              # (n, G, d)
        if cfg.renormalize_noisy:
            noisy = F.normalize(noisy, dim=-1)
        noisy_logits = scale * noisy @ text_emb.T                                    # (n, G, C)
        if cfg.action == "argmax":
            actions = noisy_logits.argmax(-1)
        else:
            u = torch.rand(noisy_logits.shape, generator=g).to(z.device).clamp_min(1e-12)
            actions = (noisy_logits - (-u.log()).log()).argmax(-1)                    # Gumbel-max sample
        rewards = (actions == y[:, None]).float()                                     # (n, G)
        std = rewards.std(dim=1, keepdim=True) if G > 1 else torch.zeros_like(rewards[:, :1])
        adv = torch.where(std > 0, (rewards - rewards.mean(1, keepdim=True)) / std.clamp_min(1e-8),
                          torch.zeros_like(rewards))
    logp = logits.log_softmax(-1)
    logp_a = logp.gather(1, actions)                                                  # (n, G)
    ratio = (logp_a - old_logp.gather(1, actions)).exp()
    clipped = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    if cfg.kl_estimator == "k3":
        log_r = ref_logp.gather(1, actions) - logp_a
        kl = log_r.exp() - log_r - 1                                                  # unbiased, >= 0
    else:
        kl = (logp.exp() * (logp - ref_logp)).sum(-1, keepdim=True).expand(n, G)
    loss = -(surrogate - cfg.kl_beta * kl).mean()
    stats = {"reward": float(rewards.mean()), "kl": float(kl.detach().mean()),
             "signal_fraction": float((std > 0).float().mean()),
             "clip_fraction": float(((ratio.detach() - clipped.detach()).abs() > 0).float().mean())}
    return loss, stats


def client_update(model: DualEncoder, x: torch.Tensor, y: torch.Tensor, global_vision: State, text_emb: torch.Tensor,
                  cfg: FedDTLConfig, server_round: int, client_id: int, seed: int,
                  snapshot: State | None = None) -> ClientResult:
    """One client's local training in round ``server_round`` (1-based).

    Args:
        model: a :func:`build_model` model (its vision LoRA is overwritten with ``global_vision``).
        x: ``(n_k, 3, S, S)`` local images; y: ``(n_k,)`` labels in ``[0, C_base)``.
        global_vision: the broadcast vision LoRA; text_emb: ``(C_base, d)`` broadcast z̄_text.
        snapshot: the client's final-SFT LoRA from its persistent state (None before its first SFT round; then the
            global LoRA stands in for it).
    """
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"client {client_id}: need as many labels as images and at least one, got {len(x)}, {len(y)}")
    if y.min() < 0 or y.max() >= len(text_emb):
        raise ValueError(f"client {client_id}: labels must be in [0, {len(text_emb)}), got range "
                         f"[{int(y.min())}, {int(y.max())}]")
    dev = model.logit_scale.device
    x, y, text_emb = x.to(dev), y.to(dev), text_emb.to(dev)
    g = torch.Generator().manual_seed(_seed(seed, server_round, client_id))
    stage = cfg.stage(server_round)
    bs = cfg.batch_size
    metrics: dict = {"stage_rl": float(stage == "rl")}
    if stage == "rl":
        ref_lora = snapshot if snapshot is not None else global_vision
        old_logp = _log_probs(model, global_vision, x, text_emb, bs)
        if cfg.reference == "prob_mixture":
            p_sft = _log_probs(model, ref_lora, x, text_emb, bs).exp()
            p_ref = cfg.ref_mix * p_sft + (1 - cfg.ref_mix) * old_logp.exp()
            ref_logp = p_ref.clamp_min(1e-30).log()
        else:
            mixed = {k: cfg.ref_mix * ref_lora[k] + (1 - cfg.ref_mix) * global_vision[k] for k in global_vision}
            ref_logp = _log_probs(model, mixed, x, text_emb, bs)
    load_lora(model.vision, global_vision)
    params = [p for n, p in model.vision.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg.lr)
    epochs = cfg.sft_epochs if stage == "sft" else cfg.rl_epochs
    correct = seen = 0
    rl_stats: list[dict] = []
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g).to(dev)
        for i in range(0, len(x), bs):
            idx = order[i:i + bs]
            z, logits = policy_logits(model, x[idx], text_emb)
            if stage == "sft":
                loss = F.cross_entropy(logits, y[idx])
            else:
                if cfg.old_policy == "batch":
                    old = logits.detach().log_softmax(-1)
                else:
                    old = old_logp[idx]
                loss, st = rl_loss(logits, z, text_emb, model.scale, y[idx], old, ref_logp[idx], cfg, g)
                rl_stats.append(st)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            correct += int((logits.detach().argmax(-1) == y[idx]).sum())
            seen += len(idx)
    model.eval()
    for p in params:
        p.requires_grad_(False)
    metrics["train_accuracy"] = correct / seen
    for key in ("reward", "kl", "clip_fraction", "signal_fraction"):
        metrics[key] = sum(s[key] for s in rl_stats) / len(rl_stats) if rl_stats else 0.0
    local = lora_state(model.vision)
    with torch.no_grad():
        keep = torch.arange(len(x))
        if cfg.upload_per_class:
            keep = torch.cat([torch.nonzero(y.cpu() == c).flatten()[torch.randperm(int((y == c).sum()), generator=g)]
                              [: cfg.upload_per_class] for c in y.unique().cpu().tolist()]).sort().values
        emb = torch.cat([model.encode_image(x[keep[i:i + bs]].to(dev)) for i in range(0, len(keep), bs)])
    new_snapshot = local if stage == "sft" else snapshot
    return ClientResult(local, len(x), emb.cpu(), y.cpu()[keep], metrics, new_snapshot)


def fedavg(states: list[State], weights: list[float]) -> State:
    """Sample-weighted average sum_k (n_k / N) dW_k, accumulated in the given order (float64 sum)."""
    if not states or len(states) != len(weights):
        raise ValueError(f"need one weight per state and at least one state, got {len(states)}, {len(weights)}")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {weights}")
    return {k: sum(s[k].double() * (w / total) for s, w in zip(states, weights)).to(states[0][k].dtype)
            for k in states[0]}


@dataclass
class ServerState:
    """What the server keeps between rounds: the global vision LoRA, its text LoRA and the broadcast embeddings."""

    vision: State
    text: State
    text_emb: torch.Tensor           # (C_base + C_novel, d): every class the server knows a name for
    history: list = field(default_factory=list)


def init_server(model: DualEncoder, prompts: list[str]) -> ServerState:
    """Round-0 state: the initial (B = 0) LoRAs and the pretrained text embeddings of ``prompts``."""
    with torch.no_grad():
        text_emb = model.encode_text(prompts).cpu()
    return ServerState(lora_state(model.vision), lora_state(model.text), text_emb)


def server_update(model: DualEncoder, state: ServerState, results: list[ClientResult], prompts: list[str],
                  n_base: int, cfg: FedDTLConfig, server_round: int, seed: int) -> ServerState:
    """FedAvg of the vision LoRA, then (if ``cfg.decoupled``) text-LoRA training on the uploaded embeddings.

    ``results`` must be in a fixed order (client id) so the float sum is repeatable. The text LoRA is trained with
    cross-entropy of ``sim(z̄_v, z̄_text^c)/tau`` over the ``n_base`` base prompts, with a fresh Adam each round
    ([REC]); then z̄_text is recomputed for all ``prompts`` (base and novel) and broadcast.
    """
    vision = fedavg([r.vision_lora for r in results], [r.num_examples for r in results])
    text = state.text
    dev = model.logit_scale.device
    if cfg.decoupled:
        emb = torch.cat([r.embeddings for r in results]).to(dev)
        lab = torch.cat([r.labels for r in results]).to(dev)
        load_lora(model.text, text)
        params = [p for n, p in model.text.named_parameters() if "lora_" in n]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=cfg.server_lr)
        g = torch.Generator().manual_seed(_seed(seed, server_round, 999_983))
        base_prompts = prompts[:n_base]
        for _ in range(cfg.server_epochs):
            order = torch.randperm(len(emb), generator=g).to(dev)
            for i in range(0, len(emb), cfg.batch_size):
                idx = order[i:i + cfg.batch_size]
                logits = model.scale * emb[idx] @ model.encode_text(base_prompts).T
                loss = F.cross_entropy(logits, lab[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        for p in params:
            p.requires_grad_(False)
        text = lora_state(model.text)
    load_lora(model.text, text)
    with torch.no_grad():
        text_emb = model.encode_text(prompts).cpu()
    return ServerState(vision, text, text_emb, state.history)


@torch.no_grad()
def evaluate(model: DualEncoder, state: ServerState, task: FederatedTask) -> dict:
    """Base accuracy (base test images among base prompts), novel accuracy (novel images among novel prompts), HM."""
    load_lora(model.vision, state.vision)
    dev = model.logit_scale.device
    nb = task.n_base

    def acc(x, y, emb, offset):
        pred = torch.cat([(model.encode_image(x[i:i + 256].to(dev)) @ emb.to(dev).T).argmax(-1).cpu()
                          for i in range(0, len(x), 256)])
        return float((pred + offset == y).float().mean())

    base = acc(task.test_base_x, task.test_base_y, state.text_emb[:nb], 0)
    novel = acc(task.test_novel_x, task.test_novel_y, state.text_emb[nb:], nb)
    val = acc(task.val_x, task.val_y, state.text_emb[:nb], 0)
    hm = 2 * base * novel / (base + novel) if base + novel > 0 else 0.0
    return {"base_accuracy": base, "novel_accuracy": novel, "hm": hm, "val_accuracy": val}


def client_drift(results: list[ClientResult], global_vision: State) -> float:
    """Mean pairwise cosine distance between the clients' LoRA deltas dW_k - dW_g in one round (0 if < 2)."""
    deltas = [torch.cat([(r.vision_lora[k] - global_vision[k]).flatten() for k in sorted(global_vision)])
              for r in results]
    if len(deltas) < 2:
        return 0.0
    d = F.normalize(torch.stack(deltas).double(), dim=1)
    sims = d @ d.T
    n = len(deltas)
    return float(1 - (sims.sum() - sims.diag().sum()) / (n * (n - 1)))


def run_federation(encoder: DualEncoder, task: FederatedTask, cfg: FedDTLConfig, seed: int,
                   eval_every: int = 0) -> dict:
    """The plain round loop (every client every round, clients in id order); returns metrics and curves.

    Returns ``{"final": evaluate(...), "curves": {...}, "text_shift": mean 1 - cos(z̄_text final, initial),
    "state": ServerState}``; curves hold per-round client drift and stage, plus base/novel accuracy every
    ``eval_every`` rounds (0: never).
    """
    model = build_model(encoder, cfg, seed)
    state = init_server(model, task.prompts)
    initial_text = state.text_emb.clone()
    snapshots: dict[int, State | None] = {k: None for k in range(task.num_clients)}
    curves: dict[str, list] = {"round": [], "drift": [], "base_accuracy": [], "novel_accuracy": [], "reward": [],
                               "signal_fraction": [], "clip_fraction": []}
    for t in range(1, cfg.rounds + 1):
        results = []
        for k in range(task.num_clients):
            r = client_update(model, task.client_x[k], task.client_y[k], state.vision, state.text_emb[:task.n_base],
                              cfg, t, k, seed, snapshots[k])
            snapshots[k] = r.snapshot
            results.append(r)
        curves["round"].append(t)
        curves["drift"].append(client_drift(results, state.vision))
        for key in ("reward", "signal_fraction", "clip_fraction"):
            curves[key].append(sum(r.metrics[key] for r in results) / len(results))
        state = server_update(model, state, results, task.prompts, task.n_base, cfg, t, seed)
        if eval_every and (t % eval_every == 0 or t == cfg.rounds):
            ev = evaluate(model, state, task)
            curves["base_accuracy"].append(ev["base_accuracy"])
            curves["novel_accuracy"].append(ev["novel_accuracy"])
    final = evaluate(model, state, task)
    shift = float((1 - (state.text_emb.double() * initial_text.double()).sum(-1)).mean())
    return {"final": final, "curves": curves, "text_shift": shift, "state": state}


def zero_shot(encoder: DualEncoder, task: FederatedTask, cfg: FedDTLConfig, seed: int) -> dict:
    """The pretrained model with no training (B = 0 adapters): the zero-shot arm."""
    model = build_model(encoder, cfg, seed)
    return evaluate(model, init_server(model, task.prompts), task)


__all__ = ["build_model", "client_update", "server_update", "fedavg", "evaluate", "run_federation", "zero_shot",
           "rl_loss", "ClientResult", "ServerState", "init_server", "client_drift", "policy_logits"]
