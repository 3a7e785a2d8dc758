"""Replay buffers with the data's origin kept apart: a fixed offline buffer over a D4RL-layout dataset and a
ring-buffer for online transitions. DARE needs the two separately because origin labels define the batches
B_off and B_on before its exchange; a mixed batch draws ``rho * N`` from one and ``(1 - rho) * N`` from the other.

A batch is a dict of tensors on ``device``: observations (B, obs), actions (B, act), rewards (B,),
next_observations (B, obs), dones (B,) (= terminals; timeouts still bootstrap).
"""

from __future__ import annotations

import numpy as np
import torch

from .datasets import return_to_go, validate

_FIELDS = ("observations", "actions", "rewards", "next_observations", "dones")


class OfflineBuffer:
    """The fixed offline dataset D_off (read-only), sampled uniformly.

    Args:
        data: D4RL-layout dict (validated here).
        device: where sampled batches live.
        reward_scale, reward_bias: r' = scale * r + bias (CORL's antmaze convention is scale 1, bias -1 for IQL).
        mc_discount: when set, batches also carry ``mc_returns`` (B,), the discounted return-to-go of r' (Cal-QL's
            calibration bound, ``datasets.return_to_go``; ``sparse_failure_reward`` is passed on to it).
    """

    def __init__(self, data: dict, device: torch.device | str = "cpu", *, reward_scale: float = 1.0,
                 reward_bias: float = 0.0, mc_discount: float | None = None,
                 sparse_failure_reward: float | None = None) -> None:
        data = validate(data)
        self.device = torch.device(device)
        self._t = {
            "observations": torch.as_tensor(data["observations"], device=self.device),
            "actions": torch.as_tensor(data["actions"], device=self.device),
            "rewards": torch.as_tensor(data["rewards"] * reward_scale + reward_bias, device=self.device),
            "next_observations": torch.as_tensor(data["next_observations"], device=self.device),
            "dones": torch.as_tensor(data["terminals"], device=self.device),
        }
        if mc_discount is not None:
            self._t["mc_returns"] = torch.as_tensor(
                return_to_go(data, mc_discount, reward_scale=reward_scale, reward_bias=reward_bias,
                             sparse_failure_reward=sparse_failure_reward), device=self.device)

    def __len__(self) -> int:
        return len(self._t["rewards"])

    def sample(self, batch_size: int, generator: torch.Generator) -> dict:
        idx = torch.randint(0, len(self), (batch_size,), generator=generator).to(self.device)
        return {k: v[idx] for k, v in self._t.items()}

    def state_dict(self) -> dict:
        return {}


class OnlineBuffer:
    """Ring buffer D_on for transitions collected online.

    Args:
        obs_dim, act_dim: sizes; capacity: the most transitions kept (oldest overwritten).
        reward_scale, reward_bias: applied on ``add`` (same convention as the offline buffer).
    """

    def __init__(self, obs_dim: int, act_dim: int, capacity: int, device: torch.device | str = "cpu", *,
                 reward_scale: float = 1.0, reward_bias: float = 0.0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.device = int(capacity), torch.device(device)
        self.reward_scale, self.reward_bias = reward_scale, reward_bias
        self._t = {"observations": torch.zeros(capacity, obs_dim), "actions": torch.zeros(capacity, act_dim),
                   "rewards": torch.zeros(capacity), "next_observations": torch.zeros(capacity, obs_dim),
                   "dones": torch.zeros(capacity)}
        self._t = {k: v.to(self.device) for k, v in self._t.items()}
        self.ptr, self.size = 0, 0

    def __len__(self) -> int:
        return self.size

    def add(self, obs, action, reward: float, next_obs, terminal: bool) -> None:
        """Store one transition; ``terminal`` is the env's ``terminated`` flag (not ``truncated``)."""
        i = self.ptr
        self._t["observations"][i] = torch.as_tensor(np.asarray(obs, dtype=np.float32), device=self.device)
        self._t["actions"][i] = torch.as_tensor(np.asarray(action, dtype=np.float32), device=self.device)
        self._t["rewards"][i] = float(reward) * self.reward_scale + self.reward_bias
        self._t["next_observations"][i] = torch.as_tensor(np.asarray(next_obs, dtype=np.float32), device=self.device)
        self._t["dones"][i] = float(terminal)
        self.ptr = (self.ptr + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator) -> dict:
        if self.size == 0:
            raise ValueError("cannot sample from an empty online buffer")
        idx = torch.randint(0, self.size, (batch_size,), generator=generator).to(self.device)
        return {k: v[idx] for k, v in self._t.items()}

    def state_dict(self) -> dict:
        return {"tensors": {k: v[: self.size].cpu().clone() if self.size < self.capacity else v.cpu().clone()
                            for k, v in self._t.items()}, "ptr": self.ptr, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state["tensors"].items():
            self._t[k][: len(v)] = v.to(self.device)
        self.ptr, self.size = int(state["ptr"]), int(state["size"])


def mixed_batch(offline: OfflineBuffer, online: OnlineBuffer, batch_size: int, mixing_ratio: float,
                generator: torch.Generator) -> tuple[dict, torch.Tensor]:
    """``round(rho N)`` samples from D_off and the rest from D_on, concatenated; returns ``(batch, from_offline)``
    with ``from_offline`` a (B,) bool tensor (the origin label). An empty online buffer gives an all-offline batch.
    Extra offline fields (``mc_returns``) are zero for online samples, as in CORL's Cal-QL online buffer."""
    n_off = batch_size if len(online) == 0 else int(round(mixing_ratio * batch_size))
    parts, origin = [], []
    if n_off > 0:
        parts.append(offline.sample(n_off, generator))
        origin.append(torch.ones(n_off, dtype=torch.bool))
    if batch_size - n_off > 0:
        parts.append(online.sample(batch_size - n_off, generator))
        origin.append(torch.zeros(batch_size - n_off, dtype=torch.bool))
    fields = list(_FIELDS) + [k for k in parts[0] if k not in _FIELDS]
    batch = {k: torch.cat([p[k] if k in p else torch.zeros_like(parts[0][k][: len(p["rewards"])]) for p in parts])
             for k in fields}
    return batch, torch.cat(origin).to(batch["rewards"].device)
