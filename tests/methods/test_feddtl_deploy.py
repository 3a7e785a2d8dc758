"""FedDTL on a real loopback Flower deployment: process orchestration, the README snippet, kill and resume."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from icml26.methods.feddtl.config import FedDTLConfig
from icml26.methods.feddtl.data import make_task
from icml26.methods.feddtl.deploy import (MARKER, TINY_ENCODER, free_ports, marked_pids, run_deployed_federation,
                                          stop_processes)
from icml26.methods.feddtl.model import pretrain
from icml26.methods.feddtl.reference import run_federation

pytestmark = pytest.mark.usefixtures("one_thread")
README = Path(__file__).resolve().parents[2] / "src" / "icml26" / "methods" / "feddtl" / "README.md"
TASK = dict(seed=1, n_base=3, n_novel=2, num_clients=2, train_per_class=6, val_per_class=2, test_per_class=3)


@pytest.fixture(scope="module")
def encoder():
    return pretrain(TINY_ENCODER, seed=0)


def _leftovers(out: dict) -> list[str]:
    """Command lines of live processes that belong to the deployment ``out`` (by marker or by one of its ports)."""
    pids = marked_pids(out["marker"])
    ports = [f"127.0.0.1:{p}" for p in out["ports"]]
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and any(p in cmd for p in ports):
                pids.add(int(d.name))
    return [Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace") for p in pids
            if Path(f"/proc/{p}").exists()]


# ---------------------------------------------------------------- orchestration, no Flower processes (fast)
def test_free_ports_are_distinct_and_bindable():
    import socket
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(1024 <= p < 65536 for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="marker lookup reads /proc")
def test_stop_processes_ends_detached_grandchildren_found_by_marker():
    """Flower starts its SuperExec/ServerApp/ClientApp in new sessions (start_new_session=True), so killing the
    direct children is not enough: a detached grandchild that ignores SIGTERM must be gone after shutdown too."""
    token = "test" + str(os.getpid())
    child_code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                  "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'], "
                  "start_new_session=True); time.sleep(120)")
    env = {**os.environ, MARKER: token}
    child = subprocess.Popen([sys.executable, "-c", child_code], env=env, start_new_session=True)
    deadline = time.monotonic() + 20
    while len(marked_pids(token)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    found = marked_pids(token)
    assert child.pid in found and len(found) == 2
    stop_processes([child], token, grace=1.0)
    assert child.poll() is not None
    assert marked_pids(token) == set()


def test_bad_input_raises_before_anything_is_written_or_started(encoder, tmp_path):
    cfg = FedDTLConfig(rounds=2, sft_rounds=1)
    work = tmp_path / "w"
    bad = [
        (dict(encoder=object(), task_args=TASK, cfg=cfg), TypeError, "DualEncoder"),
        (dict(encoder=encoder, task_args=TASK, cfg={"rounds": 2}), TypeError, "FedDTLConfig"),
        (dict(encoder=encoder, task_args={"n_base": 3}, cfg=cfg), ValueError, "seed"),
        (dict(encoder=encoder, task_args={**TASK, "bogus": 1}, cfg=cfg), ValueError, "bogus"),
        (dict(encoder=encoder, task_args={**TASK, "n_base": 1}, cfg=cfg), ValueError, "n_base"),
        (dict(encoder=encoder, task_args={**TASK, "size": 8}, cfg=cfg), ValueError, "px"),
        (dict(encoder=encoder, task_args=TASK, cfg=cfg, timeout=0), ValueError, "timeout"),
        (dict(encoder=encoder, task_args=TASK, cfg=cfg, client_mods="os:getcwd"), TypeError, "client_mods"),
        (dict(encoder=encoder, task_args=TASK, cfg=cfg, client_mods=["os.getcwd"]), ValueError, "module:attribute"),
        (dict(encoder=encoder, task_args=TASK, cfg=cfg, client_mods=["no_such_module_xyz:f"]), ValueError,
         "cannot be imported"),
        (dict(encoder=encoder, task_args=TASK, cfg=cfg, client_mods=["os:sep"]), ValueError, "not callable"),
        (dict(encoder=encoder, task_args=TASK, cfg=cfg, stop_after_round=1), ValueError, "checkpoint"),
        (dict(encoder=encoder, task_args=TASK, cfg=cfg, stop_after_round=2, checkpoint=tmp_path / "c"), ValueError,
         "stop_after_round"),
    ]
    for kwargs, err, match in bad:
        with pytest.raises(err, match=match):
            run_deployed_federation(seed=0, workdir=work, **kwargs)
    assert not work.exists()


def test_cli_subcommand_reaches_the_deployment_parser(capsys):
    from icml26.cli import main
    assert main(["feddtl", "--clients", "0"]) == 2
    assert "--clients" in capsys.readouterr().err
    assert main(["feddtl", "--rounds", "1", "--sft-rounds", "3"]) == 2
    assert "sft_rounds" in capsys.readouterr().err


# ---------------------------------------------------------------- real processes
def _readme_block() -> str:
    text = README.read_text()
    section = text[text.index("### Loopback deployment"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_deployment_equals_the_plain_loop():
    """The README's deployment snippet, executed verbatim: a SuperLink and 2 SuperNodes as processes, 2 rounds
    (SFT, then RL, which needs each client's SFT snapshot from its SuperNode's persistent state); the result equals
    the plain loop exactly and no process of the deployment is left afterwards."""
    pytest.importorskip("flwr")
    ns: dict = {}
    exec(compile(_readme_block(), str(README), "exec"), ns)
    out = ns["out"]
    assert out["rejected"] == [] and out["participants"] == [[0, 1], [0, 1]] and out["resumed_after"] == 0
    ref = run_federation(ns["encoder"], make_task(**ns["task_args"]), ns["cfg"], seed=5)
    for k, v in ref["state"].vision.items():
        assert torch.allclose(v, out["state"].vision[k], atol=1e-6), k
    assert torch.allclose(ref["state"].text_emb, out["state"].text_emb, atol=1e-6)
    assert out["final"] == pytest.approx(ref["final"], abs=1e-6)
    assert _leftovers(out) == []


@pytest.mark.slow
def test_deployment_killed_after_round_2_resumes_and_equals_an_uninterrupted_run(encoder, tmp_path):
    """3 rounds (2 SFT, then RL). The first deployment is stopped (every process SIGTERM/SIGKILL) as soon as the
    server checkpoint records round 2; a second deployment with the same checkpoint and work directory runs only
    round 3 (RL, so it needs the clients' SFT snapshots, which the SuperNodes kept in their state-dir) and ends
    where the uninterrupted plain loop ends."""
    pytest.importorskip("flwr")
    cfg = FedDTLConfig(rounds=3, sft_rounds=2, sft_epochs=1, rl_epochs=1, batch_size=16, kl_beta=5.0)
    ckpt, work = tmp_path / "server.safetensors", tmp_path / "work"
    first = run_deployed_federation(encoder, TASK, cfg, seed=2, workdir=work, checkpoint=ckpt, stop_after_round=2,
                                    timeout=300)
    assert first["stopped_after"] == 2 and _leftovers(first) == []
    second = run_deployed_federation(encoder, TASK, cfg, seed=2, workdir=work, checkpoint=ckpt, timeout=300)
    assert second["resumed_after"] == 2 and second["participants"] == [[0, 1]]
    ref = run_federation(encoder, make_task(**TASK), cfg, seed=2)
    for k, v in ref["state"].vision.items():
        assert torch.allclose(v, second["state"].vision[k], atol=1e-6), k
    assert torch.allclose(ref["state"].text_emb, second["state"].text_emb, atol=1e-6)
    assert second["final"] == pytest.approx(ref["final"], abs=1e-6)
    assert _leftovers(second) == []


def _processes() -> dict[int, str]:
    """pid -> command line of every live, non-zombie process."""
    procs = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    procs[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    return procs


def _plain(encoder, cfg: FedDTLConfig, seed: int, schedule):
    """The server state after the plain functions run ``schedule``: (round, clients aggregated) pairs."""
    from icml26.methods.feddtl.reference import build_model, client_update, init_server, server_update
    task = make_task(**TASK)
    model = build_model(encoder, cfg, seed)
    state = init_server(model, task.prompts)
    for t, clients in schedule:
        results = [client_update(model, task.client_x[k], task.client_y[k], state.vision,
                                 state.text_emb[:task.n_base], cfg, t, k, seed) for k in clients]
        state = server_update(model, state, results, task.prompts, task.n_base, cfg, t, seed)
    return state


def _fault_run(encoder, tmp_path, fault, **kwargs):
    """A 2-client, 2-round SFT deployment (seed 4) in a thread; ``fault(work)`` runs once round 1 is checkpointed
    (every process that exists then is passed along, so the fault can tell round-2 processes apart)."""
    import threading
    from icml26.methods.feddtl.deploy import _checkpoint_round
    cfg = FedDTLConfig(rounds=2, sft_rounds=2, sft_epochs=1, rl_epochs=1, batch_size=16)
    ckpt, work = tmp_path / "server.safetensors", tmp_path / "work"
    box: dict = {}

    def target():
        try:
            box["out"] = run_deployed_federation(encoder, TASK, cfg, seed=4, workdir=work, checkpoint=ckpt,
                                                 timeout=400, **kwargs)
        except BaseException as err:  # re-raised in the test thread
            box["err"] = err

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + 300
    while _checkpoint_round(ckpt) < 1 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    fault(work, set(_processes()))
    thread.join(timeout=400)
    if "err" in box:
        raise box["err"]
    out = box["out"]
    expected = _plain(encoder, cfg, 4, ((1, (0, 1)), (2, (0,))))
    for k, v in expected.vision.items():
        assert torch.allclose(v, out["state"].vision[k], atol=1e-6), k
    assert torch.allclose(expected.text_emb, out["state"].text_emb, atol=1e-6)
    assert out["participants"] == [[0, 1], [0]] and _leftovers(out) == []
    assert len(out["rejected"]) == 1 and out["rejected"][0]["round"] == 2 and out["rejected"][0]["partition"] == 1
    return out


def _supernode_1(work: Path) -> tuple[int, str]:
    ((pid, cmd),) = [(p, c) for p, c in _processes().items() if "flower-supernode" in c and str(work / "node-1") in c]
    return pid, cmd


@pytest.mark.slow
def test_a_supernode_killed_mid_run_is_dropped_and_the_federation_goes_on(encoder, tmp_path):
    """SIGKILL of SuperNode 1 once round 1 is checkpointed: the SuperLink answers its round-2 message with a "node
    unavailable" error reply after the heartbeat patience (about 60 s), the strategy rejects it naming node and
    partition, and round 2 aggregates client 0 alone, equal to the plain functions doing the same."""
    pytest.importorskip("flwr")
    import signal
    out = _fault_run(encoder, tmp_path, lambda work, _: os.kill(_supernode_1(work)[0], signal.SIGKILL))
    assert out["lost_nodes"] == [1] and "error reply" in out["rejected"][0]["problem"]


_HANG_MOD = """import threading


def hang_partition_1_in_round_2(msg, context, call_next):
    # the ClientApp process stays up and its heartbeat thread keeps Flower's task alive; only the reply never comes
    if int(context.node_config["partition-id"]) == 1 and int(msg.content["config"]["server-round"]) == 2:
        threading.Event().wait()
    return call_next(msg, context)
"""


@pytest.mark.slow
def test_a_hanging_client_is_dropped_after_the_round_timeout(encoder, tmp_path, monkeypatch):
    """Client 1's round-2 training call never returns (a client mod that blocks forever; its ClientApp process and
    SuperNode stay up and keep their heartbeats): after the 45 s round timeout the round aggregates client 0 alone
    and records that partition 1 did not reply in time. The hang is inside the app, not a SIGSTOP of its process:
    Flower treats a frozen process as lost (no task heartbeat) and, if it had not yet pulled its message, launches
    a fresh ClientApp for it 30 s later, which could reply within the timeout (why the SIGSTOP version failed)."""
    pytest.importorskip("flwr")
    (tmp_path / "feddtl_test_faults.py").write_text(_HANG_MOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    out = _fault_run(encoder, tmp_path, lambda work, before: None, round_timeout=45,
                     client_mods=["feddtl_test_faults:hang_partition_1_in_round_2"])
    assert out["lost_nodes"] == [] and "no reply within the round timeout (45 s)" in out["rejected"][0]["problem"]
