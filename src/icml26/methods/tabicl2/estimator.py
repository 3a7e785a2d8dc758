"""``TabICLClassifier`` and ``TabICLRegressor``: the scikit-learn estimators around the TabICLv2 network
(in-context learning: ``fit`` stores the preprocessed training table, ``predict``/``predict_proba`` run the network
with the training rows as context).

Inference follows the official estimator (soda-inria/tabicl at 8f1aa20, ``src/tabicl/_sklearn/``; our own code):
preprocessing (categorical/string columns -> ordinal codes, constant-column filter, outlier clipping at |z| > 4,
standardisation, clip to +-100), then an ensemble of ``n_estimators`` members that differ by a feature permutation,
a circular shift of the class ids and a normalisation (``"none"`` or Yeo-Johnson ``"power"``); member logits are
un-shifted, averaged, and turned into probabilities by softmax(logits / 0.9).

The regressor (official ``_sklearn/regressor.py``) shares the preprocessing and the members (feature permutation,
normalisation; no class shift), standardises y with the training mean and standard deviation (the official
``y_scaler_``), and asks a regression network (``max_classes == 0``) for ``num_quantiles`` quantiles of the
standardised y; each member's quantiles are sorted (official ``crossing_method="sort"``) and mapped back to y's
units, and the members are averaged. ``predict`` returns the mean of the quantiles (official ``output_type="mean"``).

More than ``max_classes`` (10) classes use the official many-class scheme with the same checkpoint (no retraining;
:func:`many_class_proba`): the column stage runs once per digit of a balanced mixed-radix code of the labels (every
digit has <= 10 values) and averages, and the in-context stage walks a tree of <= 10-way nodes, multiplying the
group probabilities down to the classes. Members average ``T * log p`` (``T`` = ``softmax_temperature``), as the
official estimator averages its ``return_logits`` output.

Limits, stated plainly: missing values (NaN) are imputed with the training column mean (the official code handles
them inside its preprocessing too; the policy here is ours); infinite values raise. The shipped checkpoint
(``checkpoints/tabicl2_tiny.pt``) was pretrained on tables of at most 256 rows, 16 features and 10 classes; larger
tables and the many-class path run, but outside the pretraining range. The shipped regression checkpoint
(``checkpoints/tabicl2_reg_tiny.pt``) was pretrained on tables of at most 256 rows and 16 features. Official
checkpoints cannot be loaded (their network has other sizes and parameter names).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.preprocessing import LabelEncoder, PowerTransformer
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, column_or_1d, validate_data

from .config import TabICLConfig
from .reference import TabICL, quantile_levels

DEFAULT_CHECKPOINT = "checkpoints/tabicl2_tiny.pt"
DEFAULT_REG_CHECKPOINT = "checkpoints/tabicl2_reg_tiny.pt"
REBUILD = ("python -m icml26.methods.tabicl2.pretrain --out results/tabicl2/pretrain --minutes 80 --max-features 16 "
           "--lr 2e-3 --batch 16 --export src/icml26/methods/tabicl2/checkpoints/tabicl2_tiny.pt")
REBUILD_REG = ("python -m icml26.methods.tabicl2.pretrain --task regression --out results/tabicl2/pretrain_reg "
               "--minutes 45 --max-features 16 --lr 2e-3 --batch 16 "
               "--export src/icml26/methods/tabicl2/checkpoints/tabicl2_reg_tiny.pt")
NORM_METHODS = ("none", "power")


def default_checkpoint(task: str = "classification") -> Path:
    """Path of the checkpoint shipped in the package for ``task`` ("classification" or "regression")."""
    name = {"classification": DEFAULT_CHECKPOINT, "regression": DEFAULT_REG_CHECKPOINT}[task]
    return Path(str(resources.files("icml26.methods.tabicl2").joinpath(name)))


# constructor arguments of the official ``tabicl._model.tabicl.TabICL`` (soda-inria/tabicl @ 8f1aa20) that our
# TabICLConfig does not have: a checkpoint whose config holds them was written by the official package
OFFICIAL_ONLY_KEYS = ("col_ssmax", "icl_ssmax", "row_rope_base", "row_rope_interleaved", "col_feature_group",
                      "col_feature_group_size", "col_target_aware", "col_affine", "bias_free_ln", "norm_first")


def _check_config_keys(path: Path, config) -> None:
    """Clear errors for a checkpoint config this reimplementation cannot build (before any model is made)."""
    if not isinstance(config, dict):
        raise ValueError(f"{path}: 'config' must be a dict of TabICLConfig fields, got {type(config).__name__}")
    official = sorted(k for k in OFFICIAL_ONLY_KEYS if k in config)
    if official:
        sizes = {k: config.get(k) for k in ("embed_dim", "col_num_blocks", "col_num_inds", "row_num_blocks",
                                            "icl_num_blocks", "max_classes") if k in config}
        raise ValueError(
            f"{path} is an official TabICL checkpoint (config has {official}; sizes {sizes}). Loading official "
            "weights is not implemented in icml26: the official network's parameter names and packing differ from "
            "this reimplementation and no conversion has been checked for output parity (see the tabicl2 README, "
            "'Not implemented'). Use the official `tabicl` package for official checkpoints.")
    unknown = sorted(set(config) - {f.name for f in fields(TabICLConfig)})
    if unknown:
        raise ValueError(f"{path}: config has fields {unknown} that TabICLConfig does not know; not a tabicl2 "
                         "checkpoint written by this version")


def load_model(path: str | Path | None = None, device: str | torch.device = "cpu",
               task: str = "classification") -> TabICL:
    """The network from a checkpoint ``{"config", "state_dict", ...}`` (the shipped one for ``task`` when ``path``
    is None). Raises ValueError when the checkpoint's head does not fit ``task``."""
    path = Path(path) if path is not None else default_checkpoint(task)
    if not path.exists():
        rebuild = REBUILD_REG if task == "regression" else REBUILD
        raise FileNotFoundError(f"TabICL checkpoint {path} not found; rebuild the shipped one with: {rebuild}")
    ck = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ck, dict) or "config" not in ck or "state_dict" not in ck:
        raise ValueError(f"{path} is not a tabicl2 checkpoint (expected keys 'config' and 'state_dict')")
    _check_config_keys(path, ck["config"])
    cfg = TabICLConfig(**ck["config"])
    if cfg.regression != (task == "regression"):
        kind = "a regression" if cfg.regression else "a classification"
        raise ValueError(f"{path} holds {kind} network (max_classes={cfg.max_classes}); it cannot serve {task}")
    model = TabICL(cfg)
    model.load_state_dict(ck["state_dict"])
    return model.to(device).eval()


def _encode_objects(X, categories: list | None):
    """Object/string columns -> ordinal codes (unknown or missing -> NaN). Returns float array and categories."""
    arr = np.asarray(X, dtype=object) if not isinstance(X, np.ndarray) or X.dtype == object else X
    if arr.dtype != object:
        return X, categories
    arr = np.array(arr, dtype=object, ndmin=2)
    if categories is None:
        categories = []
        for j in range(arr.shape[1]):
            col = arr[:, j]
            try:
                col.astype(np.float64)
                categories.append(None)
            except (TypeError, ValueError):
                categories.append(sorted({str(v) for v in col if v is not None and v == v}))
    out = np.empty(arr.shape, dtype=np.float64)
    for j, cats in enumerate(categories):
        col = arr[:, j]
        if cats is None:
            out[:, j] = [np.nan if v is None else float(v) for v in col]
        else:
            index = {c: i for i, c in enumerate(cats)}
            out[:, j] = [index.get(str(v), np.nan) if v is not None and v == v else np.nan for v in col]
    return out, categories


# ---------------------------------------------------------------------------------------------- many classes
# Design read from soda-inria/tabicl @ 8f1aa20: ``_model/embedding.py`` (``_compute_mixed_radix_bases``,
# ``_extract_mixed_radix_digit``: column stage) and ``_model/learning.py`` (``_grouping``, ``_fit_node``,
# ``_predict_hierarchical``: in-context stage). Our own code.

def mixed_radix_bases(n_classes: int, max_classes: int) -> list[int]:
    """Balanced bases [k_0 .. k_{D-1}], each <= max_classes, with prod k_i >= n_classes and D as small as possible.

    D = ceil(log n / log M) digits of base ceil(n^(1/D)) (capped at M); if the product still falls short, bases are
    raised by one from the first digit on. E.g. (25, 10) -> [5, 5]; (101, 10) -> [5, 5, 5]; (7, 10) -> [7].
    """
    if n_classes <= max_classes:
        return [n_classes]
    digits = math.ceil(math.log(n_classes) / math.log(max_classes))
    base = min(math.ceil(n_classes ** (1.0 / digits)), max_classes)
    # a guard, in integers, against a floating-point root that rounds below the exact one
    bases = [base] * digits
    for i in range(digits):
        if math.prod(bases) >= n_classes:
            break
        bases[i] = min(bases[i] + 1, max_classes)
    return bases


def mixed_radix_digit(y: torch.Tensor, digit: int, bases: list[int]) -> torch.Tensor:
    """Digit ``digit`` (most significant first) of labels ``y`` in the mixed radix ``bases``: values in
    [0, bases[digit]). Each digit is a coarser labelling that the <= M-way label embedding can take."""
    return (y // math.prod(bases[digit + 1:])) % bases[digit]


def balanced_groups(n: int, max_classes: int) -> np.ndarray:
    """Group id [n] of n sorted classes split into min(ceil(n / M), M) contiguous groups whose sizes differ by at
    most one (larger groups first): (25, 10) -> sizes [9, 8, 8]; (101, 10) -> [11, 10, ..., 10]."""
    k = min(math.ceil(n / max_classes), max_classes)
    sizes = [n // k + (i < n % k) for i in range(k)]
    return np.repeat(np.arange(k), sizes)


@dataclass
class ClassNode:
    """A node of the class tree: the sorted global class ids under it and, unless a leaf, its children (one per
    group; ``group_of[c]`` is the group of class ``classes[c]``)."""

    classes: np.ndarray
    group_of: np.ndarray | None = None
    children: list = field(default_factory=list)

    @property
    def is_leaf(self) -> bool:
        return not self.children


def class_tree(classes: np.ndarray, max_classes: int) -> ClassNode:
    """Tree over ``classes`` whose every node has <= max_classes children (leaves hold <= max_classes classes)."""
    classes = np.asarray(classes)
    if len(classes) <= max_classes:
        return ClassNode(classes)
    group_of = balanced_groups(len(classes), max_classes)
    return ClassNode(classes, group_of,
                     [class_tree(classes[group_of == g], max_classes) for g in range(group_of.max() + 1)])


@torch.no_grad()
def many_class_proba(model: TabICL, X: torch.Tensor, y_train: torch.Tensor, n_classes: int,
                     temperature: float, max_classes: int | None = None) -> torch.Tensor:
    """Class probabilities (T - n_train, n_classes) of the test rows of one table, for any number of classes.

    X (T, H) standardised (training rows first), y_train (n_train,) int64 in [0, n_classes). Column stage: one
    pass per mixed-radix digit of the labels, embeddings averaged. In-context stage: at each node of
    :func:`class_tree`, the node's training rows (relabelled by child group, or by class at a leaf) are the context
    for every test row; softmax(logits / temperature) over the node's groups, multiplied down the tree. With
    n_classes <= max_classes this is one digit and one leaf: ``model.predict_proba`` exactly.

    ``max_classes`` (default: the network's, 10) bounds the digit bases and the node width; a smaller value forces
    the tree on fewer classes (used by the tests to compare the tree with the flat 10-way head).
    """
    M, n_train = max_classes or model.cfg.max_classes, len(y_train)
    if not 2 <= M <= model.cfg.max_classes:
        raise ValueError(f"max_classes must lie in [2, {model.cfg.max_classes}] (the network's head), got {M}")
    bases = mixed_radix_bases(n_classes, M)
    emb = sum(model.col(X[None], mixed_radix_digit(y_train, d, bases)[None]) for d in range(len(bases)))
    R = model.row(emb / len(bases))[0]  # (T, D); shared by every node
    R_train, R_test = R[:n_train], R[n_train:]

    def node_proba(node: ClassNode, rows: torch.Tensor) -> torch.Tensor:
        """P(class | node's classes) for the test rows, scattered into (n_test, n_classes)."""
        local = torch.as_tensor(np.searchsorted(node.classes, y_train[rows].cpu().numpy()), device=X.device)
        labels = local if node.is_leaf else torch.as_tensor(node.group_of, device=X.device)[local]
        k = len(node.classes) if node.is_leaf else len(node.children)
        context = torch.cat([R_train[rows], R_test])[None]
        p = (model.icl(context, labels[None])[0, len(rows):, :k] / temperature).softmax(-1)
        if node.is_leaf:
            out = p.new_zeros(len(R_test), n_classes)
            out[:, torch.as_tensor(node.classes, device=X.device)] = p
            return out
        return sum(p[:, g:g + 1] * node_proba(child, rows[labels == g]) for g, child in enumerate(node.children))

    return node_proba(class_tree(np.arange(n_classes), M), torch.arange(n_train, device=X.device))


class _TabICLBase(BaseEstimator):
    """Preprocessing and ensemble members shared by :class:`TabICLClassifier` and :class:`TabICLRegressor`:
    string columns -> ordinal codes, NaN -> training column mean, constant columns dropped, outlier clipping at
    |z| > ``outlier_threshold``, standardisation (clip +-100); members over feature permutations and
    normalisations ({none, Yeo-Johnson})."""

    _task = "classification"

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = True
        tags.input_tags.string = True  # string columns are ordinal-coded
        tags.input_tags.categorical = True
        tags.non_deterministic = False
        return tags

    # ------------------------------------------------------------------ preprocessing
    def _to_float(self, X, reset: bool) -> np.ndarray:
        """Validated float64 (n, n_features_in_) with NaN for missing cells; string columns -> ordinal codes."""
        columns = getattr(X, "columns", None)
        names = np.asarray([str(c) for c in columns], dtype=object) if columns is not None else None
        has_strings = (hasattr(X, "dtypes") and any(dt == object or str(dt) in ("category", "string", "str")
                                                    for dt in X.dtypes)) or getattr(X, "dtype", None) == object
        if reset:
            self.categories_ = None
        coded = has_strings or (not reset and self.categories_ is not None)
        if not coded:
            return self._finite(validate_data(self, X, reset=reset, dtype=np.float64, ensure_all_finite="allow-nan"))
        if not reset:  # check the shape and names ourselves: the coded array below has no names
            width = np.shape(X)[1] if np.ndim(X) == 2 else None
            if width != self.n_features_in_:
                raise ValueError(f"X has {width} features, but {type(self).__name__} is expecting "
                                 f"{self.n_features_in_} features as input")
            known = getattr(self, "feature_names_in_", None)
            if names is not None and known is not None and list(names) != list(known):
                raise ValueError("The feature names should match those that were passed during fit")
        X, cats = _encode_objects(np.asarray(X, dtype=object), None if reset else self.categories_)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            X = validate_data(self, X, reset=reset, dtype=np.float64, ensure_all_finite="allow-nan")
        if reset:
            self.categories_ = cats
            if names is not None:
                self.feature_names_in_ = names
        return self._finite(X)

    def _finite(self, X: np.ndarray) -> np.ndarray:
        if np.isinf(X).any():
            raise ValueError(f"{type(self).__name__}: X contains infinite values; only NaN (missing) is allowed")
        return X

    def _standardise(self, X: np.ndarray) -> np.ndarray:
        X = np.where(np.isnan(X), self.fill_, X)[:, self.keep_]
        Z = np.clip((X - self.mean1_) / self.std1_, -self.outlier_threshold, self.outlier_threshold)
        return np.clip((Z - self.mean2_) / self.std2_, -100, 100)

    def _check_params(self) -> tuple:
        """Validate the shared hyper-parameters before any state changes; returns the normalisation cycle."""
        if not (isinstance(self.n_estimators, int) and self.n_estimators >= 1):
            raise ValueError(f"n_estimators must be a positive int, got {self.n_estimators!r}")
        norms = tuple(self.norm_methods) if self.norm_methods is not None else NORM_METHODS
        if not norms or any(n not in NORM_METHODS for n in norms):
            raise ValueError(f"norm_methods must be a non-empty subset of {NORM_METHODS}, got {self.norm_methods!r}")
        if not self.outlier_threshold > 0:
            raise ValueError(f"outlier_threshold must be > 0, got {self.outlier_threshold}")
        return norms

    def _fit_tables(self, X: np.ndarray, norms: tuple, shifts) -> None:
        """Preprocessing state and members from the (validated, float) training table X (n, n_features_in_).
        ``shifts(i)`` gives member i's class shift (0 for regression)."""
        device = torch.device(self.device if self.device is not None else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        model = load_model(self.model_path, device, task=self._task)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-missing columns get 0
            fill = np.nanmean(X, axis=0)
        self.fill_ = np.where(np.isfinite(fill), fill, 0.0)
        Xf = np.where(np.isnan(X), self.fill_, X)
        keep = Xf.std(0) > 0
        self.keep_ = keep if keep.any() else np.arange(X.shape[1]) == 0
        Xf = Xf[:, self.keep_]
        self.mean1_, self.std1_ = Xf.mean(0), Xf.std(0) + 1e-8
        Z = np.clip((Xf - self.mean1_) / self.std1_, -self.outlier_threshold, self.outlier_threshold)
        self.mean2_, self.std2_ = Z.mean(0), Z.std(0) + 1e-8
        self.X_train_ = self._standardise(X)
        # ensemble members: (feature permutation, class shift, normalisation)
        rng = np.random.default_rng(self.random_state)
        H = self.X_train_.shape[1]
        self.members_ = []
        for i in range(self.n_estimators):
            perm = rng.permutation(H) if (self.feat_shuffle and i > 0) else np.arange(H)
            norm = norms[i % len(norms)]
            power = None
            if norm == "power":
                power = PowerTransformer(method="yeo-johnson", standardize=True)
                with np.errstate(all="ignore"):
                    power.fit(self.X_train_)
            self.members_.append({"perm": perm, "shift": shifts(i), "norm": norm, "power": power})
        self.model_ = model
        self.device_ = device

    @staticmethod
    def _check_y_shape(X: np.ndarray, y) -> np.ndarray:
        y = np.asarray(y)
        if y.ndim != 1 and not (y.ndim == 2 and y.shape[1] == 1):
            raise ValueError(f"y must be 1-D, got shape {y.shape}")
        y = column_or_1d(y, warn=True)
        if len(y) != len(X):
            raise ValueError(f"X and y have inconsistent numbers of samples: {len(X)} != {len(y)}")
        return y

    # ------------------------------------------------------------------ inference
    def _member_table(self, member: dict, X: np.ndarray) -> np.ndarray:
        if member["power"] is not None:
            with np.errstate(all="ignore"):
                X = np.clip(np.nan_to_num(member["power"].transform(X)), -100, 100)
        return X[:, member["perm"]]

    def _member_outputs(self, member: dict, X: np.ndarray, y: torch.Tensor, forward) -> np.ndarray:
        """``forward(table, y)`` over the member's table in test batches of ``test_batch_size`` rows (test rows
        never interact, so batching does not change results); outputs concatenated over the test rows."""
        tr = torch.as_tensor(self._member_table(member, self.X_train_), dtype=torch.float32)
        te = torch.as_tensor(self._member_table(member, X), dtype=torch.float32)
        with torch.no_grad():
            return np.concatenate([forward(torch.cat([tr, te[s:s + self.test_batch_size]]), y)
                                   for s in range(0, len(te), self.test_batch_size)])


class TabICLClassifier(ClassifierMixin, _TabICLBase):
    """TabICLv2 in-context classifier for any number (>= 2) of classes; above the network's ``max_classes`` (10)
    each member goes through :func:`many_class_proba` (mixed-radix column stage, class tree).

    Args:
        n_estimators: ensemble members (official default 8).
        norm_methods: normalisations cycled over members; None -> ("none", "power") as in the official estimator.
        feat_shuffle: permute features per member (the first member keeps the original order).
        class_shift: circularly shift class ids per member.
        outlier_threshold: |z| beyond which training-statistics z-scores are clipped (official 4.0).
        softmax_temperature: temperature of the final softmax (official 0.9).
        model_path: a tabicl2 classification checkpoint; None loads the one shipped in the package (offline).
        device: torch device; None picks CUDA when available, else CPU.
        test_batch_size: test rows per forward pass (test rows never interact, so batching does not change results).
        random_state: seed of the member permutations.
    """

    def __init__(self, n_estimators: int = 8, norm_methods=None, feat_shuffle: bool = True, class_shift: bool = True,
                 outlier_threshold: float = 4.0, softmax_temperature: float = 0.9, model_path=None, device=None,
                 test_batch_size: int = 1024, random_state: int | None = 42):
        self.n_estimators = n_estimators
        self.norm_methods = norm_methods
        self.feat_shuffle = feat_shuffle
        self.class_shift = class_shift
        self.outlier_threshold = outlier_threshold
        self.softmax_temperature = softmax_temperature
        self.model_path = model_path
        self.device = device
        self.test_batch_size = test_batch_size
        self.random_state = random_state

    def fit(self, X, y):
        """Validate and store the training table (no network pass: the training rows are the context)."""
        norms = self._check_params()
        if not self.softmax_temperature > 0:
            raise ValueError(f"softmax_temperature must be > 0, got {self.softmax_temperature}")
        if y is None:
            raise ValueError("TabICLClassifier requires y to be passed, but the target y is None")
        X = self._to_float(X, reset=True)
        y = self._check_y_shape(X, y)
        check_classification_targets(y)
        encoder = LabelEncoder().fit(y)
        if len(encoder.classes_) < 2:
            raise ValueError(f"TabICLClassifier needs at least 2 classes in y, got 1 class "
                             f"({encoder.classes_[0]!r})")
        self._label_encoder = encoder
        self.classes_ = encoder.classes_
        self.n_classes_ = len(self.classes_)
        C = self.n_classes_
        self._fit_tables(X, norms, lambda i: (i % C) if self.class_shift else 0)
        self.y_train_ = encoder.transform(y)
        return self

    # ------------------------------------------------------------------ inference
    def _member_logits(self, table: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        """Logits (n_test, C) of one member's table (T, H) with training labels y (n_train,), in member class ids.
        Above max_classes: temperature * log of the many-class probabilities (softmax(. / T) gives them back)."""
        C = self.n_classes_
        table, y = table.to(self.device_), y.to(self.device_)
        if C <= self.model_.cfg.max_classes:
            out = self.model_(table[None], y[None])[0, :, :C]
        else:
            proba = many_class_proba(self.model_, table, y, C, self.softmax_temperature)
            out = self.softmax_temperature * torch.log(proba.clamp_min(1e-30))
        return out.cpu().double().numpy()

    def member_logits(self, X) -> np.ndarray:
        """Each member's logits (n_estimators, n_samples, n_classes) in the order of ``classes_`` (un-shifted).
        Their mean over the first k members is the logit average of a k-member ensemble with the same
        ``random_state`` (members are drawn in order), which the ensemble-size ablation uses."""
        check_is_fitted(self, "model_")
        X = self._standardise(self._to_float(X, reset=False))
        C = self.n_classes_
        out = np.zeros((len(self.members_), len(X), C))
        for i, member in enumerate(self.members_):
            y = torch.as_tensor((self.y_train_ + member["shift"]) % C, dtype=torch.long)
            logits = self._member_outputs(member, X, y, self._member_logits)
            # member class c' = (c + shift) % C, so the logit of original class c sits at column (c + shift) % C
            out[i] = logits[:, (np.arange(C) + member["shift"]) % C]
        return out

    def predict_logits(self, X) -> np.ndarray:
        """Ensemble-averaged logits (n_samples, n_classes) before the temperature softmax (for more than
        ``max_classes`` classes each member contributes ``softmax_temperature * log p``)."""
        return self.member_logits(X).mean(0)

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities (n_samples, n_classes) in the order of ``classes_``."""
        z = self.predict_logits(X) / self.softmax_temperature
        z = np.exp(z - z.max(1, keepdims=True))
        return z / z.sum(1, keepdims=True)

    def predict(self, X) -> np.ndarray:
        check_is_fitted(self, "model_")
        return self.classes_[self.predict_proba(X).argmax(1)]


class TabICLRegressor(RegressorMixin, _TabICLBase):
    """TabICLv2 in-context regressor: a quantile head (``num_quantiles`` levels alpha_q = q / (Q + 1)) on the same
    three-stage network, pretrained with the pinball loss (``pretrain --task regression``).

    ``fit`` standardises y with the training mean and standard deviation (official ``y_scaler_``); each member's
    predicted quantiles are sorted, mapped back to y's units and averaged over members. ``predict`` is the mean of
    the quantiles (official ``output_type="mean"``); ``predict_quantiles(X, alphas)`` interpolates the averaged
    quantile function linearly at ``alphas`` (the official estimator adds parametric tails outside
    [alpha_1, alpha_Q]; here levels outside are clamped to the end quantiles).

    Args:
        n_estimators: ensemble members (official default 8).
        norm_methods: normalisations cycled over members; None -> ("none", "power") as in the official estimator.
        feat_shuffle: permute features per member (the first member keeps the original order).
        outlier_threshold: |z| beyond which training-statistics z-scores of X are clipped (official 4.0).
        model_path: a tabicl2 regression checkpoint; None loads the one shipped in the package (offline).
        device: torch device; None picks CUDA when available, else CPU.
        test_batch_size: test rows per forward pass.
        random_state: seed of the member permutations.
    """

    _task = "regression"

    def __init__(self, n_estimators: int = 8, norm_methods=None, feat_shuffle: bool = True,
                 outlier_threshold: float = 4.0, model_path=None, device=None, test_batch_size: int = 1024,
                 random_state: int | None = 42):
        self.n_estimators = n_estimators
        self.norm_methods = norm_methods
        self.feat_shuffle = feat_shuffle
        self.outlier_threshold = outlier_threshold
        self.model_path = model_path
        self.device = device
        self.test_batch_size = test_batch_size
        self.random_state = random_state

    def fit(self, X, y):
        """Validate and store the training table and the standardised targets (no network pass)."""
        norms = self._check_params()
        if y is None:
            raise ValueError("TabICLRegressor requires y to be passed, but the target y is None")
        X = self._to_float(X, reset=True)
        y = self._check_y_shape(X, y)
        try:
            y = y.astype(np.float64)
        except (TypeError, ValueError) as err:
            raise ValueError(f"TabICLRegressor needs a numeric y: {err}") from None
        if not np.isfinite(y).all():
            raise ValueError("TabICLRegressor: y contains NaN or infinite values")
        if len(y) < 2:
            raise ValueError(f"TabICLRegressor needs at least 2 training rows, got n_samples = {len(y)}")
        self._fit_tables(X, norms, lambda i: 0)
        sd = y.std()
        self.y_mean_, self.y_scale_ = float(y.mean()), float(sd) if sd > 0 else 1.0
        self.y_train_ = (y - self.y_mean_) / self.y_scale_
        return self

    def _member_quantiles(self, table: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        table, y = table.to(self.device_), y.to(self.device_)
        return self.model_.predict_quantiles(table[None], y[None])[0].cpu().double().numpy()

    def predict_raw_quantiles(self, X) -> np.ndarray:
        """Member-averaged sorted quantiles (n_samples, num_quantiles) in y's units, at the levels
        :attr:`quantile_levels_`."""
        check_is_fitted(self, "model_")
        X = self._standardise(self._to_float(X, reset=False))
        y = torch.as_tensor(self.y_train_, dtype=torch.float32)
        total = sum(self._member_outputs(member, X, y, self._member_quantiles) for member in self.members_)
        return total / len(self.members_) * self.y_scale_ + self.y_mean_

    @property
    def quantile_levels_(self) -> np.ndarray:
        """alpha_q = linspace(0, 1, Q + 2)[1:-1], the levels of :meth:`predict_raw_quantiles`' columns."""
        check_is_fitted(self, "model_")
        return quantile_levels(self.model_.cfg.num_quantiles, dtype=torch.float64).numpy()

    @staticmethod
    def _check_alphas(alphas) -> np.ndarray:
        a = np.asarray(alphas, dtype=np.float64).ravel()
        if a.size == 0 or not ((a > 0) & (a < 1)).all():
            raise ValueError(f"alphas must be probability levels in (0, 1), got {alphas!r}")
        return a

    def predict_quantiles(self, X, alphas=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)) -> np.ndarray:
        """Quantiles (n_samples, len(alphas)) by linear interpolation of the averaged quantile function."""
        a = self._check_alphas(alphas)
        q = self.predict_raw_quantiles(X)
        levels = self.quantile_levels_
        return np.stack([np.interp(a, levels, row) for row in q])

    OUTPUT_TYPES = ("mean", "median", "variance", "quantiles", "raw_quantiles")

    def predict(self, X, output_type: str | list = "mean", alphas=None):
        """Target statistics in y's units, named as in the official ``TabICLRegressor.predict``.

        output_type: "mean" (default; the mean of the member-averaged quantiles, (n_samples,)), "median" (the
        quantile function interpolated at 0.5, (n_samples,)), "variance" (the variance of the predicted quantile
        values, no tail model, (n_samples,)), "quantiles" (at ``alphas``, default 0.1 ... 0.9, (n_samples,
        len(alphas))), "raw_quantiles" ((n_samples, Q) at :attr:`quantile_levels_`), or a list of these, which
        returns a dict. The network runs once whatever is asked."""
        keys = [output_type] if isinstance(output_type, str) else list(output_type)
        bad = [k for k in keys if k not in self.OUTPUT_TYPES]
        if not keys or bad:
            raise ValueError(f"output_type must be one of {self.OUTPUT_TYPES} or a list of them, got {output_type!r}")
        alphas = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9) if alphas is None else alphas
        a = self._check_alphas(alphas) if "quantiles" in keys else None
        q = self.predict_raw_quantiles(X)
        levels = self.quantile_levels_
        out = {}
        for k in keys:
            if k == "mean":
                out[k] = q.mean(1)
            elif k == "variance":
                out[k] = q.var(1)
            elif k == "median":
                out[k] = np.array([np.interp(0.5, levels, row) for row in q])
            elif k == "quantiles":
                out[k] = np.stack([np.interp(a, levels, row) for row in q])
            else:
                out[k] = q
        return out[keys[0]] if isinstance(output_type, str) else out

    def crps(self, X, y) -> np.ndarray:
        """Continuous ranked probability score per row (n_samples,), lower is better, in y's units:
        CRPS(F, y) = 2 * integral_0^1 pinball_alpha(y - F^-1(alpha)) d alpha, approximated by the mean over the Q
        predicted levels (no tail model beyond [1/(Q+1), Q/(Q+1)])."""
        y = np.asarray(y, dtype=np.float64).ravel()
        q = self.predict_raw_quantiles(X)
        if y.shape[0] != q.shape[0]:
            raise ValueError(f"crps: X has {q.shape[0]} rows but y has {y.shape[0]}")
        if not np.isfinite(y).all():
            raise ValueError("crps: y contains NaN or infinite values")
        e = y[:, None] - q
        a = self.quantile_levels_[None]
        return 2 * np.maximum(a * e, (a - 1) * e).mean(1)
