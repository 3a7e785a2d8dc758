"""FedDTL hyperparameters: the paper's defaults (from paper notes) scaled to a tiny CPU dual encoder.

Sources: arXiv 2605.27900 as summarised in ../shared/papers/rl-federated-science.md §2 ([SEC] = paper notes,
[REC] = reconstructed here, no official code exists).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

ACTIONS = ("argmax", "sample")
REFERENCES = ("prob_mixture", "weight_average")
OLD_POLICY = ("round_start", "batch")
KL_ESTIMATORS = ("k3", "exact")


@dataclass
class FedDTLConfig:
    """One federation's settings. Field names follow the paper's symbols where there is one.

    Attributes:
        rounds: T, global rounds (paper 20 [SEC]).
        sft_rounds: M, rounds of the SFT stage before the RL stage (not given in the paper; T/2 [REC]).
        sft_epochs: T_e local epochs in the SFT stage (2 [SEC]).
        rl_epochs: local epochs in the RL stage (3 [SEC]).
        lr: Adam learning rate of the client vision LoRA (1e-3 [SEC]).
        server_lr: Adam learning rate of the server text LoRA (1e-3 [SEC: same optimizer]).
        server_epochs: passes of the server over the uploaded embeddings per round ([REC], 1).
        batch_size: local batch size (64 [SEC]).
        lora_rank: r (4 [SEC]).
        lora_alpha: LoRA scale numerator; the update is (alpha / r) B A ([REC], alpha = r).
        sigma: std of the latent noise added to the image embedding to create RL actions (0.1 [SEC]).
        group_size: G, noisy actions per image (3 [SEC]).
        clip_eps: epsilon of the clipped surrogate (0.2 [SEC]).
        kl_beta: beta of the KL to the hybrid reference (0.5 [SEC]).
        ref_mix: weight of the final-SFT model in the hybrid reference (0.5 [SEC]).
        action: "argmax" of the noisy logits ([REC] default) or "sample" from the noisy softmax.
        reference: "prob_mixture" 0.5 p_SFT + 0.5 p_global ([REC] default) or "weight_average" of the two LoRAs.
        old_policy: the policy in the ratio's denominator: the LoRA at the start of the round ([REC] default, so
            that clipping can act over the local epochs) or the current batch's own detached policy.
        kl_estimator: "k3" (unbiased estimator r - log r - 1 at the sampled actions, [SEC] "unbiased KL") or
            "exact" (full categorical KL, an option).
        renormalize_noisy: renormalise the noisy embedding to the unit sphere before scoring ([REC], False).
        upload_per_class: at most this many image embeddings per class a client uploads (sub-sampling in
            full-data settings [SEC]); 0 uploads all.
        decoupled: server trains the text LoRA on uploaded embeddings (False = FedLoRA-style frozen text tower).
        two_stage: SFT then RL locally (False = SFT in every round).
        text_lora: the server text LoRA exists (False for baselines that never touch the text tower).
    """

    rounds: int = 20
    sft_rounds: int = 10
    sft_epochs: int = 2
    rl_epochs: int = 3
    lr: float = 1e-3
    server_lr: float = 1e-3
    server_epochs: int = 1
    batch_size: int = 64
    lora_rank: int = 4
    lora_alpha: float = 4.0
    sigma: float = 0.1
    group_size: int = 3
    clip_eps: float = 0.2
    kl_beta: float = 0.5
    ref_mix: float = 0.5
    action: str = "argmax"
    reference: str = "prob_mixture"
    old_policy: str = "round_start"
    kl_estimator: str = "k3"
    renormalize_noisy: bool = False
    upload_per_class: int = 0
    decoupled: bool = True
    two_stage: bool = True

    def __post_init__(self) -> None:
        positive_ints = ("rounds", "sft_epochs", "rl_epochs", "batch_size", "lora_rank", "group_size", "server_epochs")
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"FedDTLConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.sft_rounds, int) or not 0 <= self.sft_rounds <= self.rounds:
            raise ValueError(f"FedDTLConfig.sft_rounds must be an int in [0, rounds={self.rounds}], "
                             f"got {self.sft_rounds!r}")
        if not isinstance(self.upload_per_class, int) or self.upload_per_class < 0:
            raise ValueError(f"FedDTLConfig.upload_per_class must be an int >= 0, got {self.upload_per_class!r}")
        for name in ("lr", "server_lr", "lora_alpha"):
            if not getattr(self, name) > 0:
                raise ValueError(f"FedDTLConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("sigma", "kl_beta"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"FedDTLConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"FedDTLConfig.clip_eps must be in (0, 1), got {self.clip_eps!r}")
        if not 0 <= self.ref_mix <= 1:
            raise ValueError(f"FedDTLConfig.ref_mix must be in [0, 1], got {self.ref_mix!r}")
        for name, allowed in (("action", ACTIONS), ("reference", REFERENCES), ("old_policy", OLD_POLICY),
                              ("kl_estimator", KL_ESTIMATORS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"FedDTLConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def stage(self, server_round: int) -> str:
        """"sft" or "rl" for 1-based ``server_round``."""
        return "rl" if self.two_stage and server_round > self.sft_rounds else "sft"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EncoderConfig:
    """Size of the tiny CLIP-style dual encoder and its InfoNCE pretraining ([REC]: built in this room).

    Attributes:
        image_size: side of the RGB input images.
        patch: ViT patch side.
        width: model width of both towers; embed_dim: joint embedding size.
        vision_layers, text_layers, heads: transformer depth and heads.
        steps, batch_size, lr: pretraining schedule (AdamW, cosine decay).
        per_class: clean compositional images generated per class for pretraining.
        use_mnist: add MNIST-5k with digit prompts to the pretraining set.
    """

    image_size: int = 16
    patch: int = 4
    width: int = 48
    embed_dim: int = 48
    vision_layers: int = 4
    text_layers: int = 2
    heads: int = 4
    steps: int = 1500
    batch_size: int = 128
    lr: float = 2e-3
    per_class: int = 32
    use_mnist: bool = True

    def __post_init__(self) -> None:
        for name in ("image_size", "patch", "width", "embed_dim", "vision_layers", "text_layers", "heads", "steps",
                     "batch_size", "per_class"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EncoderConfig.{name} must be a positive int, got {value!r}")
        if self.image_size % self.patch:
            raise ValueError(f"EncoderConfig.patch must divide image_size {self.image_size}, got {self.patch}")
        if self.width % self.heads:
            raise ValueError(f"EncoderConfig.heads must divide width {self.width}, got {self.heads}")
        if not self.lr > 0:
            raise ValueError(f"EncoderConfig.lr must be > 0, got {self.lr!r}")
