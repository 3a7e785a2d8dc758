"""Overhead of the lock-in probes and the curvature-aware projection relative to one plain Adam step (TinyLM).

The abstract reports "overhead measurements"; this measures ours on CPU, one thread: median seconds of
(a) a plain Adam step, (b) one ``LockInProbe.observe`` call (Hessian and Fisher harm signal, with and without a
window closing), (c) one projected step without and (d) with a basis refresh. Writes one JSON file atomically.

    python benchmarks/lockin_overhead.py --out results/benchmarks/lockin_overhead.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time


BENCH = {"room": "lockin", "args": ["--repeats", "5"], "threads_arg": "--threads",
         "seconds": 15,
         "ratios": {"probe (Hessian) / plain Adam step": "observe_hessian_over_plain_step",
                    "projected step / plain Adam step": "project_step_over_plain_step"}}


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--probe-batch", type=int, default=8)
    parser.add_argument("--fisher-examples", type=int, default=64)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", default="results/benchmarks/lockin_overhead.json")
    args = parser.parse_args()

    import torch

    from icml26.core.io import atomic_write_json
    from icml26.methods.lockin import LockInConfig, LockInProbe, StabilisedFineTuner
    from icml26.models.tiny_lm import TinyLM, TinyLMConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    def lm_loss(model, batch):
        return model(batch[0], batch[1])[1]

    def batch(n: int):
        ids = torch.randint(0, 256, (n, args.seq_len + 1))
        return ids[:, :-1], ids[:, 1:]

    def model():
        torch.manual_seed(0)
        return TinyLM(TinyLMConfig(d_model=args.d_model, n_layers=2, n_heads=4, max_seq_len=args.seq_len))

    task, probe_b, broad = batch(args.batch), batch(args.probe_batch), batch(args.fisher_examples)
    out: dict = {"config": vars(args), "platform": platform.platform(), "torch": torch.__version__}
    plain = StabilisedFineTuner(model(), lm_loss, LockInConfig())
    out["plain_step_s"] = median_time(lambda: plain.step(task), args.repeats)
    for curvature in ("hessian", "fisher"):
        m = model()
        probe = LockInProbe(m, lm_loss, lm_loss, LockInConfig(q=2, window=3, curvature=curvature))
        trainer = StabilisedFineTuner(m, lm_loss, LockInConfig())
        times, closing = [], []
        for i in range(3 * args.repeats + 1):
            trainer.step(task)
            t = time.perf_counter()
            rec = probe.observe(i, m, probe_b, probe_b)
            (closing if "subspace_curvature" in rec else times).append(time.perf_counter() - t)
        out[f"observe_{curvature}_s"] = statistics.median(times[1:])
        out[f"observe_{curvature}_window_close_s"] = statistics.median(closing)
    cfg = LockInConfig(stabiliser="project", project_k=args.k, fisher_examples=args.fisher_examples, refresh_every=0)
    proj = StabilisedFineTuner(model(), lm_loss, cfg, broad_loss=lm_loss, broad_batch=broad)
    out["project_refresh_s"] = median_time(lambda: proj.curvature_basis(), args.repeats)
    proj.step(task)
    out["project_step_s"] = median_time(lambda: proj.step(task), args.repeats)
    for key in ("observe_hessian_s", "observe_fisher_s", "project_step_s", "project_refresh_s"):
        out[key[:-2] + "_over_plain_step"] = out[key] / out["plain_step_s"]
    atomic_write_json(args.out, out)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items() if k != "config"})


if __name__ == "__main__":
    main()
