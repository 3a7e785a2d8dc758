"""Laptop-scale checks of PGT (arXiv 2412.02125) with a goal-conditioned policy pretrained here.

World: the procedural arena of ``world.py`` (a fresh layout of 4 objects and a hazard per task; five task families:
reach, via, collect-in-order, avoid, fetch). Foundation: ``GoalPolicy`` (reference-trajectory encoder + Gaussian
policy) pretrained by behavior cloning on noisy scripted demos of every family (``foundation.py``, shipped
weights), then frozen. A seed's K tasks cycle through the families, each on its own layout; a task's prompt is
one noisy demo whose targets are shifted by N(0, 0.25^2 I) (the GROOT "reference video" that does not quite show
the task). Return R(tau) = mean_t r_t (minus the remaining path length, minus the hazard cost); every arm is
scored on the same 50 fresh rollouts per task (common random numbers). The K tasks of a seed run as one batched
tensor program (exact: ``pgt.tune_latents``, ``finetune.finetune_tasks``).

Arms (same rollout budget per task: ``rounds`` x 50 rollouts; the trained arms take the same number of steps):
* ``pgt``: DPO on z only, the official loop;
* ``prompt``: the original z_ref;
* ``best_of_5``: the best of 5 prompts (each scored on 10 rollouts), the expert-crafted-prompt analogue;
* ``full_ft`` / ``lora`` / ``bitfit`` / ``vera``: one copy of the policy per task, all weights / peft LoRA (r 8,
  alpha 8) / the biases only / peft VeRA (r 64), on the three Linear layers, fine-tuned by behavior cloning on
  the preferred (top 20%) rollouts with z_ref.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import torch

from ...core.logging import log_metrics
from ...harness.spec import Comparator, ExperimentSpec, MechanismCheck
from ...harness.tuning import LogGrid, tune_per_arm
from . import foundation as found
from . import world
from .config import PGTConfig
from .finetune import batched_mean, finetune_tasks, rollout_log_std
from .pgt import pgt_tasks
from .policy import GoalPolicy

ARMS = ("pgt", "prompt", "best_of_5", "full_ft", "lora", "bitfit", "vera")
FT_ARMS = {"full_ft": "full", "lora": "lora", "bitfit": "bitfit", "vera": "vera"}
LR_CENTERS = {"pgt": 1e-2, "full_ft": 1e-3, "lora": 3e-3, "bitfit": 3e-3, "vera": 1e-2}
"""Each trained arm's natural learning-rate scale (grid centre): PGT the script's 1e-2 on z; full fine-tuning
Adam's 1e-3; LoRA and BitFit train far fewer weights and are usually run at a several-fold higher rate than full
fine-tuning (LoRA and BitFit papers), 3e-3; VeRA trains only scaling vectors and its paper runs them at 4e-3 to
1e-2 (higher than LoRA), 1e-2."""
OOD = world.Dynamics(wind=(0.05, 0.02), gain=0.6)
_FOUNDATION: dict[str, GoalPolicy] = {}
_RUNS: dict[str, dict] = {}
_PREPARED: dict[str, dict] = {}


def foundation(config: Mapping[str, Any]) -> GoalPolicy:
    """The frozen foundation policy (one for all seeds, like a released checkpoint): the shipped weights when
    ``cache_foundation`` and they exist for this config, else built (``foundation.load``)."""
    key = found.key(config) + str(config["cache_foundation"])
    if key not in _FOUNDATION:
        _FOUNDATION.clear()
        _FOUNDATION[key] = found.load(config, use_cache=config["cache_foundation"])
    return _FOUNDATION[key]


def tasks(config: Mapping[str, Any], seed: int, n: int | None = None) -> tuple[dict, torch.Generator]:
    """The seed's K tasks (a scene of leading shape (K,), families cycling through all five) and the generator
    that drew them (the prompts are drawn from it next)."""
    gen = torch.Generator().manual_seed(seed)
    return world.sample_scenes(n or config["n_tasks"], gen), gen


def prompt_latents(policy: GoalPolicy, scene: dict, n: int, config: Mapping[str, Any], gen: torch.Generator
                   ) -> torch.Tensor:
    """n prompts per task: encodings of noisy demos (noise ``demo_noise``) whose targets are shifted by
    N(0, prompt_offset^2 I). scene (K,) -> z (K, n, z_dim)."""
    k = scene["family"].shape[0]
    flat = world.perturb(world.flat_scene(scene, (k,), n), config["prompt_offset"], gen)
    ref_obs, _, _ = world.demos(flat, config["horizon"], config["demo_noise"], gen)
    with torch.no_grad():
        return policy.encode(ref_obs).reshape(k, n, -1)


def oracle_latents(policy: GoalPolicy, scene: dict, config: Mapping[str, Any], seed: int) -> torch.Tensor:
    """Encodings of one noiseless demo of each task itself (K, z_dim): the prompt a perfect demonstrator gives."""
    obs, _, _ = world.demos(scene, config["horizon"], 0.0, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return policy.encode(obs)


def _returns(mean_fn, log_std, z: torch.Tensor, scene: dict, shape: tuple, config, dyn, gen) -> torch.Tensor:
    """Mean return per task of rollouts of ``shape`` = (*lead, n): z broadcastable to (*lead, 1, z_dim), scene of
    leading shape broadcastable to lead -> (*lead,)."""
    return world.rollout(mean_fn, log_std, z, scene, shape, config["horizon"], gen, dyn)[2].mean(-1)


def _forgetting(mean_fn, log_std, z_ref, scene, config, dyn, seed) -> torch.Tensor:
    """Returns (K models, K tasks) of policy copy k (tuned on task k) on every task j with task j's own prompt,
    ``forget_rollouts`` each; the same generator for every arm (common random numbers)."""
    k, n = len(z_ref), config["forget_rollouts"]
    gen = torch.Generator().manual_seed(seed * 1000 + 777)
    lead = world.index_scene(scene, (None,))
    return _returns(mean_fn, log_std, z_ref[None, :, None], lead, (k, k, n), config, dyn, gen)


def _rel_forgetting(before: torch.Tensor, after: torch.Tensor) -> float:
    """Mean over k and j != k of (R_before[k, j] - R_after[k, j]) / |R_before[k, j]|: the share of return lost on
    the other tasks by the copy tuned on task k (0 when nothing changed; negative = positive transfer)."""
    k = before.shape[0]
    off = ~torch.eye(k, dtype=torch.bool)
    return float(((before - after) / before.abs())[off].mean()) if k > 1 else float("nan")


def _key(*parts) -> str:
    return json.dumps(parts, sort_keys=True, default=repr)


def run_arms(config: Mapping[str, Any], seed: int, lrs: Mapping[str, float], dyn, arms=None, n_tasks=None) -> dict:
    """The arms (default: the config's ``arms``) on the K tasks of ``seed`` (K = ``n_tasks`` or the config's),
    batched over tasks. Memoised in the process (the forgetting spec reads the in-distribution spec's runs
    instead of repeating them)."""
    arms = tuple(arms or config["arms"])
    key = _key(dict(config), seed, dict(lrs), dyn, list(arms), n_tasks)
    if key in _RUNS:
        return _RUNS[key]
    torch.set_num_threads(1)
    policy = foundation(config)
    scene, gen = tasks(config, seed, n_tasks)
    k = scene["family"].shape[0]
    prompts = prompt_latents(policy, scene, 5, config, gen)
    z_ref = prompts[:, 0]  # (K, z_dim)
    n_eval, horizon = config["eval_rollouts"], config["horizon"]
    before_params = [p.detach().clone() for p in policy.parameters()]
    found_forget = _forgetting(policy.mean, policy.log_std, z_ref, scene, config, dyn, seed)

    def evaluate(mean_fn, log_std, z) -> list[float]:
        eval_gen = torch.Generator().manual_seed(seed * 1000 + 500)  # the same rollout noise for every arm
        return _returns(mean_fn, log_std, z[:, None], scene, (k, n_eval), config, dyn, eval_gen).tolist()

    cfg = PGTConfig(lr=lrs.get("pgt", 1e-2), epochs=config["epochs"], rounds=config["rounds"])
    out, extra = {}, {"held_loss_drop": [], "forgetting": {}, "moved": {}}
    for arm in arms:
        if arm == "prompt":
            out[arm] = evaluate(policy.mean, policy.log_std, z_ref)
        elif arm == "best_of_5":
            sel = torch.Generator().manual_seed(seed * 1000 + 1)
            per_prompt = world.index_scene(scene, (slice(None), None))  # (K, 1): the 5 prompts share a task
            r = _returns(policy.mean, policy.log_std, prompts[:, :, None], per_prompt, (k, 5, 10), config, dyn, sel)
            out[arm] = evaluate(policy.mean, policy.log_std, prompts[torch.arange(k), r.argmax(1)])
        elif arm == "pgt":
            cgen = torch.Generator().manual_seed(seed * 1000 + 300)

            def collect(z):
                return world.rollout(policy.mean, policy.log_std, z[:, None], scene, (k, cfg.n_rollouts), horizon,
                                     cgen, dyn)

            gens = [torch.Generator().manual_seed(seed * 1000 + j) for j in range(k)]
            z, logs = pgt_tasks(policy, z_ref, collect, cfg, gens)
            out[arm] = evaluate(policy.mean, policy.log_std, z)
            extra["held_loss_drop"] = [sum(r["held_loss"][0] - min(r["held_loss"]) for r in task) / len(task)
                                       for task in logs]
            # theta is untouched, so the other tasks keep their own prompts' returns: measured, not assumed
            after = _forgetting(policy.mean, policy.log_std, z_ref, scene, config, dyn, seed)
            extra["forgetting"][arm] = _rel_forgetting(found_forget, after)
        else:
            params = finetune_tasks(policy, FT_ARMS[arm], z_ref, scene, lr=lrs[arm], rounds=cfg.rounds,
                                    n_rollouts=cfg.n_rollouts, steps=cfg.epochs * (cfg.max_train_pairs or 20),
                                    horizon=horizon, dyn=dyn,
                                    gen=torch.Generator().manual_seed(seed * 1000 + 200), seed=seed)

            def mean_fn(x, z, params=params):
                return batched_mean(params, x, z)

            out[arm] = evaluate(mean_fn, rollout_log_std(params), z_ref)
            after = _forgetting(mean_fn, rollout_log_std(params, 3), z_ref, scene, config, dyn, seed)
            extra["forgetting"][arm] = _rel_forgetting(found_forget, after)
            with torch.no_grad():  # how far the copies' action means moved, on the foundation's own observations
                probe, _, _ = world.rollout(policy.mean, policy.log_std, z_ref[:, None], scene, (k, 10), horizon,
                                            torch.Generator().manual_seed(seed), dyn)
                zz = z_ref[:, None, None]
                extra["moved"][arm] = float((mean_fn(probe, zz) - policy.mean(probe, zz)).abs().mean())
        for j, ret in enumerate(out[arm]):
            log_metrics(j, arm=arm, task_return=ret, family=world.FAMILIES[int(scene["family"][j])])
    frozen = all(torch.equal(p, q) for p, q in zip(before_params, policy.parameters()))
    _RUNS[key] = {"returns": out, "extra": extra, "frozen": frozen, "family": scene["family"].tolist()}
    return _RUNS[key]


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _rel(a: list[float], b: list[float]) -> float:
    """Mean over tasks of (R_a - R_b) / |R_b| (returns are negative path lengths: the relative reduction)."""
    return _mean([(x - y) / abs(y) for x, y in zip(a, b)])


def prepare(config: Mapping[str, Any], dyn=world.ID) -> dict:
    """Learning rates for the trained arms on tuning seed 1000 (never reported), mean task return over the
    tier's tasks, 3-point grids (factor 3) around each arm's own scale ``LR_CENTERS``, edge-extended by the
    harness rule. Memoised in the process (the forgetting spec shares the in-distribution tuning)."""
    key = _key(dict(config), dyn)
    if key not in _PREPARED:
        foundation(config)

        def score_fn(arm, lr, seed):
            return _mean(run_arms(config, seed, {arm: lr}, dyn, arms=(arm,))["returns"][arm])

        grids = {arm: LogGrid(center=c) for arm, c in LR_CENTERS.items() if arm in config["arms"]}
        _PREPARED[key] = {"tuning": tune_per_arm(grids, score_fn, mode="max", desc="pgt tuning")}
    return _PREPARED[key]


def _stats(res: dict) -> tuple[dict, dict, dict]:
    r, extra = res["returns"], res["extra"]
    arms = {arm: {"mean_return": _mean(v)} for arm, v in r.items()}
    stats = {"rel_improvement_vs_prompt": _rel(r["pgt"], r["prompt"])}
    if "best_of_5" in r:
        stats["rel_improvement_vs_best_of_5"] = _rel(r["pgt"], r["best_of_5"])
    fam = res.get("family", [])
    for f, name in enumerate(world.FAMILIES):  # reported per family, not judged
        idx = [j for j, x in enumerate(fam) if x == f]
        if idx and "prompt" in r:
            stats[f"rel_improvement_vs_prompt_{name}"] = _rel([r["pgt"][j] for j in idx], [r["prompt"][j] for j in idx])
    forget = extra["forgetting"]
    for arm in FT_ARMS:
        if arm in r:
            stats[f"rel_gain_vs_{arm}"] = _rel(r["pgt"], r[arm])
            stats[f"{arm}_rel_improvement_vs_prompt"] = _rel(r[arm], r["prompt"])
            stats[f"forgetting_{arm}"] = forget[arm]
    stats["forgetting_pgt"] = forget.get("pgt", float("nan"))
    ft = [forget[a] for a in FT_ARMS if a in forget]
    stats["forgetting_gap"] = min(ft) - stats["forgetting_pgt"] if ft else float("nan")
    checks = {"held_loss_drop": _mean(extra["held_loss_drop"]), "policy_frozen": float(res["frozen"]),
              "foundation_follows_prompt": None,
              "ft_moved_policy": min(extra["moved"].values()) if extra["moved"] else float("nan")}
    return arms, stats, checks


def prompt_headroom(config: Mapping[str, Any], seed: int, dyn=world.ID) -> float:
    """Mean over the seed's tasks of (R_oracle - R_prompt) / |R_prompt|, the oracle latent being the encoding of a
    noiseless demo of the task itself and the prompts the run's own z_ref: how much a better latent can gain over
    the prompt (the in-distribution claim asks PGT for 10%, so it needs at least that much room)."""
    policy = foundation(config)
    scene, gen = tasks(config, seed)
    k = scene["family"].shape[0]
    z_ref = prompt_latents(policy, scene, 5, config, gen)[:, 0]
    oracle = oracle_latents(policy, scene, config, seed)
    out = []
    for z in (z_ref, oracle):
        ev = torch.Generator().manual_seed(seed * 1000 + 500)
        out.append(_returns(policy.mean, policy.log_std, z[:, None], scene, (k, config["eval_rollouts"]), config,
                            dyn, ev).tolist())
    return _rel(out[1], out[0])


def _foundation_check(config) -> float:
    """Mean return with a noiseless demo of the task itself as the prompt minus the return of a random z (10
    tasks, two of each family): the foundation policy actually follows its prompt (> 0)."""
    policy = foundation(config)
    scene, gen = tasks(config, 12345, 10)
    oracle = oracle_latents(policy, scene, config, 12345)
    rand = torch.randn(oracle.shape, generator=gen)
    res = []
    for z in (oracle, rand):
        ev = torch.Generator().manual_seed(777)
        res.append(float(_returns(policy.mean, policy.log_std, z[:, None], scene, (10, config["eval_rollouts"]),
                                  config, world.ID, ev).mean()))
    return res[0] - res[1]


def _run(dyn, headroom: bool = False):
    def run(config: Mapping[str, Any], seed: int, prepared: Mapping[str, Any]) -> dict:
        res = run_arms(config, seed, prepared["tuning"]["chosen"], dyn)
        arms, stats, checks = _stats(res)
        checks["foundation_follows_prompt"] = _foundation_check(config)
        if headroom:
            checks["prompt_headroom"] = prompt_headroom(config, seed, dyn)
        return {"arms": arms, "statistics": stats, "checks": checks,
                "curves": {arm: [[k, v] for k, v in enumerate(vals)] for arm, vals in res["returns"].items()}}
    return run


def plot_returns(result: dict, ax) -> None:
    from ...harness.plots import plot_mean_curves

    plot_mean_curves(result, ax, xlabel="task index (families cycle reach, via, collect, avoid, fetch)",
                     ylabel="return -remaining path (50 rollouts)")


def _tier(**kw: Any) -> dict:
    cfg = {"horizon": 40, "pretrain_steps": 2000, "z_dim": 16, "hidden": 128, "cache_foundation": True, "n_tasks": 10,
           "prompt_offset": 0.3, "demo_noise": 0.3, "eval_rollouts": 50, "forget_rollouts": 20, "epochs": 50,
           "rounds": 2, "arms": list(ARMS)}
    return {**cfg, **kw}


_SMOKE = _tier(pretrain_steps=20, cache_foundation=False, horizon=10, hidden=32, z_dim=8, n_tasks=2,
               eval_rollouts=5, forget_rollouts=3, epochs=2, rounds=1)
# quick: 20 epochs per round (the script's 50 in the full tier) and the PEFT arms OOD only in the full tier, for the
# 3-minute budget; every trained arm keeps PGT's step count
_QUICK, _FULL = _tier(epochs=20), _tier(n_tasks=20)
_QUICK_OOD = _tier(epochs=20, arms=["pgt", "prompt", "best_of_5", "full_ft"])
_SEEDS = {"smoke": 1, "quick": 4, "full": 6}
_CHECKS = (MechanismCheck("held_loss_drop", ">", 0.0, "DPO lowered the held-out preference loss below its value "
                          "at z_ref (mean over tasks and rounds)"),
           MechanismCheck("policy_frozen", ">=", 1.0, "no foundation weight changed during PGT"),
           MechanismCheck("foundation_follows_prompt", ">", 0.05, "the foundation policy does a demo's task better "
                          "than with a random latent (mean remaining path at least 0.05 shorter)"))
_HEADROOM = MechanismCheck("prompt_headroom", ">=", 0.10, "a noiseless demo of the task as the prompt (an oracle "
                           "latent) beats the given prompt by at least the claimed 10%: a better z exists")
_MOVED = MechanismCheck("ft_moved_policy", ">", 0.01, "every weight fine-tuning arm moved the policy's action "
                        "means (mean |delta mu| on the foundation's own states > 0.01 for the least-moved arm)")

SPECS = [
    ExperimentSpec(
        id="pgt_in_distribution", room="pgt",
        claim="Tuning only the latent goal with DPO on trajectory preferences improves a frozen goal-conditioned "
              "policy over its original prompt (72% / 81.6% relative improvement in Minecraft)",
        paper_ref="arXiv 2412.02125, abstract and project page (SkillForge, GROOT / STEVE-1)",
        metric="return -mean_t (remaining path + hazard cost) over 50 rollouts per task; relative improvement "
               "over the prompt",
        arms=ARMS, baseline="prompt",
        comparator=Comparator("rel_improvement_vs_prompt", ">=", 0.1,
                              "mean over tasks of (R_pgt - R_prompt) / |R_prompt| >= 0.10 (10% shorter mean "
                              "remaining path than with the original prompt)"),
        run=_run(world.ID, headroom=True), prepare=prepare, plot=plot_returns, checks=_CHECKS + (_HEADROOM,),
        null_value=0.0, tiers={"smoke": _SMOKE, "quick": _QUICK, "full": _FULL}, seeds=_SEEDS,
        notes="Procedural 2-D arena with five task families instead of Minecraft; MLP encoder over a subsampled "
              "reference trajectory instead of GROOT's video encoder; pair caps 20/10 as in the released script; "
              "10 tasks per seed (2 per family), 20 epochs per round in the quick tier (50 in the full tier).",
    ),
    ExperimentSpec(
        id="pgt_vs_finetune_ood", room="pgt",
        claim="Under changed dynamics PGT beats full fine-tuning of the policy on the same preference data "
              "(+13.4% in Minecraft OOD environments), without touching the policy",
        paper_ref="arXiv 2412.02125, abstract (OOD execution environments)",
        metric="return under wind (0.05, 0.02) and actuator gain 0.6; relative gain of PGT over full fine-tuning",
        arms=ARMS, baseline="full_ft",
        comparator=Comparator("rel_gain_vs_full_ft", ">", 0.0,
                              "mean over tasks of (R_pgt - R_full_ft) / |R_full_ft| > 0"),
        run=_run(OOD), prepare=lambda c: prepare(c, OOD), plot=plot_returns, checks=_CHECKS + (_MOVED,),
        null_value=0.0, tiers={"smoke": _SMOKE, "quick": _QUICK_OOD, "full": _FULL}, seeds=_SEEDS,
        notes="Full fine-tuning = behavior cloning of all weights on the top 20% rollouts per round (the brief's "
              "baseline), not DPO on the weights; LoRA, BitFit and VeRA gains (rel_gain_vs_lora / _bitfit / _vera) at "
              "the full tier.",
    ),
    ExperimentSpec(
        id="pgt_no_forgetting", room="pgt",
        claim="PGT forgets nothing (theta is never touched), while fine-tuning the policy's weights on one task "
              "costs return on the other tasks",
        paper_ref="arXiv 2412.02125, abstract (continual learning: one latent per task, no forgetting)",
        metric="share of return lost on the other tasks (their own prompts, 20 rollouts) by the copy tuned on "
               "task k, mean over k; gap = the least-forgetting weight fine-tuning arm minus PGT",
        arms=ARMS, baseline="full_ft",
        comparator=Comparator("forgetting_gap", ">=", 0.05,
                              "min over full_ft / lora / bitfit / vera of the relative return lost on the other tasks, "
                              "minus PGT's, >= 0.05"),
        run=_run(world.ID), prepare=prepare, plot=plot_returns, checks=_CHECKS + (_MOVED,),
        null_value=0.0, tiers={"smoke": _SMOKE, "quick": _QUICK, "full": _FULL}, seeds=_SEEDS,
        notes="Same runs as pgt_in_distribution (memoised in one process). A fine-tuning user who stores one "
              "LoRA / BitFit / VeRA adapter per task forgets nothing either; the claim is against one shared set of "
              "weights updated per task.",
    ),
]
