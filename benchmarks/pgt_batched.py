"""Cost of one PGT round and one weight fine-tuning round for K tasks: K single-task loops (``pgt.tune_latent``,
a GoalPolicy copy per task with its own Adam) against the batched K-task programs (``pgt.tune_latents``,
``finetune.bc_step``), arms interleaved round after round so machine load hits both alike. Writes JSON with
every time, the medians and the speed-up (CPU process time and wall time).

    python benchmarks/pgt_batched.py --tasks 8 --steps 200 --rounds 3 --out results/benchmarks/pgt_batched.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200, help="DPO / BC steps timed per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/benchmarks/pgt_batched.json")
    args = ap.parse_args()
    if args.tasks < 1 or args.steps < 1 or args.rounds < 1:
        raise ValueError("--tasks, --steps and --rounds must be >= 1")

    import torch

    from icml26.harness.bench import machine_info, write_bench_json
    from icml26.methods.pgt import finetune as ft
    from icml26.methods.pgt.config import PGTConfig
    from icml26.methods.pgt.pgt import tune_latent, tune_latents
    from icml26.methods.pgt import world
    from icml26.methods.pgt.policy import GoalPolicy

    torch.set_num_threads(args.threads)
    machine = machine_info(args.threads)
    torch.manual_seed(0)
    k, horizon = args.tasks, 40
    pol = GoalPolicy()
    gen = torch.Generator().manual_seed(0)
    z_ref = torch.randn(k, 16, generator=gen)
    s, a, r = world.rollout(pol.mean, pol.log_std, z_ref[:, None], world.sample_scenes(k, gen), (k, 50), horizon,
                            gen)
    epochs = max(1, args.steps // 20)  # 20 training pairs per epoch (the script's cap)
    cfg = PGTConfig(epochs=epochs)

    def pgt_loop():
        for j in range(k):
            tune_latent(pol, z_ref[j], s[j], a[j], r[j], cfg, torch.Generator().manual_seed(j))

    def pgt_batched():
        tune_latents(pol, z_ref, s, a, r, cfg, [torch.Generator().manual_seed(j) for j in range(k)])

    idx = torch.randint(50, (args.steps, k), generator=gen)

    def ft_loop():
        for j in range(k):
            m = copy.deepcopy(pol)
            opt = torch.optim.Adam(m.parameters(), lr=1e-3)
            for i in idx[:, j].tolist():
                loss = -m.log_prob(s[j, i:i + 1, :-1], a[j, i:i + 1], z_ref[j]).mean() / horizon
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

    def ft_batched():
        tr, fr = ft.stacked_params(pol, k, "full")
        opt = ft.adam(tr.values(), 1e-3)
        rows = torch.arange(k)
        for step in idx:
            ft.bc_step(tr, fr, opt, s[rows, step, :-1][:, None], a[rows, step][:, None], z_ref[:, None, None])

    arms = {"pgt_loop": pgt_loop, "pgt_batched": pgt_batched, "ft_loop": ft_loop, "ft_batched": ft_batched}
    times = {name: {"cpu_s": [], "wall_s": []} for name in arms}
    for _ in range(args.rounds):
        for name, fn in arms.items():
            c, w = time.process_time(), time.perf_counter()
            fn()
            times[name]["cpu_s"].append(time.process_time() - c)
            times[name]["wall_s"].append(time.perf_counter() - w)
    med = {name: {key: statistics.median(v) for key, v in t.items()} for name, t in times.items()}
    out = {"benchmark": "pgt_batched", "tasks": k, "steps_per_task": epochs * 20, "rounds": args.rounds,
           "threads": args.threads, "times": times, "median": med,
           "speedup_cpu": {"pgt": med["pgt_loop"]["cpu_s"] / med["pgt_batched"]["cpu_s"],
                           "full_ft": med["ft_loop"]["cpu_s"] / med["ft_batched"]["cpu_s"]}}
    write_bench_json(args.out, out, machine)
    print(json.dumps({"median": med, "speedup_cpu": out["speedup_cpu"]}, indent=1))


if __name__ == "__main__":
    main()
