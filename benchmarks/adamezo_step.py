"""Step time of MeZO, AdaMeZO (and backprop Adam) on SmolLM2-135M or the tiny LM, arms interleaved in one process.

For each (model, mode, thread count) one model is built and every arm's optimizer steps on it in turn, round
after round, so machine load hits all arms alike; the JSON keeps every step time, the medians, the ratio of the
medians to MeZO and the median of the per-round ratios. AdaMeZO is warmed past its MeZO phase (window + 1
steps), so every timed step is an adaptive one. ``mode="lora"`` is MeZO's --lora setting (r=8, alpha=16 on
q_proj and v_proj, only the LoRA factors perturbed); ``"full"`` perturbs every weight. ``--memory`` adds each
arm's peak RSS, each arm in its own subprocess (``ru_maxrss`` is per process).

    python benchmarks/adamezo_step.py --models smollm2 --modes full lora --threads 1 2 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

ARMS = ("mezo", "adamezo", "adam")

BENCH = {"room": "adamezo", "args": ["--models", "smollm2", "--modes", "lora", "full", "--rounds", "2"],
         "threads_arg": "--threads", "seconds": 180,
         "ratios": {"AdaMeZO / MeZO step, SmolLM2 LoRA-ZO":
                        "runs[mode=lora].rows[arm=adamezo].ratio_to_mezo_of_medians",
                    "AdaMeZO / MeZO step, SmolLM2 full": "runs[mode=full].rows[arm=adamezo].ratio_to_mezo_of_medians"}}


_BASE_MODELS: dict = {}


def build(model_name: str, mode: str):
    """(model, closure, warm-up closure, trainable parameters); the closure is the timed batch loss (4 x 64 tokens
    for SmolLM2), the warm-up closure the loss of a 1 x 8 batch.

    The warm-up steps only have to move AdaMeZO past its MeZO phase (how long an adaptive step takes does not depend
    on the losses it has seen), so they run on the short batch. SmolLM2 is loaded once per process: "full" runs
    before "lora" (``main`` orders them), and LoRA wraps the same base model afterwards.
    """
    import torch

    torch.manual_seed(0)
    if model_name == "tiny":
        from icml26.models.tiny_lm import TinyLM, TinyLMConfig

        model = TinyLM(TinyLMConfig(d_model=128, n_layers=4, n_heads=4, max_seq_len=256))
        ids = torch.randint(0, 256, (8, 256))
        loss_fn = lambda: model(ids[:, :-1], ids[:, 1:])[1]  # noqa: E731
        warm_fn = lambda: model(ids[:1, :8], ids[:1, 1:9])[1]  # noqa: E731
    else:
        from icml26.models.smollm2 import load_smollm2

        if "smollm2" not in _BASE_MODELS:
            _BASE_MODELS["smollm2"] = load_smollm2()[0]
        model = _BASE_MODELS["smollm2"]
        ids = torch.randint(0, model.config.vocab_size, (4, 64))
        loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
        warm_fn = lambda: model(input_ids=ids[:1, :8], labels=ids[:1, :8]).loss  # noqa: E731
    if mode == "lora":
        import peft

        if model_name != "smollm2":
            raise ValueError("mode 'lora' needs a transformers model (--models smollm2)")
        if "smollm2-lora" not in _BASE_MODELS:  # injected once: a second get_peft_model would wrap it again
            _BASE_MODELS["smollm2-lora"] = peft.get_peft_model(
                model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
        model = _BASE_MODELS["smollm2-lora"]
    model.eval()
    return model, loss_fn, warm_fn, [p for p in model.parameters() if p.requires_grad]


def make_step(arm: str, params, window: int):
    """(optimizer, step(closure), warm-up steps): AdaMeZO is warmed past its MeZO phase (window + 1 steps)."""
    import torch

    from icml26.methods.adamezo import AdaMeZO, MeZO

    if arm == "adam":
        opt = torch.optim.Adam(params, lr=1e-5)

        def step(closure):
            opt.zero_grad(set_to_none=True)
            closure().backward()
            opt.step()
        return opt, step, 1
    opt = MeZO(params, lr=1e-7) if arm == "mezo" else AdaMeZO(params, lr=1e-7, window=window)
    return opt, opt.step, (window + 1 if arm == "adamezo" else 1)


def measure(model_name: str, mode: str, arms: list[str], threads: int, rounds: int, window: int) -> dict:
    import torch

    from icml26.harness.bench import finish_machine_info, machine_info

    torch.set_num_threads(threads)
    info = machine_info(threads)
    model, loss_fn, warm_fn, params = build(model_name, mode)
    steps = {}
    for arm in arms:
        opt, steps[arm], warm = make_step(arm, params, window)
        for _ in range(warm):  # past AdaMeZO's MeZO phase, on the short batch
            steps[arm](warm_fn)
        steps[arm](loss_fn)  # one untimed step on the timed batch: first-call allocations at its shapes
    wall = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm in arms:
            start = time.perf_counter()
            steps[arm](loss_fn)
            wall[arm].append(time.perf_counter() - start)
    rows = []
    for arm in arms:
        rows.append({"arm": arm, "step_s_median": statistics.median(wall[arm]), "step_s_all": wall[arm],
                     "ratio_to_mezo_of_medians": statistics.median(wall[arm]) / statistics.median(wall["mezo"]),
                     "ratio_to_mezo_median_per_round": statistics.median(
                         a / b for a, b in zip(wall[arm], wall["mezo"]))})
    finish_machine_info(info)
    return {"model": model_name, "mode": mode, "threads": threads, "rounds": rounds, "window": window,
            "n_trainable": sum(p.numel() for p in params), "machine": info, "rows": rows}


def peak_worker(model_name: str, mode: str, arm: str, window: int) -> dict:
    """Peak RSS of one arm alone (run in its own process)."""
    from icml26.core.memory import current_rss_bytes, optimizer_state_bytes

    _, loss_fn, _, params = build(model_name, mode)
    base = current_rss_bytes()
    opt, step, warm = make_step(arm, params, window)
    for _ in range(warm + 2):
        step(loss_fn)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"model": model_name, "mode": mode, "arm": arm, "peak_rss_bytes": peak, "rss_after_model_bytes": base,
            "optimizer_state_bytes": optimizer_state_bytes(opt)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--arms", nargs="+", default=["mezo", "adamezo"], choices=ARMS)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--memory", action="store_true", help="also each arm's peak RSS, one subprocess per arm")
    parser.add_argument("--out", default="results/benchmarks/adamezo_step.json")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "MODE", "ARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(peak_worker(*args.worker, args.window)))
        return
    if "mezo" not in args.arms:
        raise ValueError("--arms must include mezo: every ratio is to MeZO")
    if any(t < 1 for t in args.threads):
        raise ValueError(f"--threads must be positive, got {args.threads}")

    from icml26.harness.bench import machine_info, write_bench_json

    machine = machine_info(max(args.threads))
    runs = []
    for model_name in args.models:
        # "full" before "lora": LoRA wraps the loaded base model in place (see ``build``).
        modes = sorted(args.modes, key=("full", "lora").index) if model_name == "smollm2" else ["full"]
        for mode in modes:
            for threads in args.threads:
                print(f"benchmarking {model_name} / {mode} / {threads} thread(s) ...", file=sys.stderr, flush=True)
                run = measure(model_name, mode, args.arms, threads, args.rounds, args.window)
                runs.append(run)
                for r in run["rows"]:
                    print(f"{model_name:8s} {mode:5s} threads={threads} {r['arm']:8s} step "
                          f"{r['step_s_median'] * 1e3:8.1f} ms  x{r['ratio_to_mezo_of_medians']:.2f} of MeZO "
                          f"(per-round median x{r['ratio_to_mezo_median_per_round']:.2f})  "
                          f"load {run['machine']['loadavg_start'][0]:.1f}->{run['machine']['loadavg_end'][0]:.1f}",
                          flush=True)
    memory = []
    if args.memory:
        from icml26.core.memory import run_isolated

        for model_name in args.models:
            for mode in (args.modes if model_name == "smollm2" else ["full"]):
                for arm in args.arms:
                    memory.append(run_isolated(__file__, "--worker", model_name, mode, arm,
                                               "--window", str(args.window)))
                    print(f"{model_name:8s} {mode:5s} {arm:8s} peak RSS {memory[-1]['peak_rss_bytes'] / 2**20:.0f} "
                          f"MiB, state {memory[-1]['optimizer_state_bytes']} B", flush=True)
    write_bench_json(args.out, {"benchmark": "adamezo_step", "command": sys.argv, "runs": runs, "memory": memory},
                     machine)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
