"""Laptop-scale check of arXiv 2605.09995 with a byte-level TinyLM on a synthetic topic corpus (protocol v2).

Corpus (the notes' Sec. 9.2 design): K = 20 topics, each with its own lexicon of 6 three-letter words (disjoint,
fixed by split seed 0). A document is 5 words drawn uniformly from one topic's lexicon; topics are uniform in
pretraining, so the pretraining topic entropy is log 20. The annotation of a document is ``#X:`` with X the topic
letter (A..T). Pretraining mixes plain documents with web-style question/answer documents, so that the post-training
context (a prompt, then the annotation) is one the base model has seen (v1 put the annotation after a prompt never
seen in pretraining, and the sampled annotations came out malformed: the setup broke the method):

* plain base       ``BOS doc \n``  and  ``BOS Q> R \n``             (R = ``<doc>`` with prob. ``p_format``, else doc)
* annotated base   ``BOS #X: doc \n``  and  ``BOS Q> #X: R \n``      (every token trained)
* plain SFT        ``BOS Q> <doc>``        anchored SFT  ``BOS Q> #X: <doc>`` (loss on ``<doc>`` only)

The SFT set is narrow, "high-quality formatted" answers from topics A and B only: SFT teaches the format (always
``<doc>``, against ``p_format`` in pretraining) and, as a side effect, collapses the topics. Every arm samples
responses to the prompt ``BOS Q>``; a fixed lexicon classifier labels each. Quality = format adherence; diversity =
entropy of the topic labels of the well-formed samples.

Arms (same model size, pretraining, SFT steps and batch size): ``anchored`` (annotated base, annotation-masked SFT,
annotation sampled first), ``sft`` (the paper's baseline), ``sft_temp`` (the ``sft`` model sampled at temperature
1.2: the "diverse prompting" baseline), ``anchored_unmasked`` (ablation: SFT also trains the annotation tokens).
The two bases are pretrained once (seed 0) and shared by every seed, as released models would be; a seed is one SFT
run per arm (data order, init of nothing else) plus sampling. The SFT learning rate of each trained arm is tuned per
arm (harness rule) on the SFT validation loss, tuning seed 1000 (the unmasked ablation reuses anchored's rate).

``config["null"] = True`` switches the method back to the baseline: the anchored arm becomes plain SFT on the plain
base, so the statistic is exactly 0.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ...core.logging import log_metrics
from ...core.seeding import seed_everything
from ...harness.spec import Comparator, ExperimentSpec, MechanismCheck
from ...harness.tuning import LogGrid, tune_per_arm
from .config import AnnotationAnchoringConfig
from .metrics import category_entropy, coverage, distinct_n, gap_closed, kl_to_reference
from .trainer import AnchoredSFTTrainer, AnnotatedExample, collate

N_TOPICS, WORDS_PER_TOPIC, WORD_LEN, DOC_WORDS = 20, 6, 3, 5
BOS, PROMPT = "\x02", "Q>"
ARMS = ("anchored", "sft", "sft_temp", "anchored_unmasked")


class TopicCorpus:
    """K topics with disjoint lexicons; ``classify`` is the fixed topic classifier of the claim."""

    def __init__(self, n_topics: int = N_TOPICS, split_seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(split_seed)
        words: list[str] = []
        seen: set[str] = set()
        while len(words) < n_topics * WORDS_PER_TOPIC:
            w = "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (WORD_LEN,), generator=gen))
            if w not in seen:
                seen.add(w)
                words.append(w)
        self.n_topics = n_topics
        self.lexicons = [words[k * WORDS_PER_TOPIC:(k + 1) * WORDS_PER_TOPIC] for k in range(n_topics)]
        self.topic_of = {w: k for k, lex in enumerate(self.lexicons) for w in lex}

    @staticmethod
    def annotation(topic: int) -> str:
        return f"#{chr(65 + topic)}:"

    def document(self, topic: int, gen: torch.Generator) -> str:
        idx = torch.randint(0, WORDS_PER_TOPIC, (DOC_WORDS,), generator=gen)
        return " ".join(self.lexicons[topic][int(i)] for i in idx)

    def classify(self, text: str) -> int | None:
        """Majority topic of the lexicon words in ``text`` (ties -> smallest topic id); None if it has none."""
        votes = [0] * self.n_topics
        for w in text.replace("<", " ").replace(">", " ").split():
            if w in self.topic_of:
                votes[self.topic_of[w]] += 1
        best = max(range(self.n_topics), key=lambda k: (votes[k], -k))
        return best if votes[best] > 0 else None

    @staticmethod
    def well_formed(response: str) -> bool:
        """Format adherence (the quality metric): ``<`` + exactly DOC_WORDS space-separated lowercase words of
        WORD_LEN letters + ``>``, the answer format SFT teaches; the words' topic is not judged here."""
        if not (response.startswith("<") and ">" in response):
            return False
        words = response[1:response.index(">")].split(" ")
        return len(words) == DOC_WORDS and all(len(w) == WORD_LEN and w.isalpha() and w.islower() for w in words)

    def on_lexicon(self, response: str) -> bool:
        """Well formed and every word from the lexicon of a single topic (knowledge of the topic, not format)."""
        if not self.well_formed(response):
            return False
        topics = {self.topic_of.get(w, -1) for w in response[1:response.index(">")].split(" ")}
        return len(topics) == 1 and -1 not in topics


def _enc(text: str) -> list[int]:
    return list(text.encode("latin-1"))


def pretrain_example(corpus: TopicCorpus, annotated: bool, gen: torch.Generator, p_qa: float = 0.0,
                     p_format: float = 0.0) -> AnnotatedExample:
    """A pretraining document: with probability ``p_qa`` a web-style Q/A page ``BOS Q> [#X:] R`` whose answer R is
    ``<doc>`` with probability ``p_format`` (else the bare doc), otherwise a plain ``BOS [#X:] doc``."""
    topic = int(torch.randint(0, corpus.n_topics, (1,), generator=gen))
    qa = p_qa > 0 and float(torch.rand((), generator=gen)) < p_qa
    doc = corpus.document(topic, gen)
    if qa and float(torch.rand((), generator=gen)) < p_format:
        doc = "<" + doc + ">"
    return AnnotatedExample(_enc(BOS + PROMPT if qa else BOS), _enc(corpus.annotation(topic)) if annotated else [],
                            _enc(doc + "\n"))


def sft_example(corpus: TopicCorpus, topics: list[int], gen: torch.Generator,
                before_prompt: bool = False) -> AnnotatedExample:
    """``BOS Q> [#X:] <doc>``; with ``before_prompt`` the annotation carries the BOS: ``BOS #X: Q> <doc>``."""
    topic = topics[int(torch.randint(0, len(topics), (1,), generator=gen))]
    response = _enc("<" + corpus.document(topic, gen) + ">")
    if before_prompt:
        return AnnotatedExample(_enc(PROMPT), _enc(BOS + corpus.annotation(topic)), response)
    return AnnotatedExample(_enc(BOS + PROMPT), _enc(corpus.annotation(topic)), response)


def _model(config: Mapping[str, Any]):
    from ...models.tiny_lm import TinyLM, TinyLMConfig

    return TinyLM(TinyLMConfig(vocab_size=256, d_model=config["d_model"], n_layers=config["n_layers"],
                               n_heads=config["n_heads"], max_seq_len=48))


def _train(trainer: AnchoredSFTTrainer, make, steps: int, batch: int, gen: torch.Generator) -> float:
    loss = math.nan
    for _ in range(steps):
        loss = trainer.step([make(gen) for _ in range(batch)])["loss"]
    return loss


_PRETRAINED: dict[tuple, tuple[dict, float]] = {}
"""In-process memo of the pretrained bases (also cached on disk as safetensors under the room's cache dir)."""
_PRETRAIN_KEYS = ("d_model", "n_layers", "n_heads", "batch_size", "pretrain_lr", "pretrain_steps", "p_qa", "p_format")
BASE_SEED = 0


def pretrained_base(config: Mapping[str, Any], seed: int, annotated: bool, corpus: TopicCorpus) -> tuple[dict, float]:
    """(state_dict copy, mean loss of the last 10% of pretraining steps), memoised per process and on disk."""
    from ...core.assets import cache_dir
    from ...core.io import cached_tensors

    key = (tuple(config[k] for k in _PRETRAIN_KEYS), seed, annotated)
    if key not in _PRETRAINED:
        name = "base-" + "-".join(f"{k}{config[k]}" for k in _PRETRAIN_KEYS) + f"-s{seed}-ann{int(annotated)}"

        def build() -> dict:
            model, loss = pretrain(config, seed, annotated, corpus)
            return {**model.state_dict(), "__final_loss__": torch.tensor(loss)}

        state = dict(cached_tensors(cache_dir("annotation_anchoring") / f"{name}.safetensors", build))
        loss = float(state.pop("__final_loss__"))
        _PRETRAINED[key] = ({k: v.clone() for k, v in state.items()}, loss)
    return _PRETRAINED[key]


def pretrain(config: Mapping[str, Any], seed: int, annotated: bool, corpus: TopicCorpus):
    """Pretrain a TinyLM on the uniform-topic corpus (annotated: every token, annotation included, is trained)."""
    torch.set_num_threads(1)
    seed_everything(seed)
    model = _model(config)
    cfg = AnnotationAnchoringConfig(use_annotations=annotated, mask_annotation_loss=False)
    trainer = AnchoredSFTTrainer(model, torch.optim.Adam(model.parameters(), lr=config["pretrain_lr"]), cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    make = lambda g: pretrain_example(corpus, annotated, g, config["p_qa"], config["p_format"])
    steps = config["pretrain_steps"]
    losses = [trainer.step([make(gen) for _ in range(config["batch_size"])])["loss"] for _ in range(steps)]
    return model, float(sum(losses[-max(1, steps // 10):]) / max(1, len(losses[-max(1, steps // 10):])))


def _sample_texts(trainer: AnchoredSFTTrainer, n: int) -> tuple[list[str], list[str]]:
    prompt = torch.tensor([_enc(BOS + PROMPT)])
    annotations, responses = trainer.sample(prompt, n)
    texts = [bytes(r.tolist()).decode("latin-1") for r in responses]
    return [bytes(a.tolist()).decode("latin-1") for a in annotations], texts


def evaluate(trainer: AnchoredSFTTrainer, corpus: TopicCorpus, n: int) -> dict:
    annotations, texts = _sample_texts(trainer, n)
    labels = [corpus.classify(t[:t.index(">")] if ">" in t else t) for t in texts]
    good = [lab for lab, t in zip(labels, texts) if corpus.well_formed(t)]
    uniform = {k: 1.0 / corpus.n_topics for k in range(corpus.n_topics)}
    out = {"topic_entropy_good": category_entropy(good) if good else 0.0,
           "topic_entropy": category_entropy(labels),
           "format_adherence": sum(corpus.well_formed(t) for t in texts) / n,
           "on_lexicon": sum(corpus.on_lexicon(t) for t in texts) / n,
           "coverage": coverage(labels, list(range(corpus.n_topics))),
           "kl_to_pretrain": kl_to_reference(labels, uniform),
           "frac_classified": sum(x is not None for x in labels) / n,
           "distinct_2_words": distinct_n([t.split(">")[0].lstrip("<").split() for t in texts], 2)}
    if trainer.config.use_annotations:
        match = [lab is not None and a == corpus.annotation(lab) for a, lab in zip(annotations, labels)]
        out["annotation_followed"] = sum(match) / n
        out["annotation_entropy"] = category_entropy(annotations)
        out["annotation_well_formed"] = sum(_is_annotation(a) for a in annotations) / n
    return out


def _is_annotation(a: str) -> bool:
    return len(a) == 3 and a[0] == "#" and a[2] == ":" and "A" <= a[1] <= chr(64 + N_TOPICS)


# arm -> (annotated base and SFT, annotation loss masked)
_TRAINED = {"anchored": (True, True), "sft": (False, True), "anchored_unmasked": (True, False)}


def _sft_config(annotated: bool, masked: bool, temperature: float = 1.0) -> AnnotationAnchoringConfig:
    return AnnotationAnchoringConfig(
        use_annotations=annotated, mask_annotation_loss=masked, annotation_position="after_prompt",
        annotation_start_ids=tuple(_enc("#")), annotation_end_id=_enc(":")[0], max_annotation_tokens=3,
        temperature=temperature, max_new_tokens=2 + DOC_WORDS * (WORD_LEN + 1))


def sft_arm(arm: str, config: Mapping[str, Any], seed: int, lr: float, corpus: TopicCorpus
            ) -> tuple[AnchoredSFTTrainer, float]:
    """SFT one trained arm from its base; returns the trainer and the SFT validation loss (response tokens, 8
    batches of held-out SFT examples, fixed generator: the tuning score)."""
    torch.set_num_threads(1)
    annotated, masked = _TRAINED[arm]
    seed_everything(seed)
    model = _model(config)
    model.load_state_dict(pretrained_base(config, BASE_SEED, annotated, corpus)[0])
    trainer = AnchoredSFTTrainer(model, torch.optim.Adam(model.parameters(), lr=lr), _sft_config(annotated, masked),
                                 generator=torch.Generator().manual_seed(seed + 2))
    topics = list(range(config["sft_topics"]))
    gen = torch.Generator().manual_seed(seed + 3)  # the same SFT examples, in the same order, for every arm
    _train(trainer, lambda g: sft_example(corpus, topics, g), config["sft_steps"], config["batch_size"], gen)
    val_gen = torch.Generator().manual_seed(777)
    with torch.no_grad():  # the trainer's own (masked) loss on held-out examples
        vals = [float(trainer.loss(collate([sft_example(corpus, topics, val_gen) for _ in range(config["batch_size"])],
                                           trainer.config))) for _ in range(8)]
    return trainer, sum(vals) / len(vals)


def tune(config: Mapping[str, Any]) -> dict:
    """Per-arm SFT learning rate (harness rule): log grid of ``lr_grid_size`` rates, factor 3, around each trained
    arm's natural Adam fine-tuning rate, scored by the SFT validation loss on tuning seed 1000."""
    corpus = TopicCorpus()
    grids = {a: LogGrid(center=config["sft_lr_center"], factor=3.0, size=config["lr_grid_size"])
             for a in ("anchored", "sft")}  # the unmasked ablation (not judged) reuses anchored's rate
    out = tune_per_arm(grids, lambda arm, lr, seed: sft_arm(arm, config, seed, lr, corpus)[1], mode="min",
                       desc="annotation_anchoring SFT lr")
    return {"tuning": out}


def _lr(prepared: Any, arm: str, config: Mapping[str, Any]) -> float:
    arm = "anchored" if arm == "anchored_unmasked" else arm
    return float(prepared["tuning"]["chosen"][arm]) if prepared else float(config["sft_lr_center"])


def run_seed(config: Mapping[str, Any], seed: int, prepared: Any) -> dict:
    torch.set_num_threads(1)
    corpus = TopicCorpus()
    h_ref = math.log(corpus.n_topics)
    null = bool(config.get("null"))
    arms: dict[str, dict] = {}
    trainers = {}
    for arm in ("anchored", "sft", "anchored_unmasked"):
        source = "sft" if (null and arm == "anchored") else arm  # the null switch: anchored runs as plain SFT
        trainer, val = sft_arm(source, config, seed, _lr(prepared, source, config), corpus)
        trainers[arm] = trainer
        arms[arm] = {**evaluate(trainer, corpus, config["n_samples"]), "sft_val_loss": val,
                     "lr": _lr(prepared, source, config),
                     "pretrain_loss": pretrained_base(config, BASE_SEED, _TRAINED[source][0], corpus)[1]}
    hot = trainers["sft"]
    hot.config = _sft_config(False, True, config["temp_high"])
    hot.generator = torch.Generator().manual_seed(seed + 2)
    arms["sft_temp"] = evaluate(hot, corpus, config["n_samples"])
    for arm, m in arms.items():
        m["collapse"] = h_ref - m["topic_entropy_good"]
        log_metrics(seed, arm=arm, **{k: v for k, v in m.items() if isinstance(v, float)})
    a, s = arms["anchored"], arms["sft"]
    quality = min(1.0, a["format_adherence"] / s["format_adherence"]) if s["format_adherence"] > 0 else 0.0
    closed = gap_closed(a["topic_entropy_good"], s["topic_entropy_good"], h_ref)
    stats = {"quality_weighted_gap_closed": closed * quality, "gap_closed": closed,
             "format_adherence_gap": a["format_adherence"] - s["format_adherence"], "quality_ratio": quality,
             "collapse_ratio": s["collapse"] / max(a["collapse"], 1e-6),
             "gap_closed_sft_temp": gap_closed(arms["sft_temp"]["topic_entropy_good"], s["topic_entropy_good"], h_ref),
             "gap_closed_unmasked": gap_closed(arms["anchored_unmasked"]["topic_entropy_good"],
                                               s["topic_entropy_good"], h_ref)}
    checks = {"sft_collapse_nats": s["collapse"], **_base_checks(config, corpus)}
    return {"arms": arms, "statistics": stats, "checks": checks}


def _base_checks(config: Mapping[str, Any], corpus: TopicCorpus) -> dict:
    """The annotated base, before SFT, sampled in the post-training context ``BOS Q>``: well-formed, near-uniform
    annotations (the context the method needs is one the base model knows). Memoised with the base."""
    key = ("checks", tuple(config[k] for k in _PRETRAIN_KEYS), config["n_samples"])
    if key not in _PRETRAINED:
        model = _model(config)
        model.load_state_dict(pretrained_base(config, BASE_SEED, True, corpus)[0])
        trainer = AnchoredSFTTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-3), _sft_config(True, True),
                                     generator=torch.Generator().manual_seed(4242))
        annotations, _ = _sample_texts(trainer, config["n_samples"])
        _PRETRAINED[key] = {
            "base_annotation_well_formed": sum(_is_annotation(a) for a in annotations) / len(annotations),
            "base_annotation_entropy_frac": category_entropy(annotations) / math.log(corpus.n_topics)}
    return dict(_PRETRAINED[key])


def plot_entropy(result: dict, ax) -> None:
    """Topic entropy of the well-formed samples vs format adherence per arm and seed; dotted line: log K."""
    for arm in result["arms_order"]:
        xs = [r["arms"][arm]["format_adherence"] for r in result["seed_results"] if arm in r["arms"]]
        ys = [r["arms"][arm]["topic_entropy_good"] for r in result["seed_results"] if arm in r["arms"]]
        ax.scatter(xs, ys, label=arm)
    ax.axhline(math.log(N_TOPICS), color="k", ls=":", lw=1, label="pretraining (log 20)")
    ax.set_xlabel("format adherence (quality)")
    ax.set_ylabel("topic entropy of well-formed samples (nats)")
    ax.legend(fontsize=8)


COMPARATOR = Comparator(
    "quality_weighted_gap_closed", ">", 0.5,
    "(H_anchored - H_sft) / (log 20 - H_sft) x min(1, adherence_anchored / adherence_sft) > 0.5, paired per seed; H "
    "is the topic entropy of the well-formed samples. The paper reports ~85% of the gap closed at similar quality; "
    "0.5 is the laptop-scale bar")
CHECKS = (
    MechanismCheck("base_annotation_well_formed", ">=", 0.9,
                   "the annotated base, sampled after the post-training prompt, writes a well-formed annotation at "
                   "least 90% of the time (the setup does not break the method)"),
    MechanismCheck("base_annotation_entropy_frac", ">=", 0.9,
                   "the annotated base's annotations after the prompt have at least 90% of the pretraining entropy "
                   "log 20"),
    MechanismCheck("sft_collapse_nats", ">=", 1.0,
                   "plain SFT collapses: its well-formed samples' topic entropy is at least 1 nat below log 20 (there "
                   "is a collapse to mitigate)"),
)


def _tier(pretrain_steps: int, sft_steps: int, n_samples: int, **kw: Any) -> dict:
    return {"d_model": 64, "n_layers": 2, "n_heads": 4, "batch_size": 32, "pretrain_lr": 3e-3, "sft_lr_center": 1e-3,
            "lr_grid_size": 3, "pretrain_steps": pretrain_steps, "sft_steps": sft_steps, "n_samples": n_samples,
            "sft_topics": 2, "p_qa": 0.5, "p_format": 0.3, "temp_high": 1.2, **kw}


SPECS = [
    ExperimentSpec(
        id="diversity_collapse", room="annotation_anchoring",
        claim="Annotation-anchored post-training (annotation loss masked, annotation sampled first) keeps most of "
              "the pretrained semantic diversity that plain SFT collapses, at similar instruction-following quality",
        paper_ref="arXiv 2605.09995, abstract and Sec. 1 ('closes ~85% of the semantic-diversity gap', "
                  "'6x less diversity collapse than SFT')",
        metric="entropy of the topic distribution of the well-formed samples (fixed lexicon classifier), weighted by "
               "the anchored arm's format adherence relative to plain SFT's",
        arms=ARMS, baseline="sft", comparator=COMPARATOR, run=run_seed, prepare=tune, plot=plot_entropy,
        checks=CHECKS, null_value=0.0,
        tiers={"smoke": _tier(10, 5, 40, lr_grid_size=1), "quick": _tier(1500, 300, 400),
               "full": _tier(4000, 600, 2000)},
        seeds={"smoke": 1, "quick": 5, "full": 5},
        notes="Protocol v2 (issue 8). Synthetic 20-topic byte corpus with web-style Q/A pages in pretraining, TinyLM "
              "d=64 x 2 layers, bases pretrained once (seed 0); SFT on topics A/B only, lr tuned per arm. The paper "
              "uses LLM annotations of real pretraining documents and instruction-tuned models of several sizes.",
    ),
]
