"""CSPLoRA's probe: confidence-weighted per-module importance, batched with per-sample gradients from hooks.

For probe sample x with loss l(x) and confidence c(x) = p(y | x), and target module m with weight W_m:

    s_m(x) = ||dl(x)/dW_m||_F^2                   (importance="fisher")
             sum_ij |W_m * dl(x)/dW_m|_ij          (importance="taylor")
    u(x)   = (1 - c(x))^gamma | H(p(.|x)) / log K | 1      (weighting = focal | entropy | none)
    w(x)   = u(x) / mean_x u(x)
    I_m    = mean_x w(x) s_m(x) / n_m^p            (p = 0, 1/2, 1 for size_norm = none | sqrt | numel)
    pi_m   = I_m^kappa / sum_j I_j^kappa           (the plan: proportions, no budget)

The per-sample gradient of a Linear weight is sum_t g_t x_t^T over the sample's positions t (g: gradient at the
module's output, x: its input), so one forward and one backward pass of the whole batch give every s_m(x): the
hooks keep x and ask autograd for g. ``reference.py`` computes the same numbers one sample at a time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ...core.adapters import find_target_modules
from .config import CSPLoRAConfig
from .plan import RankPlan

# Largest per-sample gradient block materialised at once (elements); bounds probe memory on large modules.
_CHUNK_ELEMENTS = 1 << 24


@dataclass
class ProbeOutput:
    """What a probe function returns for a batch of B samples.

    Attributes:
        loss: (B,) per-sample losses; their sum is differentiated, so sample b's loss must depend on sample b only.
        confidence: (B,) in [0, 1], the model's probability of the correct answer (c in the paper's sense).
        entropy: (B,) predictive entropy normalised to [0, 1] (H / log K); needed only for weighting="entropy".
    """

    loss: torch.Tensor
    confidence: torch.Tensor
    entropy: torch.Tensor | None = None


ProbeFn = Callable[[nn.Module, Any], ProbeOutput]
"""``probe_fn(model, batch) -> ProbeOutput``; batches hold tensors whose first dimension is the sample."""


def _check_labels(labels: torch.Tensor, classes: int, who: str) -> None:
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"{who}: labels must be integer class ids, got dtype {labels.dtype}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise ValueError(f"{who}: labels must lie in [0, {classes}) (the logits' last dimension), got "
                         f"[{int(labels.min())}, {int(labels.max())}]")


def classification_probe(logits: torch.Tensor, labels: torch.Tensor) -> ProbeOutput:
    """Cross-entropy, p(label) and normalised entropy from class logits (B, K) and labels (B,)."""
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"classification_probe needs logits (B, K) and labels (B,), got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    _check_labels(labels, logits.shape[-1], "classification_probe")
    logp = torch.log_softmax(logits.float(), dim=-1)
    loss = -logp.gather(-1, labels[:, None]).squeeze(-1)
    with torch.no_grad():
        p = logp.exp()
        entropy = -(p * logp).sum(-1) / math.log(logits.shape[-1])
    return ProbeOutput(loss=loss, confidence=torch.exp(-loss.detach()), entropy=entropy)


def sequence_probe(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> ProbeOutput:
    """Per-sample mean token NLL, mean token probability and mean normalised entropy over the target tokens.

    ``logits`` (B, T, V) and ``labels`` (B, T) must already be aligned (labels[t] is predicted from position t);
    positions equal to ``ignore_index`` (prompt, padding) do not count. Every sample needs a target token.
    """
    if logits.ndim != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"sequence_probe needs logits (B, T, V) and labels (B, T), got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    mask = labels != ignore_index
    _check_labels(labels[mask], logits.shape[-1], "sequence_probe")
    if not bool(mask.any(-1).all()):
        raise ValueError("sequence_probe: every sample needs at least one target token (labels != ignore_index)")
    logp = torch.log_softmax(logits.float(), dim=-1)
    token_logp = logp.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    count = mask.sum(-1)
    loss = -(token_logp * mask).sum(-1) / count
    with torch.no_grad():
        conf = (token_logp.exp() * mask).sum(-1) / count
        token_entropy = -(logp.exp() * logp).sum(-1) / math.log(logits.shape[-1])
        entropy = (token_entropy * mask).sum(-1) / count
    return ProbeOutput(loss=loss, confidence=conf, entropy=entropy)


def sample_uncertainty(confidence: torch.Tensor, entropy: torch.Tensor | None, config: CSPLoRAConfig) -> torch.Tensor:
    """u(x) before normalisation: (1 - c)^gamma, the normalised entropy, or 1 (weighting='none')."""
    confidence = confidence.double()
    if config.weighting == "none":
        return torch.ones_like(confidence)
    if config.weighting == "entropy":
        if entropy is None:
            raise ValueError("weighting='entropy' needs the probe function to return ProbeOutput.entropy")
        return entropy.double().clamp(0.0, 1.0)
    return (1.0 - confidence.clamp(0.0, 1.0)) ** config.gamma


def normalise_weights(u: torch.Tensor) -> torch.Tensor:
    """w = u / mean(u), so the weights average 1; a probe on which the model is certain everywhere (u = 0) falls
    back to equal weights rather than an undefined plan."""
    mean = u.mean()
    return u / mean if float(mean) > 0 else torch.ones_like(u)


@dataclass
class ProbeScores:
    """Everything the probe measured; plans with any weighting / size_norm / kappa are derived from it for free.

    Attributes:
        names: target module names, in model order.
        shapes: name -> (in_features, out_features).
        per_sample: (N, M) float64, s_m(x) for every probe sample and module.
        confidence: (N,) p(y|x); entropy: (N,) normalised entropy or None.
        seconds: wall time of the probe (forward, backward and scoring).
        importance: "fisher" or "taylor", the score in ``per_sample``.
    """

    names: list[str]
    shapes: dict[str, tuple[int, int]]
    per_sample: torch.Tensor
    confidence: torch.Tensor
    entropy: torch.Tensor | None
    seconds: float
    importance: str

    def __post_init__(self) -> None:
        """Refuse scores a plan cannot be made from, naming the culprits: a NaN/inf score would otherwise drop out
        of the softmax (or, everywhere, turn into the flat plan) and silently give a wrong or uniform plan."""
        if not self.names:
            raise ValueError("the probe scored no module: target_modules selected an empty module list")
        n_modules = len(self.names)
        if self.per_sample.dim() != 2 or self.per_sample.shape[1] != n_modules:
            raise ValueError(f"per_sample must be (N, M) with M = {n_modules} modules, "
                             f"got {tuple(self.per_sample.shape)}")
        if self.per_sample.shape[0] == 0:
            raise ValueError("the probe saw 0 samples: give it at least one non-empty batch")
        if self.confidence.shape != (self.per_sample.shape[0],):
            raise ValueError(f"confidence must be (N,) = ({self.per_sample.shape[0]},), "
                             f"got {tuple(self.confidence.shape)}")
        _check_finite_importance(self.names, self.per_sample)
        for what, values in (("confidence", self.confidence), ("entropy", self.entropy)):
            if values is not None and not bool(torch.isfinite(values).all()):
                samples = torch.nonzero(~torch.isfinite(values)).flatten().tolist()
                raise ValueError(f"non-finite {what} for probe sample(s) {samples[:10]}: the model's outputs are NaN "
                                 "or inf there; no plan was made")

    def plan(self, config: CSPLoRAConfig, **metadata: Any) -> RankPlan:
        """The plan for ``config`` (its ``importance`` must match the probe's)."""
        if config.importance != self.importance:
            raise ValueError(f"these scores are '{self.importance}' importances; config asks for '{config.importance}'")
        w = normalise_weights(sample_uncertainty(self.confidence, self.entropy, config))
        raw = (w[:, None] * self.per_sample).mean(0)
        numel = torch.tensor([self.shapes[n][0] * self.shapes[n][1] for n in self.names], dtype=torch.float64)
        score = raw / numel ** {"none": 0.0, "sqrt": 0.5, "numel": 1.0}[config.size_norm]
        _check_finite_importance(self.names, score[None])  # scores edited after the probe, or an overflow
        proportions = _proportions(score, config.kappa)
        ess = float(w.sum() ** 2 / (w ** 2).sum())
        info = {
            "method": "csplora", "config": config.to_dict(), "n_probe": int(len(w)),
            "raw_importance": dict(zip(self.names, raw.tolist())), "score": dict(zip(self.names, score.tolist())),
            "mean_confidence": float(self.confidence.double().mean()), "weight_effective_sample_size": ess,
            "probe_seconds": self.seconds, **metadata,
        }
        return RankPlan(proportions=dict(zip(self.names, proportions.tolist())), shapes=dict(self.shapes),
                        r_min=config.r_min, r_max=config.r_max, alpha_mode=config.alpha_mode,
                        alpha_ratio=config.alpha_ratio, metadata=info)


def _check_finite_importance(names: Sequence[str], values: torch.Tensor) -> None:
    """ValueError naming every module whose column of ``values`` (N, M) holds a NaN or inf."""
    bad = [n for n, ok in zip(names, torch.isfinite(values).all(0).tolist()) if not ok]
    if bad:
        raise ValueError(f"non-finite importance (NaN or inf in the probe's gradient statistics) for {len(bad)} "
                         f"module(s): {bad[:10]}. The probe loss or its gradients are NaN or overflowed (check the "
                         "model's weights, the probe batches and the dtype); no plan was made")


def _proportions(score: torch.Tensor, kappa: float) -> torch.Tensor:
    """pi = score^kappa / sum score^kappa, computed in log space so kappa >> 1 cannot overflow; kappa = 0 (and an
    all-zero score) gives the flat plan."""
    if not bool(torch.isfinite(score).all()):
        raise ValueError(f"module scores must be finite to make a plan, got {score.tolist()}")
    if kappa == 0 or not bool((score > 0).any()):
        return torch.full_like(score, 1.0 / len(score))
    logs = torch.where(score > 0, kappa * score.clamp_min(1e-300).log(), torch.full_like(score, -math.inf))
    return torch.softmax(logs, dim=0)


def _per_sample_linear_scores(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, importance: str) -> torch.Tensor:
    """s(x_b) for every sample b from module inputs x (B, T, d_in) and output gradients g (B, T, d_out)."""
    b, t, d_in = x.shape
    d_out = g.shape[-1]
    if importance == "fisher" and t * (d_in + d_out) < d_in * d_out:
        # ||sum_t g_t x_t^T||_F^2 = sum_{t,s} (g_t . g_s)(x_t . x_s): cheaper than forming the d_out x d_in
        # matrix when the sample has few positions.
        return ((g @ g.transpose(1, 2)) * (x @ x.transpose(1, 2))).sum((1, 2))
    out = torch.empty(b, dtype=x.dtype, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // (d_in * d_out))
    for start in range(0, b, step):
        grad = torch.einsum("bto,bti->boi", g[start:start + step], x[start:start + step])
        out[start:start + step] = (grad.pow(2) if importance == "fisher" else (grad * weight).abs()).sum((1, 2))
    return out


def per_sample_scores(model: nn.Module, batch: Any, probe_fn: ProbeFn, names: Sequence[str],
                      importance: str = "fisher") -> tuple[torch.Tensor, ProbeOutput]:
    """(B, M) per-sample scores of the modules ``names`` (nn.Linear) on one batch, and the detached probe output.

    Hooks keep each module's input (B, ..., d_in) and its output; autograd returns the loss gradient at every
    output, and a module called several times sums its calls. Only the target weights are switched to
    requires_grad during the call (restored after); no parameter gradient is written (.grad stays untouched).
    """
    if len(names) == 0:
        raise ValueError("names is empty: CSPLoRA needs at least one target module to score")
    modules = [model.get_submodule(n) for n in names]
    for name, module in zip(names, modules):
        if not isinstance(module, nn.Linear):
            raise TypeError(f"CSPLoRA scores nn.Linear modules; {name!r} is a {type(module).__name__}")
    records: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in modules]

    def hook_for(i: int):
        def hook(_module, inputs, output):
            records[i].append((inputs[0].detach(), output))
        return hook

    flags = [m.weight.requires_grad for m in modules]
    handles = [m.register_forward_hook(hook_for(i)) for i, m in enumerate(modules)]
    try:
        for m in modules:
            m.weight.requires_grad_(True)
        with torch.enable_grad():
            out = probe_fn(model, batch)
            _check_probe_output(out)
            outputs = [o for rec in records for _, o in rec]
            grads = torch.autograd.grad(out.loss.sum(), outputs, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
        for m, flag in zip(modules, flags):
            m.weight.requires_grad_(flag)
    b = out.loss.shape[0]
    scores = torch.zeros(b, len(modules), dtype=torch.float64)
    k = 0
    for i, (module, rec) in enumerate(zip(modules, records)):
        xs, gs = [], []
        for x, o in rec:
            g = grads[k]
            k += 1
            if g is None:
                continue
            work = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
            xs.append(x.reshape(b, -1, x.shape[-1]).to(work))
            gs.append(g.reshape(b, -1, g.shape[-1]).to(work))
        if xs:
            w = module.weight.detach().to(xs[0].dtype)
            scores[:, i] = _per_sample_linear_scores(torch.cat(xs, 1), torch.cat(gs, 1), w, importance).double().cpu()
    detached = ProbeOutput(out.loss.detach(), out.confidence.detach(),
                           None if out.entropy is None else out.entropy.detach())
    return scores, detached


def _check_probe_output(out: ProbeOutput) -> None:
    """A probe function must return per-sample (B,) losses and confidences for a non-empty batch."""
    if not isinstance(out, ProbeOutput):
        raise TypeError(f"the probe function must return a ProbeOutput, got {type(out).__name__}")
    if out.loss.dim() != 1:
        raise ValueError(f"ProbeOutput.loss must hold one loss per sample, shape (B,), got {tuple(out.loss.shape)} "
                         "(a batch-mean loss cannot be split into per-sample importances)")
    if out.loss.shape[0] == 0:
        raise ValueError("the probe batch is empty (0 samples)")
    for what in ("confidence", "entropy"):
        value = getattr(out, what)
        if value is not None and value.shape != out.loss.shape:
            raise ValueError(f"ProbeOutput.{what} must be (B,) = {tuple(out.loss.shape)}, got {tuple(value.shape)}")


class CSPLoRAPlanner:
    """Probe a model once and produce a :class:`RankPlan` (module -> proportion) for any budget and backend.

    Example::

        planner = CSPLoRAPlanner(CSPLoRAConfig(weighting="focal", gamma=1.0))
        plan = planner.plan(model, probe_batches, probe_fn, target_modules=["q_proj", "v_proj"])
        plan.save("plan.json")
        peft_model = get_peft_model(model, plan.to_peft_config(mean_rank=8, use_dora=True))
    """

    def __init__(self, config: CSPLoRAConfig | None = None, **overrides: Any):
        if config is not None and not isinstance(config, CSPLoRAConfig):
            raise TypeError(f"config must be a CSPLoRAConfig, got {type(config).__name__}")
        self.config = replace(config or CSPLoRAConfig(), **overrides)

    def score(self, model: nn.Module, batches: Iterable[Any], probe_fn: ProbeFn,
              target_modules: Sequence[str] | str) -> ProbeScores:
        """Run the probe: per-sample module scores and confidences on every batch (model in eval mode)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not callable(probe_fn):
            raise TypeError(f"probe_fn must be a function (model, batch) -> ProbeOutput, got {type(probe_fn).__name__}")
        if not target_modules:
            raise ValueError(f"target_modules is empty ({target_modules!r}): name at least one module to plan")
        names = find_target_modules(model, target_modules)
        shapes = {n: (model.get_submodule(n).in_features, model.get_submodule(n).out_features) for n in names}
        was_training = model.training
        model.eval()  # dropout would make the probe random; batch statistics would couple the samples
        start = time.perf_counter()
        parts, conf, ent = [], [], []
        try:
            for batch in batches:
                scores, out = per_sample_scores(model, batch, probe_fn, names, self.config.importance)
                parts.append(scores)
                conf.append(out.confidence.double().cpu())
                ent.append(None if out.entropy is None else out.entropy.double().cpu())
        finally:
            model.train(was_training)
        if not parts:
            raise ValueError("the probe got no batches")
        entropy = None if any(e is None for e in ent) else torch.cat(ent)
        return ProbeScores(names=names, shapes=shapes, per_sample=torch.cat(parts), confidence=torch.cat(conf),
                           entropy=entropy, seconds=time.perf_counter() - start, importance=self.config.importance)

    def plan(self, model: nn.Module, batches: Iterable[Any], probe_fn: ProbeFn,
             target_modules: Sequence[str] | str, **metadata: Any) -> RankPlan:
        """Probe and plan in one call; ``metadata`` is stored in the plan (e.g. the task's name)."""
        scores = self.score(model, batches, probe_fn, target_modules)
        return scores.plan(self.config, model_class=type(model).__name__, **metadata)
