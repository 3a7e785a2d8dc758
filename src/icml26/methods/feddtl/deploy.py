"""FedDTL as a real Flower deployment on loopback: one SuperLink and one SuperNode per client, each its own process.

What runs (flwr >= 1.42, the same commands a user types; every address is 127.0.0.1 and every port is free and
chosen at runtime)::

    flower-superlink --insecure --host 127.0.0.1 --port P0 --disable-runtime-dependency-installation
    flower-supernode --insecure --superlink 127.0.0.1:P0 --host 127.0.0.1 --port Pk \
        --node-config 'partition-id=k num-partitions=K state-dir="<workdir>/node-k"'       # k = 0..K-1
    flwr run <workdir>/app loopback --format json      # FLWR_HOME=<workdir>/flwr-home names the connection

The SuperLink starts the ServerApp and each SuperNode a fresh ClientApp process per message (Flower's subprocess
isolation), so the app code must be importable from a Flower App Bundle: :func:`run_deployed_federation` writes a
two-line app (``feddtl_app.py``, which imports :func:`make_deployed_apps`) plus a JSON spec with the encoder file,
the task arguments, the config, the seed and the output paths. The ServerApp runs the same ``FedDTLStrategy`` as
the simulation (flower.py) and writes ``result.json`` and ``state.safetensors`` atomically; the driver waits for
them, and then (also on an error, a timeout, Ctrl-C or SIGTERM) stops every process it started, including the ones
Flower detaches into their own sessions (found by a marker in their environment, Linux /proc; psutil elsewhere).

Restart and resume: with ``checkpoint`` the server writes its global state after every round (flower.py), and each
SuperNode keeps its client's final-SFT LoRA snapshot in ``state-dir`` too (written atomically after each reply), so
a deployment stopped after round t and started again with the same ``checkpoint`` and ``workdir`` continues at
round t + 1 and ends where an uninterrupted run ends (tested; snapshots are only read in RL rounds and only written
in SFT rounds, so a re-run round never sees a snapshot from its own future).

Client mods: ``client_mods=["module:attr", ...]`` wraps every training call in Flower client mods (as
``ClientApp(mods=...)`` would); the fault tests use one to make a client hang inside its app, which Flower sees as a
live, running task (a SIGSTOPped ClientApp sends no task heartbeat, and Flower relaunches a task that had not started
after 30 s, so it is not a hanging client; README "A hanging client").

Command line (also ``icml26 feddtl``)::

    python -m icml26.methods.feddtl.deploy --clients 2 --rounds 2 --sft-rounds 1 --tiny-encoder
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from ...core.assets import require
from ...core.io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_json
from .config import EncoderConfig, FedDTLConfig
from .data import make_task
from .model import DualEncoder

MARKER = "ICML26_FEDDTL_DEPLOY"
"""Environment variable set (to a per-deployment token) in every process a deployment starts; Flower's detached
children inherit it, which is how shutdown finds them."""
MIN_FLWR = "1.42"
_APP_MODULE = "feddtl_app"
_SNAPSHOT = "sft_snapshot.safetensors"


# ---------------------------------------------------------------- the apps (run inside Flower's processes)
def _load_spec(context) -> tuple[dict, DualEncoder, object, FedDTLConfig]:
    """(spec, encoder, task, cfg) from the JSON spec named by the run config (every Flower process rebuilds them:
    the task is deterministic in its arguments, the encoder is a file)."""
    from safetensors.torch import load_file

    spec = read_json(context.run_config["spec"])
    encoder = DualEncoder(EncoderConfig(**spec["encoder_cfg"]))
    encoder.load_state_dict(load_file(spec["encoder"]))
    return spec, encoder.eval(), make_task(**spec["task"]), FedDTLConfig(**spec["cfg"])


def make_deployed_apps():
    """``(server_app, client_app)`` for a deployment; both read the spec named by ``run_config["spec"]``.

    The ClientApp wraps :func:`flower.make_client_app` and persists the node's SFT snapshot in the node's
    ``state-dir`` (node config), so it survives a SuperNode restart. The ServerApp runs ``FedDTLStrategy`` for the
    rounds left after the checkpoint and writes ``result.json`` (metrics, rejections, participants, drift) and
    ``state.safetensors`` (the final global state) into the spec's ``out`` directory, or ``error.txt``.
    """
    require("flwr", "pip install 'icml26[fl]'", purpose="the FedDTL Flower deployment")
    from flwr.app import ArrayRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from safetensors.torch import load_file, save

    from .flower import make_client_app, make_strategy_class, save_server_checkpoint
    from .reference import evaluate

    client_app = ClientApp()

    @client_app.train()
    def train(msg, context):
        torch.set_num_threads(1)
        spec, encoder, task, cfg = _load_spec(context)
        state_dir = context.node_config.get("state-dir")
        snap = Path(str(state_dir)) / _SNAPSHOT if state_dir else None

        def feddtl_train(msg, context):
            if snap is not None and "sft_snapshot" not in context.state and snap.exists():
                context.state["sft_snapshot"] = ArrayRecord(torch_state_dict=load_file(str(snap)))
            reply = make_client_app(encoder, task, cfg, spec["seed"])(msg, context)
            if snap is not None and "sft_snapshot" in context.state:
                tensors = context.state["sft_snapshot"].to_torch_state_dict()
                atomic_write_bytes(snap, save({k: v.contiguous() for k, v in tensors.items()}))
            return reply

        # the spec's mods wrap the training call the way Flower's ClientApp(mods=...) does (first = outermost);
        # they are resolved here because the spec, and so the list, is only known once a message arrives
        handler = feddtl_train
        for ref in reversed(spec.get("client_mods", [])):
            handler = functools.partial(_call_mod, resolve_ref(ref), call_next=handler)
        return handler(msg, context)

    server_app = ServerApp()

    @server_app.main()
    def main(grid, context):
        torch.set_num_threads(1)
        spec, encoder, task, cfg = _load_spec(context)
        out = Path(spec["out"])
        try:
            strategy = make_strategy_class()(encoder, task, cfg, spec["seed"], min_nodes=task.num_clients,
                                             checkpoint=spec["checkpoint"], round_timeout=spec["round_timeout"])
            resumed_after = strategy.offset
            if strategy.remaining_rounds:
                strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(),
                               num_rounds=strategy.remaining_rounds, timeout=strategy.round_timeout,
                               evaluate_fn=None)
            final = evaluate(strategy.model, strategy.state, task)
            shift = float((1 - (strategy.state.text_emb.double() * strategy.initial_text.double()).sum(-1)).mean())
            save_server_checkpoint(out / "state.safetensors", strategy.state, cfg.rounds)
            atomic_write_json(out / "result.json", {
                "final": final, "text_shift": shift, "resumed_after": resumed_after,
                "rejected": strategy.rejected, "participants": strategy.participants, "drift": strategy.drift})
        except BaseException:
            atomic_write_text(out / "error.txt", traceback.format_exc())
            raise

    return server_app, client_app


def resolve_ref(ref: str):
    """The object named by ``"package.module:attribute"`` (imported in the calling process)."""
    if not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":")):
        raise ValueError(f"a client mod must be named as 'module:attribute', got {ref!r}")
    module, attr = ref.split(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"client mod {ref!r} cannot be imported: {err}") from None
    if not callable(obj):
        raise ValueError(f"client mod {ref!r} is not callable")
    return obj


def _call_mod(mod, msg, context, call_next):
    """One link of a Flower mod chain: ``mod(msg, context, call_next) -> reply``."""
    return mod(msg, context, call_next)


# ---------------------------------------------------------------- process orchestration (the driver)
def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that were free on 127.0.0.1 a moment ago (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def marked_pids(token: str) -> set[int]:
    """PIDs of live processes whose environment carries ``MARKER=token`` (never this process)."""
    needle = f"{MARKER}={token}".encode()
    found: set[int] = set()
    proc = Path("/proc")
    if proc.is_dir():
        for d in proc.iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    found.add(int(d.name))
            except OSError:  # gone, a zombie, or not ours: nothing to stop
                continue
        return found
    try:
        import psutil
    except ImportError:
        return found
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(MARKER) == token:
                found.add(p.pid)
        except (psutil.Error, OSError):
            continue
    return found


def stop_processes(procs: list[subprocess.Popen], token: str, grace: float = 5.0) -> None:
    """SIGTERM every process of the deployment (those started here and every marked descendant, including the ones
    Flower detaches into new sessions), SIGKILL what is left after ``grace`` seconds, and reap the direct children."""
    def alive() -> set[int]:
        pids = marked_pids(token) | {p.pid for p in procs if p.poll() is None}
        return {pid for pid in pids if _running(pid)}

    pids = alive()
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (pids := alive()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:  # cannot happen after SIGKILL unless the kernel is stuck; do not hang
            pass
    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline:  # SIGKILLed grandchildren are reaped by init
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """True for a live process that is not a zombie (a zombie is already dead; its parent or init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return not Path("/proc").is_dir()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:  # already gone
        pass


def _checkpoint_round(path: Path) -> int:
    """The finished round recorded in a server checkpoint (0 if there is none yet)."""
    from safetensors import safe_open

    if not path.exists():
        return 0
    with safe_open(str(path), framework="pt") as f:
        return int(f.get_tensor("round")[0])


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "icml26-feddtl"
version = "1.0.0"
description = "FedDTL (icml26 room feddtl) on a loopback Flower deployment"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "icml26"

[tool.flwr.app.components]
serverapp = "{module}:server_app"
clientapp = "{module}:client_app"

[tool.flwr.app.config]
spec = "{spec}"
"""

_FLWR_CONFIG = """[superlink]
default = "loopback"

[superlink.loopback]
address = "127.0.0.1:{port}"
insecure = true
"""


def _check_inputs(encoder, task_args, cfg, seed, timeout, stop_after_round, checkpoint, round_timeout,
                  client_mods=()):
    """Everything that can be wrong with the arguments, raised before any file is written or process started."""
    if not isinstance(encoder, DualEncoder):
        raise TypeError(f"encoder must be a feddtl DualEncoder, got {type(encoder).__name__}")
    if not isinstance(cfg, FedDTLConfig):
        raise TypeError(f"cfg must be a FedDTLConfig, got {type(cfg).__name__}")
    if not isinstance(task_args, dict) or "seed" not in task_args:
        raise ValueError("task_args must be a dict of make_task arguments including 'seed'")
    unknown = set(task_args) - set(inspect.signature(make_task).parameters)
    if unknown:
        raise ValueError(f"task_args has unknown make_task arguments {sorted(unknown)}")
    try:
        json.dumps(task_args)
    except TypeError as err:
        raise ValueError(f"task_args must be JSON values (they travel to other processes): {err}") from None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    for name, value in (("timeout", timeout), ("round_timeout", round_timeout)):
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if stop_after_round is not None:
        if checkpoint is None:
            raise ValueError("stop_after_round needs a checkpoint (otherwise the stopped run cannot be resumed)")
        if not (isinstance(stop_after_round, int) and 1 <= stop_after_round < cfg.rounds):
            raise ValueError(f"stop_after_round must be an int in [1, rounds={cfg.rounds}), got {stop_after_round!r}")
    if isinstance(client_mods, str) or not isinstance(client_mods, (list, tuple)):
        raise TypeError(f"client_mods must be a list of 'module:attribute' names, got {client_mods!r}")
    for ref in client_mods:  # the ClientApp processes import them again; fail here, before anything starts
        resolve_ref(ref)
    task = make_task(**task_args)  # raises ValueError on bad values; also gives the number of clients
    if encoder.cfg.image_size != task.client_x[0].shape[-1]:
        raise ValueError(f"the task's images are {task.client_x[0].shape[-1]} px, the encoder takes "
                         f"{encoder.cfg.image_size} (set task_args['size'])")
    return task


def run_deployed_federation(encoder: DualEncoder, task_args: dict, cfg: FedDTLConfig, seed: int, *,
                            workdir: str | Path | None = None, checkpoint: str | Path | None = None,
                            timeout: float = 600.0, round_timeout: float = 3600.0,
                            stop_after_round: int | None = None, client_mods: list[str] | tuple = ()) -> dict:
    """Run FedDTL on a loopback Flower deployment (a SuperLink and one SuperNode per client, separate processes).

    Args:
        encoder: the pretrained dual encoder (written to ``workdir`` for the Flower processes to load).
        task_args: :func:`data.make_task` keyword arguments including ``seed`` (every process rebuilds the task).
        cfg, seed: as in ``reference.run_federation``.
        workdir: where the app, spec, logs, node state and results go (default: a new temporary directory). Reuse
            it (with ``checkpoint``) to resume a stopped deployment with the clients' SFT snapshots.
        checkpoint: a ``.safetensors`` path for the server state after every round; an existing one is resumed.
        timeout: seconds for the whole deployment; on expiry everything is stopped and ``TimeoutError`` raised.
        round_timeout: seconds the server waits for a round's replies; a client that has not replied by then (a
            hanging ClientApp) is recorded in ``rejected`` and the round aggregates the others.
        stop_after_round: stop (SIGTERM, then SIGKILL, every process) as soon as the checkpoint records this
            round, as a crash would; the return value then has ``"stopped_after"`` and no metrics.
        client_mods: Flower client mods, ``mod(msg, context, call_next) -> reply``, named ``"module:attribute"``
            (importable here and in the ClientApp processes, which inherit this environment, e.g. PYTHONPATH);
            they wrap every training call in this order, first outermost, as ``ClientApp(mods=...)`` would.

    Returns:
        ``{"final", "text_shift", "state" (ServerState), "rejected", "participants", "drift", "resumed_after",
        "lost_nodes", "ports", "workdir", "marker", "seconds"}``, or ``{"stopped_after", "lost_nodes", "ports",
        "workdir", "marker", "seconds"}``. ``lost_nodes``: partition ids whose SuperNode process exited during the
        run (the federation continued without them; their pending replies are in ``rejected``); ``marker``: the
        value of ``MARKER`` in the environment of every process this deployment started.
    """
    task = _check_inputs(encoder, task_args, cfg, seed, timeout, stop_after_round, checkpoint, round_timeout,
                         client_mods)
    require("flwr", "pip install 'icml26[fl]'", purpose="the FedDTL Flower deployment")
    from importlib.metadata import version

    from packaging.version import Version
    from safetensors.torch import save

    if Version(version("flwr")) < Version(MIN_FLWR):  # older SuperLinks take other flags (one gRPC port per API)
        raise RuntimeError(f"the loopback deployment needs flwr>={MIN_FLWR} (its single HTTP port and `flwr run "
                           f"<app> <connection>`), found {version('flwr')}: pip install 'flwr[simulation]>={MIN_FLWR}'")

    from .flower import load_server_checkpoint
    from .reference import build_model, init_server

    start = time.monotonic()
    deadline = start + timeout
    work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="feddtl-deploy-"))
    work = work.resolve()
    out, logs, app = work / "out", work / "logs", work / "app"
    for d in (out, logs, app, work / "flwr-home"):
        d.mkdir(parents=True, exist_ok=True)
    for stale in ("result.json", "error.txt", "state.safetensors"):
        (out / stale).unlink(missing_ok=True)
    ckpt = Path(checkpoint).resolve() if checkpoint is not None else None
    atomic_write_bytes(work / "encoder.safetensors",
                       save({k: v.detach().cpu().contiguous() for k, v in encoder.state_dict().items()}))
    atomic_write_json(work / "spec.json", {
        "encoder": str(work / "encoder.safetensors"), "encoder_cfg": asdict(encoder.cfg), "task": task_args,
        "cfg": cfg.to_dict(), "seed": seed, "checkpoint": str(ckpt) if ckpt else None, "out": str(out),
        "round_timeout": float(round_timeout), "client_mods": list(client_mods)})
    atomic_write_text(app / "pyproject.toml", _PYPROJECT.format(module=_APP_MODULE, spec=work / "spec.json"))
    atomic_write_text(app / f"{_APP_MODULE}.py", "from icml26.methods.feddtl.deploy import make_deployed_apps\n\n"
                      "APPS = make_deployed_apps()\nserver_app = APPS[0]\nclient_app = APPS[1]\n")

    n = task.num_clients
    ports = free_ports(n + 1)
    atomic_write_text(work / "flwr-home" / "config.toml", _FLWR_CONFIG.format(port=ports[0]))
    token = secrets.token_hex(8)
    bindir = Path(sys.executable).parent
    env = {**os.environ, MARKER: token, "FLWR_HOME": str(work / "flwr-home"),
           "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []

    def launch(name: str, args: list[str]) -> subprocess.Popen:
        exe = bindir / args[0]
        if not exe.exists():
            raise RuntimeError(f"{args[0]} not found next to {sys.executable}; install flwr>=1.42 in this "
                               "environment (pip install 'icml26[fl]')")
        with open(logs / f"{name}.log", "ab") as log:
            p = subprocess.Popen([str(exe), *args[1:]], env=env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        procs.append(p)
        return p

    lost: list[int] = []

    def check_alive() -> None:
        """A lost SuperNode is a dropped client (the federation goes on without it); a lost SuperLink, or every
        SuperNode lost, ends the deployment."""
        if procs[0].poll() is not None:
            raise RuntimeError(f"the SuperLink exited with code {procs[0].returncode}; its log ends with:\n"
                               f"{_tail(logs / 'superlink.log')}")
        for k, p in enumerate(procs[1:]):
            if p.poll() is not None and k not in lost:
                lost.append(k)
                print(f"feddtl deployment: supernode-{k} exited with code {p.returncode}; continuing without it",
                      file=sys.stderr)
        if len(procs) == n + 1 and len(lost) == n:
            raise RuntimeError(f"every SuperNode exited; the last log ends with:\n"
                               f"{_tail(logs / f'supernode-{lost[-1]}.log')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the FedDTL deployment did not finish within {timeout:.0f} s (logs in {logs})")

    try:
        launch("superlink", ["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(ports[0]),
                             "--disable-runtime-dependency-installation"])
        while True:  # SuperNodes retry anyway, but a SuperLink that cannot bind should fail fast and clearly
            check_alive()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", ports[0])) == 0:
                    break
            time.sleep(0.2)
        for k in range(n):
            state_dir = work / f"node-{k}"
            state_dir.mkdir(exist_ok=True)
            launch(f"supernode-{k}", ["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{ports[0]}",
                                      "--host", "127.0.0.1", "--port", str(ports[k + 1]), "--node-config",
                                      f'partition-id={k} num-partitions={n} state-dir="{state_dir}"'])
        submit = subprocess.run([str(bindir / "flwr"), "run", str(app), "loopback", "--format", "json"], env=env,
                                capture_output=True, text=True, timeout=max(deadline - time.monotonic(), 1))
        atomic_write_text(logs / "flwr-run.log", submit.stdout + submit.stderr)
        try:
            accepted = json.loads(submit.stdout).get("success") is True
        except ValueError:
            accepted = False
        if submit.returncode != 0 or not accepted:  # `flwr run --format json` reports failures with exit code 0
            raise RuntimeError(f"flwr run did not start the run (exit code {submit.returncode}): "
                               f"{submit.stdout[-1500:]}{submit.stderr[-1000:]}")
        while not (out / "result.json").exists():
            if (out / "error.txt").exists():
                raise RuntimeError(f"the FedDTL ServerApp failed:\n{(out / 'error.txt').read_text()[-3000:]}")
            check_alive()
            if stop_after_round is not None and _checkpoint_round(ckpt) >= stop_after_round:
                return {"stopped_after": _checkpoint_round(ckpt), "lost_nodes": lost, "ports": ports,
                        "workdir": work, "marker": token, "seconds": time.monotonic() - start}
            time.sleep(0.1)
    finally:
        stop_processes(procs, token)
    res = read_json(out / "result.json")
    state, _ = load_server_checkpoint(out / "state.safetensors", init_server(build_model(encoder, cfg, seed),
                                                                             task.prompts))
    return {**res, "state": state, "lost_nodes": lost, "ports": ports, "workdir": work, "marker": token,
            "seconds": time.monotonic() - start}


# ---------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="icml26 feddtl", description="Run FedDTL on a loopback Flower deployment: a "
                                "SuperLink and one SuperNode per client as separate processes on 127.0.0.1.")
    p.add_argument("--clients", type=int, default=2, help="SuperNodes, one per client (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="global rounds T (default 2)")
    p.add_argument("--sft-rounds", type=int, default=1, help="SFT rounds M before the RL stage (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-base", type=int, default=4)
    p.add_argument("--n-novel", type=int, default=3)
    p.add_argument("--train-per-class", type=int, default=8)
    p.add_argument("--tiny-encoder", action="store_true", help="pretrain a tiny encoder for seconds instead of "
                   "loading the room's cached default (built once by python -m icml26.methods.feddtl.model)")
    p.add_argument("--checkpoint", default=None, help="server checkpoint (.safetensors), resumed if it exists")
    p.add_argument("--workdir", default=None, help="app, logs, node state and results (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before everything is stopped")
    p.add_argument("--round-timeout", type=float, default=3600.0, help="seconds the server waits for a round's "
                   "replies; clients that have not replied are recorded and the round goes on without them")
    p.add_argument("--client-mod", action="append", default=[], metavar="MODULE:ATTR", help="a Flower client mod "
                   "wrapping every training call (repeatable; first = outermost; importable here and by the "
                   "ClientApp processes)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .model import load_pretrained, pretrain

    torch.set_num_threads(1)
    try:
        cfg = FedDTLConfig(rounds=args.rounds, sft_rounds=args.sft_rounds, sft_epochs=1, rl_epochs=1, batch_size=16)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.clients < 1:
        print("error: --clients must be at least 1", file=sys.stderr)
        return 2
    encoder = pretrain(TINY_ENCODER, seed=0) if args.tiny_encoder else load_pretrained()
    task_args = {"seed": args.seed, "n_base": args.n_base, "n_novel": args.n_novel, "num_clients": args.clients,
                 "train_per_class": args.train_per_class, "val_per_class": 2, "test_per_class": 4}
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM -> the same clean shutdown as Ctrl-C
    try:
        out = run_deployed_federation(encoder, task_args, cfg, args.seed, workdir=args.workdir,
                                      checkpoint=args.checkpoint, timeout=args.timeout,
                                      round_timeout=args.round_timeout, client_mods=args.client_mod)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: every process of the deployment was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps({"final": out["final"], "participants": out["participants"], "rejected": out["rejected"],
                      "resumed_after": out["resumed_after"], "ports": out["ports"],
                      "seconds": round(out["seconds"], 1), "workdir": str(out["workdir"])}, indent=2))
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


TINY_ENCODER = EncoderConfig(width=16, embed_dim=16, vision_layers=2, text_layers=1, heads=2, steps=15,
                             batch_size=32, per_class=2, use_mnist=False)
"""A dual encoder pretrained in about a second: enough to exercise the deployment, not to be accurate."""

if __name__ == "__main__":
    sys.exit(main())
