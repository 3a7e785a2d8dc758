"""Command line: ``icml26 list | show ROOM | reproduce [ROOM ...] | report DIR | bench [ROOM ...]``.

``list`` and ``show`` import no room and no optional dependency.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .core.registry import ROOMS, get_room, room_card


def _cmd_list(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps([room.to_dict() for room in ROOMS], indent=2))
        return 0
    width = max(len(r.name) for r in ROOMS)
    print(f"{'room':<{width}}  {'family':<9}  {'status':<7}  paper")
    for r in ROOMS:
        print(f"{r.name:<{width}}  {r.family:<9}  {r.status:<7}  {r.title}" + (f" (arXiv {r.arxiv})" if r.arxiv else ""))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    print(room_card(args.room))
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from .harness.report import write_report
    from .harness.runner import reproduce

    for name in args.rooms:
        room = get_room(name)
        if room.status == "planned":
            print(f"error: room {name!r} is planned but not implemented yet", file=sys.stderr)
            return 2
    problem = _device_problem(args.device) if args.device else None
    if problem:
        print(f"error: --device {args.device}: {problem}", file=sys.stderr)
        return 2
    problem = _unwritable(Path(args.out))
    if problem:
        print(f"error: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    try:
        results = reproduce(args.rooms or None, args.tier, Path(args.out), n_seeds=args.seeds, force=args.force,
                            spec_ids=args.spec, device=args.device,
                            precision=None if args.dtype == "fp32" else args.dtype, jobs=args.jobs,
                            seed_jobs=args.seed_jobs)
    except ValueError as err:  # an unknown --spec, an unreadable result file: said in one line
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: unfinished results are marked 'cancelled' and resume on the next run", file=sys.stderr)
        return 130
    for r in results:
        print(f"{r['room']}/{r['spec']} [{r['tier']}]: {r['verdict']} ({r['verdict_rule']})")
    if results:
        page, _ = write_report(Path(args.out))
        print(f"report: {page}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _device_problem(name: str) -> str | None:
    """Why torch cannot run on device ``name`` here (None when it can)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as err:
        return str(err)
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available on this machine"
    return None


def _unwritable(out: Path) -> str | None:
    """Why results cannot be written under ``out`` (None when they can), checked before anything runs."""
    if out.exists() and not out.is_dir():
        return "is a file, not a directory"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".icml26-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        return f"cannot be written ({err.strerror or err})"
    return None


def _cmd_report(args: argparse.Namespace) -> int:
    from .harness.report import write_report

    try:
        page, md = write_report(Path(args.dir))
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {page} and {md}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .harness.bench import run_benchmarks, update_cards

    try:
        if args.cards_from:
            for card in update_cards(args.cards_from):
                print(f"wrote {card}")
            return 0
        page, records = run_benchmarks(args.rooms or None, args.threads, Path(args.out), budget_s=args.budget)
        print(f"wrote {page}")
        if args.cards:
            for card in update_cards(Path(args.out) / "bench.json"):
                print(f"wrote {card}")
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0 if all(r["status"] == "ok" for r in records) else 1


def _cmd_feddtl(args: argparse.Namespace) -> int:
    from .methods.feddtl.deploy import main as deploy_main

    return deploy_main(args.args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="icml26", description="ICML 2026 methods and reproductions of their claims")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="list the 19 rooms and their status")
    p.add_argument("--json", action="store_true", help="print a JSON list of room objects")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("show", help="print a room's method card")
    p.add_argument("room", choices=[r.name for r in ROOMS], metavar="ROOM")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("reproduce", help="run the claims of the given rooms (default: all implemented rooms)")
    p.add_argument("rooms", nargs="*", metavar="ROOM", help="room names (default: all implemented)")
    p.add_argument("--tier", choices=["smoke", "quick", "full"], default="quick")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the spec's count for the tier)")
    p.add_argument("--out", default="results", help="results directory (default: results)")
    p.add_argument("--spec", action="append", help="only run this spec id (repeatable)")
    p.add_argument("--force", action="store_true", help="rerun specs whose results are complete")
    p.add_argument("--jobs", type=_positive_int, default=1, help="run this many rooms at once, each in its own "
                   "process with cpu_count / JOBS torch threads (default 1: one after another in this process)")
    p.add_argument("--seed-jobs", type=_positive_int, default=1, help="run this many seeds of a spec at once, "
                   "in SEED_JOBS worker processes with cpu_count / SEED_JOBS torch threads each, after its tuning; "
                   "a room's claims share the workers (seed s in worker s mod SEED_JOBS); rooms that train their "
                   "tuning grid ahead (kromhc, salaad) also train it there, SEED_JOBS at a time (default 1)")
    p.add_argument("--device", default=None, help="torch device the claims run on, e.g. cuda (default: CPU); "
                   "recorded in each result")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="fp32 (default), or mixed "
                   "precision under torch.autocast with fp32 parameters (as Trainer's bf16=True); recorded")
    p.set_defaults(func=_cmd_reproduce)

    p = sub.add_parser("report", help="write DIR/report.html and DIR/report.md from the result files in DIR")
    p.add_argument("dir", metavar="DIR")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("bench", help="run every benchmark script with a BENCH entry (of the given rooms) at each "
                       "thread count and write OUT/BENCH.md, one table of ratios")
    p.add_argument("rooms", nargs="*", metavar="ROOM", help="room names (default: every script with a BENCH entry)")
    p.add_argument("--threads", nargs="+", type=_positive_int, default=[1, 2], help="thread counts (default 1 2)")
    p.add_argument("--out", default="results/benchmarks", help="directory for the JSONs and BENCH.md")
    p.add_argument("--budget", type=float, default=900.0, help="seconds for the whole sweep (default 900)")
    p.add_argument("--cards", action="store_true", help="then write each benchmarked room's rows into its card "
                   "(between its bench markers)")
    p.add_argument("--cards-from", metavar="BENCH_JSON", help="only write the cards' tables from a recorded "
                   "bench.json (runs nothing)")
    p.set_defaults(func=_cmd_bench)

    # prefix_chars "\0": the options after `feddtl` are not icml26's; they go whole to the deployment's own parser
    p = sub.add_parser("feddtl", add_help=False, prefix_chars="\0", help="run FedDTL on a loopback Flower "
                       "deployment (a SuperLink and SuperNodes as processes); `icml26 feddtl --help` for options")
    p.add_argument("args", nargs="*")
    p.set_defaults(func=_cmd_feddtl)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "seeds", None) is not None and args.seeds < 1:
        print("error: --seeds must be at least 1", file=sys.stderr)
        return 2
    for name in getattr(args, "rooms", []) or []:
        try:
            get_room(name)
        except KeyError as err:
            print(f"error: {err.args[0]}", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
