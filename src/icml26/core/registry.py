"""Static registry of the 19 rooms (one per ICML 2026 paper).

It is a plain list of records with string import paths, so ``icml26 list`` needs no room and no optional
dependency: rooms are imported only when something is run (torchtune's recipe registry, minus the side effects
of peft's import-time registration).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

STATUSES = ("planned", "partial", "done")
FAMILIES = ("optimizer", "adapter", "planner", "layer", "estimator", "trainer", "probe", "science")


@dataclass(frozen=True)
class RoomEntry:
    """One paper's room.

    Attributes:
        name: snake_case room name, equal to the folder ``icml26/methods/<name>``.
        family: which contract the room's public object follows (see ``FAMILIES``).
        title: the paper title (as far as it is known).
        arxiv: arXiv id, or "" where none is known.
        component: what a user gets, in a few words.
        extras: pip extras the room needs beyond the core (``pip install 'icml26[extra]'``).
        status: "planned" (nothing yet), "partial" (some of the component or claim), "done".
    """

    name: str
    family: str
    title: str
    arxiv: str
    component: str
    extras: tuple[str, ...] = ()
    status: str = "planned"

    @property
    def import_path(self) -> str:
        return f"icml26.methods.{self.name}"

    @property
    def folder(self) -> Path:
        return Path(__file__).resolve().parent.parent / "methods" / self.name

    def to_dict(self) -> dict:
        return {**asdict(self), "extras": list(self.extras), "import_path": self.import_path}


ROOMS: tuple[RoomEntry, ...] = (
    RoomEntry("adamezo", "optimizer", "AdaMeZO: Adam-style zeroth-order optimizer without maintaining the moments",
              "2605.00650", "torch.optim optimizers MeZO and AdaMeZO", ("llm",), "done"),
    RoomEntry("janus_lora", "adapter", "Janus-LoRA: balancing stability and plasticity of LoRA in continual learning",
              "2605.28495", "LoRA adapter with gradient rectification and decoupled margin loss", ("llm",), "done"),
    RoomEntry("annotation_anchoring", "trainer", "Annotations mitigate post-training mode collapse",
              "2605.09995", "annotation-anchored fine-tuning trainer", ("llm",), "done"),
    RoomEntry("fix_attention", "layer", "FiX: introducing fine-grained forget gate into softmax attention",
              "", "FiX/FoX forgetting attention layers", (), "done"),
    RoomEntry("csplora", "planner", "CSPLoRA: confidence-guided structural planning for LoRA",
              "", "per-module LoRA rank planner exporting to PEFT", ("llm",), "done"),
    RoomEntry("dare", "trainer", "DARE: dynamic alignment for relaxation in offline-to-online RL",
              "2511.03828", "offline-to-online RL trainer", ("rl",), "done"),
    RoomEntry("feddtl", "trainer", "FedDTL: decoupled training with local reinforcement fine-tuning in federated learning",
              "2605.27900", "federated vision-language trainer", ("fl", "vision"), "done"),
    RoomEntry("starembed", "science", "StarEmbed: benchmarking time-series foundation models on astronomical light curves",
              "2510.06200", "light-curve embedding benchmark", ("astro", "tabular"), "done"),
    RoomEntry("lokra", "adapter", "LoKRA: low Kruskal-rank adaptation",
              "", "LoKRA and LoKRA+ adapters", ("llm",), "done"),
    RoomEntry("lockin", "probe", "Trajectory lock-in and the drift paradox in fine-tuning",
              "", "fine-tuning trajectory probes", ("llm",), "done"),
    RoomEntry("pgt", "trainer", "PGT: preference goal tuning of goal-conditioned policies",
              "2412.02125", "latent-goal preference tuning trainer", ("rl",), "done"),
    RoomEntry("salaad", "adapter", "SALAAD: sparse and low-rank adaptation via ADMM",
              "2602.00942", "sparse plus low-rank ADMM trainer with budgeted truncation", ("llm",), "done"),
    RoomEntry("kromhc", "layer", "KromHC: Kronecker-product hyper-connections",
              "2601.21579", "HC/mHC/mHC-lite/KromHC residual wrappers", (), "done"),
    RoomEntry("tabicl2", "estimator", "TabICLv2: tabular in-context learning",
              "2602.11139", "scikit-learn in-context tabular estimators", ("tabular",), "done"),
    RoomEntry("scalora", "adapter", "ScaLoRA: optimally scaled low-rank adaptation for efficient high-rank fine-tuning",
              "2510.23818", "merge-and-rescale LoRA adapter", ("llm",), "done"),
    RoomEntry("entropy_rft", "trainer", "On the entropy dynamics in reinforcement fine-tuning of LLMs",
              "2602.03392", "GRPO with entropy-discriminator clipping", ("llm", "rl"), "done"),
    RoomEntry("calm", "science", "CalM: a self-supervised foundation model for calcium imaging population dynamics",
              "2604.04958", "calcium-imaging forecasting model and benchmark", (), "done"),
    RoomEntry("sherpa", "science", "SHERPA: fine-tuning segment-anything models with guidance from a small SAM",
              "", "small-guides-large promptable segmentation fine-tuning", (), "done"),
    RoomEntry("omni_fmri", "science", "Omni-fMRI: an atlas-free voxel-level fMRI foundation model",
              "2601.23090", "dynamic-patching fMRI masked autoencoder", ("neuro",), "done"),
)

_NAME = re.compile(r"^[a-z][a-z0-9_]*[a-z0-9]$")


def _check(rooms: tuple[RoomEntry, ...]) -> None:
    """peft-style checks on the static table: names snake_case and unique, known family and status."""
    seen = set()
    for room in rooms:
        if not _NAME.match(room.name):
            raise ValueError(f"room name {room.name!r} must be snake_case")
        if room.name in seen:
            raise ValueError(f"room name {room.name!r} is registered twice")
        if room.family not in FAMILIES:
            raise ValueError(f"room {room.name!r} has unknown family {room.family!r}; use one of {FAMILIES}")
        if room.status not in STATUSES:
            raise ValueError(f"room {room.name!r} has unknown status {room.status!r}; use one of {STATUSES}")
        seen.add(room.name)


_check(ROOMS)


def get_room(name: str) -> RoomEntry:
    """Look up a room by name; an unknown name raises KeyError listing the known ones."""
    for room in ROOMS:
        if room.name == name:
            return room
    raise KeyError(f"unknown room {name!r}; known rooms: {', '.join(r.name for r in ROOMS)}")


def import_room(name: str) -> ModuleType:
    """Import a room's package (this is where its optional dependencies get imported)."""
    room = get_room(name)
    if room.status == "planned":
        raise LookupError(f"room {name!r} is planned but not implemented yet")
    return importlib.import_module(room.import_path)


def room_card(name: str) -> str:
    """The room's method card (its README.md), or a short stub for planned rooms."""
    room = get_room(name)
    readme = room.folder / "README.md"
    if readme.exists():
        return readme.read_text()
    return (f"# {room.name} ({room.status})\n\nPaper: {room.title}" + (f" (arXiv {room.arxiv})" if room.arxiv else "")
            + f"\n\nComponent: {room.component}\n\nNot implemented yet.\n")
