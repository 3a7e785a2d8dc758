"""Weight fine-tuning baselines of PGT, K tasks at once: full fine-tuning, LoRA and VeRA (both built by peft) and
BitFit of the foundation policy's action MLP pi_theta(a | o, z), each task with its own copy of the trainable
parameters.

Why batched: one arm-run fine-tunes one policy copy per task with thousands of single-trajectory steps; doing K
tasks as one tensor program (per-task parameters stacked on a leading axis K) is K times fewer Python steps. It
is the same computation, not an approximation (equal to float rounding): the summed loss sum_k L_k(theta_k) has
gradient dL_k/dtheta_k on slice k, and Adam is elementwise, so one Adam over the stacked tensors is K independent
Adams (``tests/methods/test_pgt_finetune.py`` checks this against K separate ``torch.optim.Adam`` runs on
``GoalPolicy`` copies and against peft's own LoRA forward and gradients).

Layer l of the MLP with stacked weights: h_{l+1} = act(h_l W_l^T + b_l [+ s (h_l A_l^T) B_l^T]), with
W_l (K, out, in), b_l (K, out); LoRA factors A_l (K, r, in), B_l (K, out, r), s = lora_alpha / r (peft's scaling).
VeRA (Kopiczko et al. 2024, peft's ``VeraConfig``): h_{l+1} = act(h_l W_l^T + b_l + lambda_b,l * ((lambda_d,l *
(h_l A_l^T)) B_l^T)) with one frozen random pair A (r, in_max), B (out_max, r) shared by all layers (layer l uses
the slices A[:, :in_l], B[:out_l]) and only the scaling vectors lambda_d,l (K, r) and lambda_b,l (K, out) trained.
"""

from __future__ import annotations

import copy
import math

import torch

from .pgt import adam
from .policy import GoalPolicy

MODES = ("full", "lora", "bitfit", "vera")
LORA_TARGETS = ("net.0", "net.2", "net.4")
"""peft ``target_modules`` (LoRA and VeRA): the three Linear layers of ``GoalPolicy.net`` (the encoder is not used
by rollouts)."""


def _linears(policy: GoalPolicy) -> list[torch.nn.Linear]:
    return [m for m in policy.net if isinstance(m, torch.nn.Linear)]


def peft_lora(policy: GoalPolicy, *, r: int, alpha: float, seed: int):
    """peft's LoRA on a copy of ``policy``: ``get_peft_model(copy, LoraConfig(r, lora_alpha, target_modules=net
    Linears, lora_dropout=0))``; A is initialised by peft (Kaiming-uniform) under ``torch.manual_seed(seed)`` in a
    forked RNG, B = 0. Returns the PeftModel."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(copy.deepcopy(policy), LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                                target_modules=list(LORA_TARGETS)))


def lora_factors(peft_model) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """(A_l (r, in) per layer, B_l (out, r) per layer, scaling s) read from a peft LoRA model built by
    :func:`peft_lora`."""
    layers = [peft_model.base_model.model.net[int(name.split(".")[1])] for name in LORA_TARGETS]
    a = [m.lora_A["default"].weight.detach().clone() for m in layers]
    b = [m.lora_B["default"].weight.detach().clone() for m in layers]
    return a, b, float(layers[0].scaling["default"])


def peft_vera(policy: GoalPolicy, *, r: int, seed: int, d_initial: float = 0.1):
    """peft's VeRA on a copy of ``policy``: ``get_peft_model(copy, VeraConfig(r, target_modules=net Linears,
    projection_prng_key=seed, vera_dropout=0, d_initial))``: A, B from peft's seeded Kaiming init, lambda_b = 0,
    lambda_d = d_initial. Returns the PeftModel."""
    from peft import VeraConfig, get_peft_model

    return get_peft_model(copy.deepcopy(policy), VeraConfig(r=r, target_modules=list(LORA_TARGETS),
                                                            projection_prng_key=seed, vera_dropout=0.0,
                                                            d_initial=d_initial))


def vera_factors(peft_model) -> tuple[list[torch.Tensor], ...]:
    """Per layer: (A_l = A[:, :in_l], B_l = B[:out_l], lambda_d,l (r,), lambda_b,l (out_l,)) read from a peft VeRA
    model built by :func:`peft_vera` (the slices peft's forward takes)."""
    layers = [peft_model.base_model.model.net[int(name.split(".")[1])] for name in LORA_TARGETS]
    a = [m.vera_A["default"][:, : m.in_features].detach().clone() for m in layers]
    b = [m.vera_B["default"][: m.out_features].detach().clone() for m in layers]
    ld = [m.vera_lambda_d["default"].detach().clone() for m in layers]
    lb = [m.vera_lambda_b["default"].detach().clone() for m in layers]
    return a, b, ld, lb


def stacked_params(policy: GoalPolicy, k: int, mode: str, *, lora_r: int = 8, lora_alpha: float = 8.0,
                   vera_r: int = 64, seed: int = 0) -> tuple[dict, dict]:
    """(trainable, frozen) parameter dicts for K task copies of the policy's action MLP.

    Keys: ``W{l}``, ``b{l}`` (layer l), ``log_std``; with ``mode="lora"`` also ``A{l}``, ``B{l}`` and ``scale``;
    with ``mode="vera"`` also ``VA{l}``, ``VB{l}`` (frozen, shared) and ``ld{l}``, ``lb{l}``.
    Trainable tensors are stacked (K, ...) leaves with ``requires_grad``; frozen ones are shared, unstacked.
    ``full``: every W, b and log_std; ``bitfit``: the biases b only; ``lora``: A, B only (task k's factors from
    peft, seed ``seed + k``); ``vera``: lambda_d, lambda_b only (one peft VeRA model, projection key ``seed``:
    every task copy starts from the same lambdas, as peft initialises them identically).
    """
    if mode not in MODES:
        raise ValueError(f"fine-tuning mode must be one of {MODES}, got {mode!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"the number of task copies k must be a positive int, got {k!r}")
    base = {"log_std": policy.log_std.detach()}
    for i, lin in enumerate(_linears(policy)):
        base[f"W{i}"], base[f"b{i}"] = lin.weight.detach(), lin.bias.detach()
    trainable_keys = {"full": set(base), "bitfit": {key for key in base if key.startswith("b")}, "lora": set(),
                      "vera": set()}[mode]

    def stack(t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0).repeat(k, *([1] * t.dim())).clone().requires_grad_(True)

    trainable = {key: stack(v) for key, v in base.items() if key in trainable_keys}
    frozen = {key: v.clone() for key, v in base.items() if key not in trainable_keys}
    if mode == "lora":
        factors = [lora_factors(peft_lora(policy, r=lora_r, alpha=lora_alpha, seed=seed + j)) for j in range(k)]
        for i in range(len(LORA_TARGETS)):
            trainable[f"A{i}"] = torch.stack([f[0][i] for f in factors]).requires_grad_(True)
            trainable[f"B{i}"] = torch.stack([f[1][i] for f in factors]).requires_grad_(True)
        frozen["scale"] = torch.tensor(factors[0][2])
    if mode == "vera":
        a, b, ld, lb = vera_factors(peft_vera(policy, r=vera_r, seed=seed))
        for i in range(len(LORA_TARGETS)):
            frozen[f"VA{i}"], frozen[f"VB{i}"] = a[i], b[i]
            trainable[f"ld{i}"], trainable[f"lb{i}"] = stack(ld[i]), stack(lb[i])
    return trainable, frozen


def _per_task(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """View a stacked (K, d) tensor so that it broadcasts against x (K, ..., d): (K, 1, .., 1, d)."""
    return t.reshape(t.shape[0], *([1] * (x.dim() - 2)), *t.shape[1:])


def batched_mean(params: dict, states: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Action mean of K policy copies: observations (K, ..., obs_dim), z broadcastable to (K, ..., z_dim) ->
    (K, ..., act_dim).
    ``params`` merges a trainable and a frozen dict of :func:`stacked_params`; a stacked tensor's leading axis is
    the task copy k."""
    lead = states.shape[:-1]
    k = lead[0]
    h = torch.cat((states, z.expand(*lead, z.shape[-1])), -1).reshape(k, -1, states.shape[-1] + z.shape[-1])
    n_layers = sum(1 for key in params if key.startswith("W"))
    for i in range(n_layers):
        w, b = params[f"W{i}"], params[f"b{i}"]
        out = torch.bmm(h, w.transpose(1, 2)) if w.dim() == 3 else h @ w.T
        out = out + (b[:, None] if b.dim() == 2 else b)
        if f"A{i}" in params:
            low = torch.bmm(h, params[f"A{i}"].transpose(1, 2))
            out = out + params["scale"] * torch.bmm(low, params[f"B{i}"].transpose(1, 2))
        if f"ld{i}" in params:
            low = (h @ params[f"VA{i}"].T) * params[f"ld{i}"][:, None]
            out = out + params[f"lb{i}"][:, None] * (low @ params[f"VB{i}"].T)
        h = torch.relu(out) if i < n_layers - 1 else out
    return h.reshape(*lead, h.shape[-1])


def batched_log_std(params: dict, like: torch.Tensor) -> torch.Tensor:
    """log_std broadcastable to ``like`` (K, ..., act_dim): shared (act_dim,) or per task (K, act_dim)."""
    ls = params["log_std"]
    return ls if ls.dim() == 1 else _per_task(ls, like)


def rollout_log_std(params: dict, batch_dims: int = 2) -> torch.Tensor:
    """log_std for :func:`world.rollout` over a (K, ...) batch of ``batch_dims`` axes: (act_dim,) shared or
    (K, 1, .., 1, act_dim) per task."""
    ls = params["log_std"]
    return ls if ls.dim() == 1 else ls.reshape(ls.shape[0], *([1] * (batch_dims - 1)), ls.shape[-1])


def batched_log_prob(params: dict, states: torch.Tensor, actions: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """sum_t log N(a_t; mu_k(o_t, z), diag std_k^2) per trajectory: observations (K, B, T, obs_dim), actions
    (K, B, T, act_dim) -> (K, B)."""
    mu = batched_mean(params, states, z)
    log_std = batched_log_std(params, mu)
    lp = -0.5 * ((actions - mu) / log_std.exp()).pow(2) - log_std - 0.5 * math.log(2 * math.pi)
    return lp.sum((-1, -2))


def bc_step(trainable: dict, frozen: dict, opt: torch.optim.Optimizer, states: torch.Tensor, actions: torch.Tensor,
            z: torch.Tensor) -> torch.Tensor:
    """One behavior-cloning step of every task copy on one trajectory each: observations (K, 1, T, obs_dim),
    actions (K, 1, T, act_dim), z (K, 1, 1, z_dim). Loss_k = -log pi_k(tau_k | z_k) / T; the step minimises
    sum_k Loss_k (independent per copy).
    Returns the per-task losses (K,)."""
    loss = -batched_log_prob({**frozen, **trainable}, states, actions, z)[:, 0] / states.shape[-2]
    opt.zero_grad(set_to_none=True)
    loss.sum().backward()
    opt.step()
    return loss.detach()


def finetune_tasks(policy: GoalPolicy, mode: str, z_ref: torch.Tensor, scene: dict, *, lr: float,
                   rounds: int, n_rollouts: int, steps: int, horizon: int, dyn, gen: torch.Generator,
                   top_fraction: float = 0.2, lora_r: int = 8, lora_alpha: float = 8.0, vera_r: int = 64,
                   seed: int = 0) -> dict:
    """Fine-tune one copy of the policy per task by behavior cloning on its preferred rollouts (the weight-tuning
    baselines of PGT, on the same preference data): each round collects ``n_rollouts`` rollouts per task with
    the current copy and z_ref, keeps the top ``top_fraction`` by return, and takes ``steps`` Adam steps of one
    trajectory each (PGT's step count: epochs x train pairs).

    z_ref (K, z_dim), scene: the K tasks (``world`` scene of leading shape (K,)). Returns the merged parameter
    dict for :func:`batched_mean` (trainable tensors detached)."""
    from . import world

    if not lr > 0:
        raise ValueError(f"fine-tuning lr must be > 0, got {lr}")
    if not 0 < top_fraction <= 1:
        raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction}")
    k = z_ref.shape[0]
    if scene["family"].shape != (k,):
        raise ValueError(f"finetune_tasks needs one scene per task: K={k}, scene leading shape "
                         f"{tuple(scene['family'].shape)}")
    trainable, frozen = stacked_params(policy, k, mode, lora_r=lora_r, lora_alpha=lora_alpha, vera_r=vera_r,
                                       seed=seed)
    opt = adam(trainable.values(), lr)
    zk = z_ref.detach()[:, None, None]
    n_top = max(1, int(n_rollouts * top_fraction))
    rows = torch.arange(k)
    for _ in range(rounds):
        with torch.no_grad():
            params = {**frozen, **trainable}
            s, a, ret = world.rollout(lambda x, z: batched_mean(params, x, z), rollout_log_std(params), zk[:, 0],
                                      scene, (k, n_rollouts), horizon, gen, dyn)
            top = ret.argsort(1, descending=True)[:, :n_top]
        for _ in range(steps):
            i = top[rows, torch.randint(n_top, (k,), generator=gen)]
            bc_step(trainable, frozen, opt, s[rows, i, :-1][:, None], a[rows, i][:, None], zk)
    return {**frozen, **{key: v.detach() for key, v in trainable.items()}}
