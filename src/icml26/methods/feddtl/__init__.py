"""FedDTL (arXiv 2605.27900): federated fine-tuning of a CLIP-style model with the text encoder on the server
(trained on client-uploaded image embeddings) and two-stage local training (SFT, then GRPO-style RL).

Public objects: :class:`FedDTLConfig`, :class:`EncoderConfig`, the tiny dual encoder (:func:`load_pretrained`),
the plain algorithm (:func:`run_federation`, :func:`client_update`, :func:`server_update`) and the Flower layer
(:mod:`icml26.methods.feddtl.flower`: ``make_client_app``, ``make_strategy_class``, ``run_simulation_federation``),
the loopback multi-process deployment (:mod:`icml26.methods.feddtl.deploy`: ``run_deployed_federation``,
``icml26 feddtl``) and the frozen-tower baselines (:mod:`icml26.methods.feddtl.baselines`: PromptFL, FedCLIP,
FedMaPLe).
"""

from .config import EncoderConfig, FedDTLConfig
from .data import make_task
from .model import DualEncoder, load_pretrained, pretrain
from .reference import client_update, evaluate, run_federation, server_update, zero_shot

__all__ = ["EncoderConfig", "FedDTLConfig", "DualEncoder", "load_pretrained", "pretrain", "make_task",
           "client_update", "server_update", "evaluate", "run_federation", "zero_shot"]
