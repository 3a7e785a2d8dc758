"""TabICLv2 options. Paper/official defaults were read from soda-inria/tabicl at commit
8f1aa2098c894ab91dba15209cf2002ba4be6c6c (``src/tabicl/_model/tabicl.py``, ``ssmax.py``, ``layers.py``,
``train/_muon.py``); the *defaults of this dataclass* are the small size that pretrains on 2 CPU cores here.
The official value of every shrunk field is given in its help text."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SSMAX_TYPES = ("none", "ssmax", "qassmax")


@dataclass
class TabICLConfig:
    """Architecture of the three-stage model (column -> row -> in-context)."""

    max_classes: int = field(default=10, metadata={
        "help": "logits of the head (official: 10); 0 makes a regressor that predicts num_quantiles quantiles "
                "(official convention, ``max_classes=0``)"})
    num_quantiles: int = field(default=999, metadata={
        "help": "regression only: quantiles at levels linspace(0, 1, Q + 2)[1:-1] (official: 999)"})
    embed_dim: int = field(default=32, metadata={"help": "E, cell/column embedding width (official: 128)"})
    col_num_blocks: int = field(default=1, metadata={"help": "induced set attention blocks (official: 3)"})
    col_nhead: int = field(default=4, metadata={"help": "heads in the column stage (official: 8)"})
    col_num_inds: int = field(default=16, metadata={"help": "inducing points per block (official: 128)"})
    feature_group_size: int = field(default=3, metadata={
        "help": "features per group; group j = (x_{j+1}, x_{j+2}, x_{j+4}) mod H (official: 3, shifts 2^i)"})
    row_num_blocks: int = field(default=2, metadata={"help": "row transformer blocks (official: 3)"})
    row_nhead: int = field(default=4, metadata={"help": "heads in the row stage (official: 8)"})
    row_num_cls: int = field(default=4, metadata={"help": "CLS tokens concatenated into the row vector (official: 4)"})
    rope_base: float = field(default=1e5, metadata={"help": "RoPE base over feature positions (official: 1e5)"})
    icl_num_blocks: int = field(default=3, metadata={"help": "in-context blocks, width E*row_num_cls (official: 12)"})
    icl_nhead: int = field(default=4, metadata={"help": "heads in the in-context stage (official: 8)"})
    ff_factor: int = field(default=2, metadata={"help": "feed-forward width / model width (official: 2)"})
    ssmax: str = field(default="qassmax", metadata={
        "help": "query scaling in ICL blocks and ISAB step A: none | ssmax | qassmax "
                "(official: qassmax-mlp-elementwise)"})
    ssmax_hidden: int = field(default=64, metadata={"help": "hidden units of the (QA)SSMax MLPs (official: 64)"})
    softmax_temperature: float = field(default=0.9, metadata={"help": "inference temperature (official: 0.9)"})

    def __post_init__(self) -> None:
        for name in ("num_quantiles", "embed_dim", "col_num_blocks", "col_nhead", "col_num_inds", "feature_group_size",
                     "row_num_blocks", "row_nhead", "row_num_cls", "icl_num_blocks", "icl_nhead", "ff_factor",
                     "ssmax_hidden"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"TabICLConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if not (isinstance(self.max_classes, int) and (self.max_classes == 0 or self.max_classes >= 2)):
            raise ValueError(f"TabICLConfig.max_classes must be 0 (regression) or an int >= 2, got "
                             f"{self.max_classes!r}")
        if self.embed_dim % self.col_nhead or self.embed_dim % self.row_nhead:
            raise ValueError(f"TabICLConfig.embed_dim ({self.embed_dim}) must be divisible by col_nhead and row_nhead")
        if (self.embed_dim // self.row_nhead) % 2:
            raise ValueError("TabICLConfig.row_nhead must leave an even head dim for RoPE")
        if (self.embed_dim * self.row_num_cls) % self.icl_nhead:
            raise ValueError(f"TabICLConfig.icl_nhead must divide embed_dim*row_num_cls")
        if self.ssmax not in SSMAX_TYPES:
            raise ValueError(f"TabICLConfig.ssmax must be one of {SSMAX_TYPES}, got {self.ssmax!r}")
        if not (self.rope_base > 1):
            raise ValueError(f"TabICLConfig.rope_base must be > 1, got {self.rope_base}")
        if not (self.softmax_temperature > 0):
            raise ValueError(f"TabICLConfig.softmax_temperature must be > 0, got {self.softmax_temperature}")

    @property
    def regression(self) -> bool:
        """True for the quantile-regression network (``max_classes == 0``)."""
        return self.max_classes == 0

    @property
    def out_dim(self) -> int:
        """Outputs of the head: class logits, or quantiles for regression."""
        return self.num_quantiles if self.regression else self.max_classes

    @property
    def icl_dim(self) -> int:
        return self.embed_dim * self.row_num_cls

    def to_dict(self) -> dict:
        return asdict(self)
