"""FedDTL as a Flower application (Message API, flwr >= 1.21): a Strategy, a ServerApp and a ClientApp.

The algorithm lives in reference.py as plain functions; this file only moves tensors in and out of Flower's
records, so a Flower run equals ``reference.run_federation`` for the same seed (tests/methods/test_feddtl.py).

Three things FedDTL needs that plain FedAvg does not (all common Flower questions, see the paper notes §8.2):

* a payload that must NOT be averaged: the image embeddings and labels travel in their own ArrayRecord under the
  key ``"embeddings"``; only the ``"arrays"`` record (the vision LoRA) is averaged;
* server-side training inside ``aggregate_train``: the text LoRA is trained there on the uploaded embeddings and
  the recomputed base-class text embeddings go out in the next round's ``"text"`` record;
* persistent client state: ClientApps are rebuilt for every message, so the client's final-SFT LoRA snapshot (the
  RL stage's hybrid reference) is kept in ``context.state["sft_snapshot"]`` (a RecordDict kept per node by Flower).

Run in Flower's simulation engine (one machine, Ray backend)::

    from icml26.methods.feddtl.flower import run_simulation_federation
    out = run_simulation_federation(encoder, task, FedDTLConfig(rounds=4, sft_rounds=2), seed=0)

Replies that are malformed (an error reply, missing records, wrong shapes, non-finite values, labels outside the
base classes) are rejected with a logged error naming the node and the problem and never reach the aggregate.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Iterable

import torch

from ...core.assets import require
from ...core.io import atomic_write_bytes
from .config import FedDTLConfig
from .data import FederatedTask
from .model import DualEncoder
from .reference import ClientResult, ServerState, build_model, client_drift, client_update, evaluate, init_server, \
    server_update

_FL_INSTALL = "pip install 'icml26[fl]'"
LOG = logging.getLogger("icml26.feddtl.flower")


def _flwr():
    require("flwr", _FL_INSTALL, purpose="the FedDTL Flower application")
    import flwr.app as app
    import flwr.clientapp as clientapp
    import flwr.serverapp as serverapp
    import flwr.serverapp.strategy as strategy
    return app, clientapp, serverapp, strategy


def make_client_app(encoder: DualEncoder, task: FederatedTask, cfg: FedDTLConfig, seed: int):
    """A ``flwr.clientapp.ClientApp`` whose node with ``partition-id`` k trains on ``task``'s client k.

    Train message content: ``"arrays"`` (global vision LoRA), ``"text"`` (``text_emb``: base-class z̄_text),
    ``"config"`` (``server-round``). Reply content: ``"arrays"`` (local vision LoRA), ``"embeddings"``
    (``embeddings`` (m, d) and ``labels`` (m,)), ``"metrics"`` (``num-examples``, ``partition-id``, train stats).
    """
    app_mod, clientapp, _, _ = _flwr()
    ArrayRecord, Message, MetricRecord, RecordDict = (app_mod.ArrayRecord, app_mod.Message, app_mod.MetricRecord,
                                                      app_mod.RecordDict)
    app = clientapp.ClientApp()
    state_dict = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
    enc_cfg = encoder.cfg

    @app.train()
    def train(msg, context):
        torch.set_num_threads(1)
        k = int(context.node_config["partition-id"])
        if not 0 <= k < task.num_clients:
            raise ValueError(f"partition-id {k} is outside the task's {task.num_clients} clients")
        base = DualEncoder(enc_cfg)
        base.load_state_dict(state_dict)
        model = build_model(base, cfg, seed)
        global_vision = msg.content["arrays"].to_torch_state_dict()
        text_emb = msg.content["text"].to_torch_state_dict()["text_emb"]
        server_round = int(msg.content["config"]["server-round"])
        snapshot = context.state["sft_snapshot"].to_torch_state_dict() if "sft_snapshot" in context.state else None
        r = client_update(model, task.client_x[k], task.client_y[k], global_vision, text_emb, cfg, server_round, k,
                          seed, snapshot)
        if r.snapshot is not None:
            context.state["sft_snapshot"] = ArrayRecord(torch_state_dict=r.snapshot)
        metrics = {"num-examples": r.num_examples, "partition-id": k,
                   **{name: float(v) for name, v in r.metrics.items()}}
        content = RecordDict({
            "arrays": ArrayRecord(torch_state_dict=r.vision_lora),
            "embeddings": ArrayRecord(torch_state_dict={"embeddings": r.embeddings, "labels": r.labels}),
            "metrics": MetricRecord(metrics),
        })
        return Message(content=content, reply_to=msg)

    return app


def reply_problem(msg, global_vision: dict, embed_dim: int, n_base: int) -> str | None:
    """Why a train reply Message cannot be aggregated (None if it can); see :func:`content_problem`."""
    if msg.has_error():
        return f"error reply: {msg.error}"
    return content_problem(msg.content, global_vision, embed_dim, n_base)


def content_problem(content, global_vision: dict, embed_dim: int, n_base: int) -> str | None:
    """Why a train reply's RecordDict cannot be aggregated (None if it can): missing records, wrong LoRA names or
    shapes, non-finite tensors, embedding/label mismatch, labels outside ``[0, n_base)``, bad ``num-examples``."""
    for key in ("arrays", "embeddings", "metrics"):
        if key not in content:
            return f"missing record {key!r}"
    try:
        lora = content["arrays"].to_torch_state_dict()
        up = content["embeddings"].to_torch_state_dict()
    except Exception as err:  # a record that cannot be decoded is malformed, whatever the reason
        return f"undecodable arrays: {err}"
    if set(lora) != set(global_vision):
        return f"vision LoRA names differ from the global ones ({sorted(set(lora) ^ set(global_vision))[:4]})"
    for name, t in lora.items():
        if tuple(t.shape) != tuple(global_vision[name].shape):
            return f"vision LoRA {name} has shape {tuple(t.shape)}, expected {tuple(global_vision[name].shape)}"
        if not torch.isfinite(t).all():
            return f"vision LoRA {name} has non-finite values"
    if set(up) != {"embeddings", "labels"}:
        return "embeddings record must hold exactly 'embeddings' and 'labels'"
    emb, lab = up["embeddings"], up["labels"]
    if emb.ndim != 2 or emb.shape[1] != embed_dim or lab.ndim != 1 or len(lab) != len(emb):
        return f"embeddings {tuple(emb.shape)} / labels {tuple(lab.shape)} do not match (m, {embed_dim}) / (m,)"
    if not torch.isfinite(emb).all():
        return "non-finite embeddings"
    if lab.dtype.is_floating_point or (len(lab) and (lab.min() < 0 or lab.max() >= n_base)):
        return f"labels must be integers in [0, {n_base})"
    n = content["metrics"].get("num-examples")
    if not isinstance(n, (int, float)) or not n > 0 or not math.isfinite(n):
        return f"num-examples must be a positive number, got {n!r}"
    return None


def save_server_checkpoint(path: str | Path, state: ServerState, server_round: int) -> None:
    """Atomically write the global vision LoRA, text LoRA, text embeddings and the finished round (safetensors)."""
    from safetensors.torch import save

    tensors = {**{f"vision.{k}": v.contiguous() for k, v in state.vision.items()},
               **{f"text.{k}": v.contiguous() for k, v in state.text.items()},
               "text_emb": state.text_emb.contiguous(), "round": torch.tensor([server_round])}
    atomic_write_bytes(path, save({k: v.detach().clone() for k, v in tensors.items()}))


def load_server_checkpoint(path: str | Path, like: ServerState) -> tuple[ServerState, int]:
    """(state, finished round) from :func:`save_server_checkpoint`; names and shapes must match ``like``."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    vision = {k: t[f"vision.{k}"] for k in like.vision if f"vision.{k}" in t}
    text = {k: t[f"text.{k}"] for k in like.text if f"text.{k}" in t}
    if len(vision) != len(like.vision) or len(text) != len(like.text) or "text_emb" not in t \
            or t["text_emb"].shape != like.text_emb.shape:
        raise ValueError(f"checkpoint {path} does not match this model and task")
    return ServerState(vision, text, t["text_emb"]), int(t["round"][0])


def make_strategy_class():
    """The :class:`FedDTLStrategy` class (built lazily so importing this module does not need flwr)."""
    app_mod, _, _, strategy = _flwr()
    ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict = (
        app_mod.ArrayRecord, app_mod.ConfigRecord, app_mod.Message, app_mod.MessageType, app_mod.MetricRecord,
        app_mod.RecordDict)

    class FedDTLStrategy(strategy.Strategy):
        """Every connected node trains each round; FedAvg of the vision LoRA; server text-LoRA training.

        Args:
            encoder: the pretrained dual encoder (the server keeps its own copy with the text LoRA).
            task: gives the class prompts (base first) and the number of base classes; its test images are used
                only by :meth:`evaluate_fn` (centralised evaluation of the global model).
            cfg, seed: as in ``reference.run_federation``.
            min_nodes: nodes to wait for before the first round of this run; later rounds go to the nodes connected
                then, so a node that is lost (its SuperNode gone, marked offline by the SuperLink) does not stop the
                federation: its pending reply comes back as an error reply and is rejected.
            checkpoint: see :func:`run_simulation_federation`.
            round_timeout: seconds the server waits for the replies of a round (Flower's ``Strategy.start``
                timeout); a node that has not replied by then is recorded in ``rejected`` ("no reply within ...")
                and the round aggregates the others.

        Attributes (the run's record): ``rejected`` (``{"round", "node", "partition", "problem"}`` for every reply
        not aggregated: malformed, an error reply, or none in time), ``participants`` (partition ids aggregated per
        round), ``drift`` (client drift per round).
        """

        def __init__(self, encoder: DualEncoder, task: FederatedTask, cfg: FedDTLConfig, seed: int, min_nodes: int,
                     checkpoint: str | Path | None = None, round_timeout: float = 3600.0):
            if not (isinstance(round_timeout, (int, float)) and round_timeout > 0):
                raise ValueError(f"round_timeout must be a positive number of seconds, got {round_timeout!r}")
            self.cfg, self.seed, self.task, self.min_nodes = cfg, seed, task, min_nodes
            self.round_timeout = float(round_timeout)
            self.outbox: list = []  # this round's train messages (their ids map replies back to nodes)
            self.partition_of: dict[int, int] = {}  # node id -> partition id, from the node's accepted replies
            self.model = build_model(encoder, cfg, seed)
            self.state: ServerState = init_server(self.model, task.prompts)
            self.initial_text = self.state.text_emb.clone()
            self.rejected: list[dict] = []
            self.drift: list[float] = []
            self.participants: list[list[int]] = []
            self.checkpoint = Path(checkpoint) if checkpoint is not None else None
            self.offset = 0  # rounds already done by an earlier, interrupted run (resumed from the checkpoint)
            self.joined = False  # min_nodes reached once
            if self.checkpoint is not None and self.checkpoint.exists():
                self.state, self.offset = load_server_checkpoint(self.checkpoint, self.state)
                LOG.info("resuming FedDTL from %s after round %d", self.checkpoint, self.offset)

        @property
        def remaining_rounds(self) -> int:
            return max(self.cfg.rounds - self.offset, 0)

        def initial_arrays(self):
            return ArrayRecord(torch_state_dict=self.state.vision)

        def configure_train(self, server_round: int, arrays, config, grid) -> Iterable:
            server_round += self.offset
            while not self.joined and len(grid.get_node_ids()) < self.min_nodes:
                time.sleep(0.2)
            self.joined = True
            nodes = sorted(grid.get_node_ids())
            content = RecordDict({
                "arrays": arrays,
                "text": ArrayRecord(torch_state_dict={"text_emb": self.state.text_emb[: self.task.n_base].clone()}),
                "config": ConfigRecord({"server-round": server_round, "stage": self.cfg.stage(server_round)}),
            })
            self.outbox = [Message(content=content, message_type=MessageType.TRAIN, dst_node_id=n) for n in nodes]
            return self.outbox

        def aggregate_train(self, server_round: int, replies: Iterable):
            server_round += self.offset
            results: list[tuple[int, ClientResult]] = []
            dim = self.state.text_emb.shape[1]
            # the grid set each outgoing message's id when it pushed it; error replies made by the SuperLink (node
            # unavailable) come from the SuperLink's own id, so the node is found through reply_to_message_id
            dst = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in self.outbox}
            answered: set[int] = set()
            for msg in replies:
                problem = reply_problem(msg, self.state.vision, dim, self.task.n_base)
                node = dst.get(msg.metadata.reply_to_message_id, int(msg.metadata.src_node_id))
                answered.add(node)
                if problem is not None:
                    self._reject(server_round, node, problem)
                    continue
                c = msg.content
                up = c["embeddings"].to_torch_state_dict()
                m = dict(c["metrics"])
                self.partition_of[node] = int(m["partition-id"])
                results.append((int(m["partition-id"]), ClientResult(
                    c["arrays"].to_torch_state_dict(), int(m["num-examples"]), up["embeddings"], up["labels"], m)))
            for node in sorted(set(dst.values()) - answered):
                self._reject(server_round, node, f"no reply within the round timeout ({self.round_timeout:g} s)")
            if not results:
                LOG.error("round %d: no usable reply, the global state is kept", server_round)
                return None, None
            results.sort(key=lambda kr: kr[0])  # partition order = the plain loop's order (same float sums)
            self.participants.append([k for k, _ in results])
            self.drift.append(client_drift([r for _, r in results], self.state.vision))
            self.state = server_update(self.model, self.state, [r for _, r in results], self.task.prompts,
                                       self.task.n_base, self.cfg, server_round, self.seed)
            if self.checkpoint is not None:
                save_server_checkpoint(self.checkpoint, self.state, server_round)
            n = sum(r.num_examples for _, r in results)
            mean = {key: sum(r.metrics[key] * r.num_examples for _, r in results) / n
                    for key in ("train_accuracy", "reward", "clip_fraction", "kl", "signal_fraction")}
            return ArrayRecord(torch_state_dict=self.state.vision), MetricRecord(
                {**mean, "clients": len(results), "drift": self.drift[-1]})

        def _reject(self, server_round: int, node: int, problem: str) -> None:
            LOG.error("round %d: rejected the reply of node %s (partition %s): %s", server_round, node,
                      self.partition_of.get(node), problem)
            self.rejected.append({"round": server_round, "node": node, "partition": self.partition_of.get(node),
                                  "problem": problem})

        def configure_evaluate(self, server_round: int, arrays, config, grid) -> Iterable:
            return []  # evaluation is centralised (evaluate_fn): the server holds the held-out test set here

        def aggregate_evaluate(self, server_round: int, replies: Iterable):
            return None

        def evaluate_fn(self, server_round: int, arrays):
            return MetricRecord(evaluate(self.model, self.state, self.task))

        def summary(self) -> None:
            LOG.info("FedDTL: %d rounds (%d SFT), decoupled=%s, two_stage=%s", self.cfg.rounds, self.cfg.sft_rounds,
                     self.cfg.decoupled, self.cfg.two_stage)

    return FedDTLStrategy


def make_server_app(strategy, holder: dict):
    """A ``flwr.serverapp.ServerApp`` that runs ``strategy`` for ``cfg.rounds`` rounds; its Result and the strategy
    are put into ``holder`` (the ServerApp runs in the calling process in simulation)."""
    _, _, serverapp, _ = _flwr()
    app = serverapp.ServerApp()

    @app.main()
    def main(grid, context):
        holder["result"] = strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(),
                                          num_rounds=strategy.remaining_rounds, timeout=strategy.round_timeout,
                                          evaluate_fn=None)
        holder["strategy"] = strategy

    return app


def run_simulation_federation(encoder: DualEncoder, task: FederatedTask, cfg: FedDTLConfig, seed: int,
                              client_app=None, checkpoint: str | Path | None = None,
                              round_timeout: float = 3600.0) -> dict:
    """Run FedDTL in Flower's simulation engine with one SuperNode per client of ``task``.

    Returns ``{"final": evaluate(...), "text_shift", "state", "drift", "rejected", "participants", "result"}`` in
    the same form as ``reference.run_federation`` (``client_app`` replaces the default one, e.g. in fault tests).
    With ``checkpoint`` (a .safetensors path) the server state is saved atomically after every round, and a run
    started with an existing checkpoint resumes after its last round (clients' SFT snapshots live in the nodes'
    state and are not part of it: after a restart the global LoRA stands in for a lost snapshot).
    """
    require("ray", "pip install 'flwr[simulation]'", purpose="Flower's simulation engine")
    from flwr.simulation import run_simulation

    strategy = make_strategy_class()(encoder, task, cfg, seed, min_nodes=task.num_clients, checkpoint=checkpoint,
                                     round_timeout=round_timeout)
    holder: dict = {}
    run_simulation(server_app=make_server_app(strategy, holder),
                   client_app=client_app or make_client_app(encoder, task, cfg, seed),
                   num_supernodes=task.num_clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 1, "include_dashboard": False}})
    if "strategy" not in holder:
        raise RuntimeError("the Flower simulation ended without finishing the FedDTL ServerApp (see the log above)")
    st = holder["strategy"]
    final = evaluate(st.model, st.state, task)
    shift = float((1 - (st.state.text_emb.double() * st.initial_text.double()).sum(-1)).mean())
    return {"final": final, "text_shift": shift, "state": st.state, "drift": st.drift, "rejected": st.rejected,
            "participants": st.participants, "result": holder["result"]}
