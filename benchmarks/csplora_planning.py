"""How long CSPLoRA's planning takes next to the training it plans, on the claim tasks' own models.

Planning = the probe (one forward and backward pass over the probe set with per-sample scores from hooks) plus
turning the scores into a plan and ranks. It is compared with:
- the per-sample reference loop on the same samples (``reference.py``), to show what batching buys;
- training: the MNIST MLP's whole quick-tier run (measured), and for SmolLM2 the median time of a few LoRA
  training steps at the full tier's batch and rank, times the full tier's step count (an estimate).
Wall and CPU (process) seconds are both recorded: the machine is shared, and CPU time is the steadier number.
Writes one JSON file atomically.

    python benchmarks/csplora_planning.py --models mnist smollm2 --out results/benchmarks/csplora_planning.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Callable


def _timed(fn: Callable[[], object]) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _spec_config(prefix: str, tier: str) -> dict:
    from icml26.methods.csplora.experiments import SPECS

    return dict(next(s for s in SPECS if s.id.startswith(prefix)).tiers[tier])


def bench_model(name: str, repeats: int, train_steps: int, reference_samples: int) -> dict:
    import torch

    from icml26.methods.csplora import CSPLoRAConfig, CSPLoRAPlanner
    from icml26.methods.csplora.experiments import TASKS, train_arm
    from icml26.methods.csplora.plan import RankPlan
    from icml26.methods.csplora.reference import reference_importance

    config = _spec_config("mnist" if name == "mnist" else "smollm2", "quick" if name == "mnist" else "full")
    task = TASKS[config["task"]](config, 0)
    planner_config = CSPLoRAConfig(**config["planner"])
    model = task.make_model()
    n_probe = sum(len(b[-1]) for b in task.probe_batches)

    def plan_once():
        plan = CSPLoRAPlanner(planner_config).plan(model, task.probe_batches, task.probe_fn, task.targets)
        plan.ranks_for_budget(mean_rank=config["mean_rank"])
        return plan

    # Warm-up on one batch: first-call allocations and lazy imports are not planning cost.
    CSPLoRAPlanner(planner_config).plan(model, task.probe_batches[:1], task.probe_fn, task.targets)
    runs = [_timed(plan_once) for _ in range(repeats if name == "mnist" else 1)]
    plan = runs[-1][0]
    plan_wall = statistics.median(r[1] for r in runs)
    plan_cpu = statistics.median(r[2] for r in runs)

    # The reference loop on the first samples only (it is slow on SmolLM2); its cost is linear in the samples.
    ref_batches, left = [], reference_samples
    for b in task.probe_batches:
        if left <= 0:
            break
        ref_batches.append(tuple(t[:left] for t in b))
        left -= len(b[-1])
    n_ref = sum(len(b[-1]) for b in ref_batches)
    names = list(plan.proportions)
    _, ref_wall, ref_cpu = _timed(lambda: reference_importance(model, ref_batches, task.probe_fn, names,
                                                               planner_config))
    ref_wall_full, ref_cpu_full = ref_wall * n_probe / n_ref, ref_cpu * n_probe / n_ref

    row = {"model": name, "task": config["task"], "n_modules": len(names), "n_probe": n_probe,
           "plan_wall_s": plan_wall, "plan_cpu_s": plan_cpu, "reference_samples": n_ref,
           "reference_wall_s_per_probe_set": ref_wall_full, "reference_cpu_s_per_probe_set": ref_cpu_full,
           "batched_speedup_cpu": ref_cpu_full / plan_cpu}
    if name == "mnist":
        plans = {"csplora": plan, "uniform": RankPlan.uniform(plan.shapes)}
        _, train_wall, train_cpu = _timed(lambda: train_arm("csplora", task, plans, config, 0, 3e-3))
        row.update(train_steps=config["steps"], train_wall_s=train_wall, train_cpu_s=train_cpu,
                   train_is_estimate=False)
    else:
        peft = __import__("peft")
        lora = peft.get_peft_model(task.make_model(), plan.to_peft_config(mean_rank=config["mean_rank"]))
        opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)
        gen = torch.Generator().manual_seed(1)
        lora.train()

        def step():
            loss = task.loss(lora, task.batch(0, gen))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        step()
        steps = [_timed(step) for _ in range(train_steps)]
        step_wall = statistics.median(s[1] for s in steps)
        step_cpu = statistics.median(s[2] for s in steps)
        row.update(train_steps=config["steps"], train_step_wall_s=step_wall, train_step_cpu_s=step_cpu,
                   train_wall_s=step_wall * config["steps"], train_cpu_s=step_cpu * config["steps"],
                   train_is_estimate=True)
    row["plan_over_train_cpu"] = row["plan_cpu_s"] / row["train_cpu_s"]
    row["plan_over_train_wall"] = row["plan_wall_s"] / row["train_wall_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mnist", "smollm2"], choices=["mnist", "smollm2"])
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed MNIST planning repeats (median); SmolLM2's probe takes minutes and is timed once")
    parser.add_argument("--train-steps", type=int, default=3, help="timed SmolLM2 training steps (median)")
    parser.add_argument("--reference-samples", type=int, default=16, help="samples run through the reference loop")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: steadier on a shared machine; recorded in the output)")
    parser.add_argument("--out", default="results/benchmarks/csplora_planning.json")
    args = parser.parse_args()

    import torch

    from icml26.core.io import atomic_write_json

    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        print(f"benchmarking {name} ...", file=sys.stderr, flush=True)
        rows.append(bench_model(name, args.repeats, args.train_steps, args.reference_samples))
    atomic_write_json(args.out, {"benchmark": "csplora_planning", "platform": platform.platform(),
                                 "torch_threads": torch.get_num_threads(), "rows": rows})
    for r in rows:
        kind = "estimated" if r["train_is_estimate"] else "measured"
        print(f"{r['model']:8s} {r['n_modules']:4d} modules, {r['n_probe']:4d} probe samples: plan "
              f"{r['plan_cpu_s']:.3f} s CPU ({r['plan_wall_s']:.3f} s wall), reference loop "
              f"{r['reference_cpu_s_per_probe_set']:.2f} s CPU (x{r['batched_speedup_cpu']:.1f}); training "
              f"{r['train_steps']} steps {r['train_cpu_s']:.1f} s CPU ({kind}); plan / train = "
              f"{r['plan_over_train_cpu']:.4f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
