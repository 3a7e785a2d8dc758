"""Annotation-anchored fine-tuning hyperparameters (arXiv 2605.09995). The paper's code is not released; the
recipe (annotate, mask the annotation loss in post-training, sample the annotation first) is from the paper's
abstract and introduction as summarised in the room notes (finetuning-and-optimizers.md Sec. 9.1). Fields the
paper does not pin (template tokens, lengths, temperatures) are documented options."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ANNOTATION_POSITIONS = ("after_prompt", "before_prompt")


def _pos_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _pos_float(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


@dataclass
class AnnotationAnchoringConfig:
    """Options of :class:`~icml26.methods.annotation_anchoring.AnchoredSFTTrainer`.

    ``use_annotations=False`` is plain SFT (the annotation segment is dropped from every sequence and sampling
    goes straight from prompt to response). ``mask_annotation_loss=False`` trains on the annotation tokens too:
    with an empty prompt that is the paper's annotated *pretraining* step; in post-training it is an ablation.
    """

    use_annotations: bool = field(default=True, metadata={
        "help": "insert the semantic annotation between prompt and response (paper Sec. 1 recipe); "
                "False -> plain SFT, exactly"})
    mask_annotation_loss: bool = field(default=True, metadata={
        "help": "no loss on annotation tokens in post-training, so SFT leaves p(annotation) as pretrained "
                "(paper Sec. 1: 'the loss on annotation tokens is masked')"})
    train_on_prompt: bool = field(default=False, metadata={
        "help": "also put loss on prompt tokens (standard SFT masks the prompt; reconstructed default False)"})
    annotation_position: str = field(default="after_prompt", metadata={
        "help": "'after_prompt': prompt + a + y, a ~ p(a | prompt) (paper Sec. 1 inference recipe); "
                "'before_prompt': a + prompt + y, a ~ p(a) in the exact context it had in annotated pretraining "
                "(reconstructed option: the paper's template is not published)"})
    annotation_start_ids: tuple[int, ...] = field(default=(), metadata={
        "help": "fixed template tokens that open an annotation; given, not sampled, at inference "
                "(schema not published: reconstructed option)"})
    annotation_end_id: int | None = field(default=None, metadata={
        "help": "token that closes a sampled annotation (kept in it); None -> annotations are exactly "
                "max_annotation_tokens long (reconstructed option)"})
    max_annotation_tokens: int = field(default=64, metadata={
        "help": "cap on sampled annotation tokens (paper: 'a short description'; length not published)"})
    annotation_temperature: float = field(default=1.0, metadata={
        "help": "temperature for a ~ p(a | prompt); 1.0 samples the pretrained annotation distribution "
                "(paper Sec. 1: annotations are sampled, not chosen)"})
    temperature: float = field(default=1.0, metadata={
        "help": "temperature for y ~ p(y | prompt, a) (reconstructed default 1.0)"})
    max_new_tokens: int = field(default=256, metadata={"help": "response length cap at inference"})
    eos_token_id: int | None = field(default=None, metadata={
        "help": "token that ends a sampled response; the response is cut after it (None: fixed length)"})
    pad_token_id: int = field(default=0, metadata={
        "help": "right-padding token of training batches and finished responses (never trained on)"})

    def __post_init__(self) -> None:
        for name in ("use_annotations", "mask_annotation_loss", "train_on_prompt"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.annotation_position not in ANNOTATION_POSITIONS:
            raise ValueError(f"annotation_position must be one of {ANNOTATION_POSITIONS}, "
                             f"got {self.annotation_position!r}")
        ids = self.annotation_start_ids
        if isinstance(ids, list):
            ids = self.annotation_start_ids = tuple(ids)
        if not isinstance(ids, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                 for i in ids):
            raise ValueError(f"annotation_start_ids must be a tuple of non-negative token ids, got {ids!r}")
        for name in ("annotation_end_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be None or a non-negative token id, got {value!r}")
        for name in ("max_annotation_tokens", "max_new_tokens"):
            if not _pos_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("annotation_temperature", "temperature"):
            if not _pos_float(getattr(self, name)):
                raise ValueError(f"{name} must be a positive finite number, got {getattr(self, name)!r}")
        if not isinstance(self.pad_token_id, int) or isinstance(self.pad_token_id, bool) or self.pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a non-negative token id, got {self.pad_token_id!r}")
