"""Curvature and subspace operations on flattened parameters: the matrix-free (fast) side of the probes.

Every function works on a flat view of a parameter list: ``P`` is the total number of entries. A loss callable
has the signature ``loss_fn(model, batch) -> scalar tensor``; a batch is a tensor, a tuple of tensors or a dict of
tensors (a Hugging Face batch: ``input_ids``, ``attention_mask``, ``labels``, each (N, T)) whose leading dimension
indexes examples, so that it can be split into per-example batches. ``reference.py`` holds the dense
versions (explicit Hessian, Fisher and projectors) that the tests compare against.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def double_backward_ok():
    """A context in which second derivatives exist: the fused CPU attention kernel has no double backward, so
    scaled-dot-product attention falls back to its plain math implementation inside it."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one flat (P,) vector (detached)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split a flat (P,) vector into tensors shaped like ``like``."""
    sizes = [t.numel() for t in like]
    if vector.numel() != sum(sizes):
        raise ValueError(f"vector has {vector.numel()} entries, the parameters {sum(sizes)}")
    return [chunk.view_as(t) for chunk, t in zip(vector.split(sizes), like)]


@torch.no_grad()
def write_flat(params: Sequence[torch.Tensor], vector: torch.Tensor) -> None:
    """Copy a flat (P,) vector into the parameters in place."""
    for p, chunk in zip(params, unflatten(vector, params)):
        p.copy_(chunk)


def _example_tensors(batch: Any) -> list[torch.Tensor] | None:
    """The tensors of a batch that carry the example dimension, or None for a batch we cannot look into."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):  # HF batches: dict or BatchEncoding of (N, T) tensors; scalars pass through
        return [v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    if isinstance(batch, (tuple, list)):
        return list(batch)
    return None


def batch_size(batch: Any) -> int | None:
    """Number of examples N in a batch: a tensor (N, ...), a tuple/list of tensors (N, ...) or a mapping (an HF
    dict batch) whose tensor values are (N, ...). None for any other object (the loss callable owns its meaning).

    Raises ValueError when the tensors disagree on N, when a tuple holds a non-tensor, or when the batch holds no
    tensor at all (an empty tuple or dict)."""
    parts = _example_tensors(batch)
    if parts is None:
        return None
    if not parts:
        raise ValueError(f"the batch ({type(batch).__name__}) holds no tensor with an example dimension: it is empty")
    if any(not isinstance(t, torch.Tensor) or t.dim() == 0 for t in parts):
        raise TypeError("a tuple/list batch must hold tensors whose leading dimension indexes examples")
    n = parts[0].shape[0]
    if any(t.shape[0] != n for t in parts):
        raise ValueError(f"every tensor of a batch needs the same leading (example) dimension, got "
                         f"{[t.shape[0] for t in parts]}")
    return int(n)


def split_examples(batch: Any) -> list[Any]:
    """A batch as N single-example batches of the same form: tensor slices (1, ...), tuples of them, or dicts whose
    tensor values are sliced (non-tensor and 0-d values are shared by every example)."""
    n = batch_size(batch)
    if n is None:
        raise TypeError(f"cannot split a {type(batch).__name__} into examples: the Fisher probes need a tensor, a "
                        "tuple/list of tensors or a dict of tensors whose leading dimension indexes examples")
    if isinstance(batch, torch.Tensor):
        return [batch[i:i + 1] for i in range(n)]
    if isinstance(batch, Mapping):
        return [{k: v[i:i + 1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
                for i in range(n)]
    return [tuple(t[i:i + 1] for t in batch) for i in range(n)]


def loss_and_grad(model: nn.Module, loss_fn: LossFn, batch: Any, params: Sequence[torch.Tensor],
                  *, create_graph: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Loss and its gradient w.r.t. ``params``; parameters that do not require grad (frozen) get zeros."""
    loss = loss_fn(model, batch)
    live = [p for p in params if p.requires_grad]
    found = iter(torch.autograd.grad(loss, live, create_graph=create_graph, allow_unused=True) if live else ())
    grads = []
    for p in params:
        g = next(found) if p.requires_grad else None
        grads.append(torch.zeros_like(p) if g is None else g)
    return loss, tuple(grads)


def hvp(model: nn.Module, loss_fn: LossFn, batch: Any, params: Sequence[torch.Tensor],
        vectors: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Hessian-vector products H v by double backward (Pearlmutter).

    Args:
        vectors: (P,) or (m, P) flat directions.
    Returns:
        ``(loss, grad (P,), Hv)`` with Hv shaped like ``vectors``.
    """
    params = list(params)
    vs = vectors.reshape(-1, vectors.shape[-1])
    with double_backward_ok():
        loss, grads = loss_and_grad(model, loss_fn, batch, params, create_graph=True)
        flat_g = torch.cat([g.reshape(-1) for g in grads])
        out = []
        for i, v in enumerate(vs):
            if not flat_g.requires_grad:  # the loss is linear in the parameters: H = 0
                out.append(torch.zeros_like(v))
                continue
            live = [p for p in params if p.requires_grad]
            found = iter(torch.autograd.grad(flat_g, live, grad_outputs=v.to(flat_g.dtype),
                                             retain_graph=i < len(vs) - 1, allow_unused=True))
            hv = [next(found) if p.requires_grad else None for p in params]
            out.append(torch.cat([(torch.zeros_like(p) if h is None else h).reshape(-1) for p, h in zip(params, hv)]))
    return float(loss.detach()), flat_g.detach(), torch.stack(out).reshape(vectors.shape)


def per_example_grads(model: nn.Module, loss_fn: LossFn, batch: Any, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-example gradients G, shape (N, P): row i is the gradient of the loss on example i alone."""
    rows = [flatten(loss_and_grad(model, loss_fn, ex, params)[1]) for ex in split_examples(batch)]
    return torch.stack(rows)


def fisher_vp(grads: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """Empirical-Fisher products F v with F = G^T G / N, from per-example gradients G (N, P); never forms F."""
    vs = vectors.reshape(-1, vectors.shape[-1])
    out = (vs @ grads.T) @ grads / grads.shape[0]
    return out.reshape(vectors.shape)


def fisher_top_directions(grads: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k eigenpairs of the empirical Fisher G^T G / N via the thin SVD of G (N, P).

    Returns ``(eigenvalues (k,), U (P, k))`` with orthonormal columns, largest first.
    """
    if k > min(grads.shape):
        raise ValueError(f"k={k} exceeds the rank bound min(N, P) = {min(grads.shape)} of the empirical Fisher")
    _, s, vh = torch.linalg.svd(grads.double(), full_matrices=False)
    return (s[:k] ** 2 / grads.shape[0]).to(grads.dtype), vh[:k].T.to(grads.dtype)


def lanczos_top_eigs(matvec: Callable[[torch.Tensor], torch.Tensor], dim: int, k: int, *, iters: int = 40,
                     generator: torch.Generator | None = None,
                     dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (largest algebraic) eigenpairs of a symmetric operator given only ``matvec`` (Lanczos with full
    reorthogonalisation, so the Ritz vectors stay orthonormal). Returns ``(eigenvalues (k,), U (dim, k))``."""
    m = min(iters, dim)
    if k > m:
        raise ValueError(f"k={k} exceeds the Lanczos subspace size min(iters, dim) = {m}")
    q = torch.randn(dim, generator=generator, dtype=dtype)
    q = q / q.norm()
    basis, alphas, betas = [q], [], []
    for j in range(m):
        w = matvec(basis[j]).to(dtype)
        alphas.append(torch.dot(w, basis[j]))
        stack = torch.stack(basis)
        w = w - stack.T @ (stack @ w)
        w = w - stack.T @ (stack @ w)  # twice is enough (Kahan-Parlett)
        beta = w.norm()
        if j == m - 1 or beta < 1e-10 * max(1.0, float(torch.stack(alphas).abs().max())):
            break
        betas.append(beta)
        basis.append(w / beta)
    n = len(alphas)
    tri = torch.diag(torch.stack(alphas))
    if n > 1:
        off = torch.stack(betas[: n - 1])
        tri = tri + torch.diag(off, 1) + torch.diag(off, -1)
    evals, evecs = torch.linalg.eigh(tri)
    order = torch.argsort(evals, descending=True)[:k]
    if len(order) < k:
        raise ValueError(f"the operator's Krylov space has dimension {n} < k={k}")
    return evals[order], torch.stack(basis[:n]).T @ evecs[:, order]


def top_subspace(updates: torch.Tensor, q: int) -> torch.Tensor:
    """Orthonormal basis (P, q) of the top-q left singular subspace of the update matrix (P, K)."""
    u, _, _ = torch.linalg.svd(updates.double(), full_matrices=False)
    return u[:, :q].to(updates.dtype)


def principal_angles(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Principal angles (radians, ascending) between the column spaces of orthonormal U (P, q) and V (P, q')."""
    cos = torch.linalg.svdvals(u.double().T @ v.double()).clamp(0.0, 1.0)
    return torch.arccos(cos).to(u.dtype)


def subspace_overlap(u: torch.Tensor, v: torch.Tensor) -> float:
    """||U^T V||_F^2 / q for orthonormal U, V (P, q): 1 when the subspaces coincide, q/P on average at random."""
    return float((u.double().T @ v.double()).pow(2).sum() / u.shape[1])


def project_out(delta: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """(I - U U^T) delta for an orthonormal basis U (P, k); ``delta`` is (P,) or (m, P)."""
    if basis.numel() == 0:
        return delta
    return delta - (delta @ basis) @ basis.T
