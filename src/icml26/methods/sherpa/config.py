"""SHERPA options. No code and no full paper text are public: the abstract names the parts (a small SAM fine-tuned on
the task guides the large SAM's fine-tuning; Fisher Ratio Separation (FRS) keeps task-relevant features; Guiding
Feature Extraction (GFE) takes representative guiding features from the small model) and the ICLR 2026 reviews add
that GFE uses Q.K products (attention) of the small model, FRS uses Fisher ratios with m samples and a subspace of
size k, and the guidance is a KL-divergence regulariser. Everything below is a reconstruction (RECON) exposed as an
option; defaults come from the room notes (shared/papers/rl-federated-science.md, Sec. 6.2)."""

from __future__ import annotations

from dataclasses import dataclass, field

FRS_FEATURES = ("qk", "hidden", "random")
UPDATES = ("lora", "full", "decoder")


@dataclass
class SherpaConfig:
    """The guided fine-tuning objective of the large model:
    L = L_seg + lambda_g * KL(G_S || A_L^U) + lambda_p * ||Delta W_{q,k}[U_perp]||^2,
    with G_S the fine-tuned small model's head-averaged attention at ``small_layer`` (GFE), U the top-k channels of
    the large model's queries/keys at ``large_layer`` by Fisher ratio between foreground and background tokens (FRS),
    and A_L^U = softmax(Q_L[:, U] K_L[:, U]^T / sqrt(k)) the large model's attention restricted to U.

    ``lambda_g = 0``, ``lambda_p = 0`` and ``lambda_sp = 0`` is plain fine-tuning (LoRA or full, by ``update``); ``k_frac = 1`` is
    attention distillation on all channels (no FRS).
    """

    lambda_g: float = field(default=0.3, metadata={"help": "guidance weight (RECON: notes suggest 0.1-1, tuned)"})
    k_frac: float = field(default=0.25, metadata={
        "help": "fraction of query/key channels kept by FRS (RECON: notes suggest 10-25%; reviews: per-dataset k)"})
    m_samples: int = field(default=64, metadata={
        "help": "m, task images whose tokens estimate the Fisher ratios (RECON; reviews name m)"})
    frs_features: str = field(default="qk", metadata={
        "help": "'qk': Fisher ratio of each query and key channel (score = FR_q + FR_k); 'hidden': of the layer's "
                "input features; 'random': a random channel subset of the same size (ablation)"})
    lambda_p: float = field(default=0.0, metadata={
        "help": "L2 on the query/key update outside U at the guided layer (RECON, optional third term; 0 = off)"})
    large_layer: int = field(default=-1, metadata={"help": "guided layer of the large encoder (RECON: last)"})
    small_layer: int = field(default=-1, metadata={"help": "guiding layer of the small encoder (RECON: last)"})
    update: str = field(default="lora", metadata={
        "help": "'lora': LoRA on the encoder's qkv and projections plus a trainable mask decoder (SAM-PEFT style); "
                "'full': every weight; 'decoder': the image encoder frozen, neck, prompt encoder and mask decoder "
                "trained (decoder-only baseline)"})
    lambda_sp: float = field(default=0.0, metadata={
        "help": "L2-SP weight (Li et al. 2018): lambda_sp * sum ||theta - theta_0||^2 over the trainable weights, "
                "theta_0 the pretrained values (a baseline, not part of SHERPA; 0 = off)"})
    lora_rank: int = field(default=4, metadata={"help": "LoRA rank (notes: r = 4)"})

    def __post_init__(self) -> None:
        if not self.lambda_g >= 0:
            raise ValueError(f"lambda_g must be >= 0, got {self.lambda_g!r}")
        if not self.lambda_p >= 0:
            raise ValueError(f"lambda_p must be >= 0, got {self.lambda_p!r}")
        if not self.lambda_sp >= 0:
            raise ValueError(f"lambda_sp must be >= 0, got {self.lambda_sp!r}")
        if not 0 < self.k_frac <= 1:
            raise ValueError(f"k_frac must be in (0, 1], got {self.k_frac!r}")
        if not (isinstance(self.m_samples, int) and self.m_samples >= 2):
            raise ValueError(f"m_samples must be an integer >= 2, got {self.m_samples!r}")
        if self.frs_features not in FRS_FEATURES:
            raise ValueError(f"frs_features must be one of {FRS_FEATURES}, got {self.frs_features!r}")
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {self.update!r}")
        if not (isinstance(self.lora_rank, int) and self.lora_rank >= 1):
            raise ValueError(f"lora_rank must be a positive integer, got {self.lora_rank!r}")
