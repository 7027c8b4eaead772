"""KL between the policy and the reference model: estimators, the two ways to use them, controllers.

Schulman, "Approximating KL Divergence" (joschu.net/blog/kl-approx.html). Tokens are sampled from pi
(the policy), log_ratio = log pi(a) - log pi_ref(a), clamped to [-clamp, clamp] (default 10) first (a clamped
token gets no gradient); float16 / bfloat16 inputs are computed in float32; masked positions are never read
and NaN on an action token raises a ValueError naming the rows (host tensors; on an accelerator the check
would stall the device, and a NaN reaches the train step's non-finite guard instead). The `kl` metric is a
0-dim tensor on the inputs' device:

| name | per-token estimate                      | notes                                               |
|------|-----------------------------------------|-----------------------------------------------------|
| k1   | log_ratio                               | unbiased for KL(pi||ref), high variance, can be < 0 |
| k2   | 0.5 * log_ratio^2                       | biased, low variance, >= 0                          |
| k3   | exp(-log_ratio) - 1 + log_ratio         | unbiased, >= 0, low variance (GRPO's choice)         |

As a LOSS (differentiated w.r.t. log pi on samples from pi, sampling not differentiated): the expected
gradient of k1 is 0, of k2 is grad KL(pi || ref) (the reverse KL, what the penalty means), of k3 is
grad KL(ref || pi) (the forward KL). Unbiased *values* (k1, k3) and the right *gradient* (k2) differ.

KL in the reward (PPO / REINFORCE++): `kl_estimate(...)` detached, passed as `AdvantageInputs.kl` with
`kl_coef` (R_t = -kl_coef * kl_t). KL as a loss (GRPO): `kl_loss(...)` gives coef * kl per token,
aggregated like the policy loss. Controllers (`KL_CONTROLLERS`) hold the coefficient: `fixed` and
`adaptive` (Ziegler et al., arXiv 1909.08593: proportional control towards a target KL), both with
`state_dict` / `load_state_dict` for exact resume.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor

from relayrl.algorithms.registry import KL_CONTROLLERS, KL_ESTIMATORS

Metrics = dict[str, Tensor | float]

KL_CLAMP = 10.0

__all__ = [  # the registries are re-exported for `from relayrl.algorithms.kl import KL_CONTROLLERS`
    "KL_CLAMP",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "k1",
    "k2",
    "k3",
    "kl_estimate",
    "kl_loss",
]


def k1(log_ratio: Tensor) -> Tensor:
    """log_ratio."""
    return log_ratio


def k2(log_ratio: Tensor) -> Tensor:
    """0.5 * log_ratio^2."""
    return 0.5 * log_ratio**2


def k3(log_ratio: Tensor) -> Tensor:
    """exp(-log_ratio) - 1 + log_ratio."""
    return torch.expm1(-log_ratio) + log_ratio


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    action_mask: Tensor,
    *,
    estimator: str = "k3",
    clamp: float = KL_CLAMP,
) -> tuple[Tensor, Metrics]:
    """Per-token KL(pi || ref) estimate [B, T] (0 off the mask); metric `kl` = sum over action tokens / their
    count (0 for an empty mask)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}")
    if not logprobs.shape == ref_logprobs.shape == action_mask.shape:
        raise ValueError(
            f"KL: logprobs {tuple(logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)} and action_mask "
            f"{tuple(action_mask.shape)} must all be [B, T]"
        )
    m = action_mask.bool()
    diff = _wide(logprobs) - _wide(ref_logprobs.detach())
    rows = (
        []
        if diff.device.type != "cpu"
        else (diff.detach().isnan() & m).any(dim=1).nonzero().flatten().tolist()
    )
    if rows:
        raise ValueError(f"KL: logprobs / ref_logprobs are NaN on action tokens of rows {rows[:10]}")
    log_ratio = torch.where(m, diff, 0.0).clamp(-clamp, clamp)
    kl = torch.where(m, KL_ESTIMATORS[estimator](log_ratio), 0.0)
    return kl, {"kl": kl.detach().sum() / m.sum().clamp(min=1)}


def _wide(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    action_mask: Tensor,
    *,
    coef: float,
    estimator: str = "k3",
    clamp: float = KL_CLAMP,
) -> tuple[Tensor, Metrics]:
    """KL as a loss term: coef * kl_t per token [B, T] (differentiable in logprobs); aggregate it with the
    same aggregation as the policy loss. Metrics: `kl`, `kl_coef`."""
    kl, metrics = kl_estimate(logprobs, ref_logprobs, action_mask, estimator=estimator, clamp=clamp)
    return coef * kl, {**metrics, "kl_coef": coef}


class KLController(Protocol):
    """Holds the KL coefficient; `update` once per step with the measured KL."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedKLController:
    """Constant coefficient."""

    def __init__(self, init_kl_coef: float, target: float | None = None, horizon: int | None = None) -> None:
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019 (arXiv 1909.08593): e = clip(KL / target - 1, -0.2, 0.2);
    beta <- beta * (1 + e * n_steps / horizon) (the paper's beta (1 + K_beta e) with K_beta = n_steps / horizon,
    as in their lm-human-preferences code, TRL and OpenRLHF), n_steps = samples (sequences) since the last update (their
    "batch size"), KL = the measured KL(pi || ref) in the same units as `target` (Ziegler et al. use the
    per-sequence KL with target 6 nats; with a per-token mean KL metric pick a per-token target). Defaults
    target 6.0, horizon 10000. A non-finite KL raises (it would poison beta for the rest of the run)."""

    def __init__(self, init_kl_coef: float, target: float | None = 6.0, horizon: int | None = 10000) -> None:
        if target is None or target <= 0 or horizon is None or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs target > 0 and horizon > 0, got target={target}, horizon={horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            raise ValueError(f"adaptive KL controller got a non-finite KL {current_kl}; check the KL metric")
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])
