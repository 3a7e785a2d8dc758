"""Cost of DARE's per-update alignment score with each behavior model (Gaussian BC, CVAE, diffusion with and without
energy guidance), interleaved round by round so machine load hits every model alike.

One call = the ``kl_mean`` score of a batch (K reference draws per state; the diffusion model runs T reverse steps
on K x B rows, guidance adds a critic backward per step) or the ``nll`` score (the diffusion model's ELBO proxy
runs T x 4 noise-network passes). The JSON keeps every call time, the medians and their ratio to Gaussian BC.

    python benchmarks/dare_behavior_cost.py --rounds 20 --out results/benchmarks/dare_behavior_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import time

BENCH = {"room": "dare", "args": ["--rounds", "10"], "threads_arg": "--threads", "seconds": 10,
         "ratios": {"diffusion / Gaussian kl_mean score (B 256, K 10, T 10)":
                        "rows[model=diffusion,score=kl_mean].ratio_to_gaussian",
                    "guided diffusion / Gaussian kl_mean score":
                        "rows[model=diffusion_guided,score=kl_mean].ratio_to_gaussian"}}

MODELS = ("gaussian", "cvae", "diffusion", "diffusion_guided")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/benchmarks/dare_behavior_cost.json")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.batch < 2:
        raise ValueError("--rounds must be >= 1 and --batch >= 2")
    import torch

    from icml26.harness.bench import machine_info, write_bench_json
    from icml26.methods.dare.dare import alignment_score
    from icml26.methods.dare.trainer import _EnergyGuided
    from icml26.rl.nets import CVAE, DiffusionBehavior, GaussianPolicy, TwinQ

    torch.set_num_threads(args.threads)
    machine = machine_info(args.threads)
    torch.manual_seed(0)
    obs_dim, act_dim = 11, 3  # Hopper
    critic = TwinQ(obs_dim, act_dim, args.hidden, 2)
    diffusion = DiffusionBehavior(obs_dim, act_dim, args.hidden, 2, n_steps=10)
    models = {"gaussian": GaussianPolicy(obs_dim, act_dim, args.hidden, 2),
              "cvae": CVAE(obs_dim, act_dim, args.hidden, 2), "diffusion": diffusion,
              "diffusion_guided": _EnergyGuided(diffusion, lambda s, a: torch.min(*critic(s, a)), 0.5)}
    obs, act = torch.randn(args.batch, obs_dim), torch.rand(args.batch, act_dim) * 2 - 1
    gen = torch.Generator().manual_seed(0)
    times = {(m, s): [] for m in MODELS for s in ("kl_mean", "nll")}
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for (m, s), ts in times.items():
            t0 = time.perf_counter()
            alignment_score(models[m], obs, act, s, 10, gen)
            ts.append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    rows = [{"model": m, "score": s, "median_ms": 1e3 * med[(m, s)], "ratio_to_gaussian": med[(m, s)] /
             med[("gaussian", s)], "times_ms": [1e3 * t for t in times[(m, s)][1:]]} for m, s in times]
    write_bench_json(args.out, {"benchmark": "dare_behavior_cost", "rounds": args.rounds, "batch": args.batch,
                                "hidden": args.hidden, "K": 10, "T": 10, "rows": rows}, machine,
                     threads=args.threads)
    for r in rows:
        print(f"{r['model']:>17} {r['score']:>8}: {r['median_ms']:7.2f} ms  x{r['ratio_to_gaussian']:.1f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
