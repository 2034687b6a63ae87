"""KL coefficient controllers: a fixed coefficient or the adaptive one of Ziegler et al.

The coefficient weighs the KL to the reference policy, whether it enters as a per-token reward
penalty (:func:`flowrl.algorithms.token_advantages.sequence_reward_to_tokens`) or as a loss
term. A controller is plain state: the trainer reads :attr:`coef` each step, calls
:meth:`update` with the KL it measured, and saves :meth:`state_dict` with its checkpoints so a
resumed run continues with the coefficient it had reached.
"""

from __future__ import annotations

import math
from typing import Protocol

PROPORTIONAL_ERROR_CLIP = 0.2
"""The adaptive controller clips ``KL / target - 1`` to [-0.2, 0.2] (Ziegler et al. 2019), so
one noisy measurement moves the coefficient by at most ``0.2 * num_steps / horizon``."""


class KLController(Protocol):
    """A KL coefficient that may change with the measured KL."""

    @property
    def coef(self) -> float: ...

    def update(self, current_kl: float, num_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


def _check_coef(coef: float, name: str) -> float:
    if not math.isfinite(coef) or coef < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {coef}")
    return float(coef)


def _coef_from_state(state: dict[str, float], owner: str) -> float:
    if "coef" not in state:
        raise ValueError(
            f"{owner} state must have a 'coef' entry, got keys {sorted(state)}; "
            "was the checkpoint written by another controller?"
        )
    return _check_coef(state["coef"], "coef")


class FixedKLController:
    """A coefficient that never changes; :meth:`update` is a no-op."""

    def __init__(self, coef: float) -> None:
        self._coef = _check_coef(coef, "coef")

    @property
    def coef(self) -> float:
        return self._coef

    def update(self, current_kl: float, num_steps: int) -> None:
        """Ignore the measurement (kept so both controllers are driven the same way)."""

    def state_dict(self) -> dict[str, float]:
        return {"coef": self._coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._coef = _coef_from_state(state, "FixedKLController")


class AdaptiveKLController:
    """Steers the measured KL toward ``target`` (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences", section 2.2).

    After each measurement ``KL``:

        ``error = clip(KL / target - 1, -0.2, 0.2)``
        ``coef = coef * (1 + error * num_steps / horizon)``

    so a KL above target raises the penalty and one below lowers it, by at most 20% of
    ``num_steps / horizon`` per update. ``num_steps`` and ``horizon`` share a unit: Ziegler et
    al. and TRL's PPO counted samples (``num_steps`` = batch size, horizon 10000).
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        self._coef = _check_coef(init_coef, "init_coef")
        if not target > 0:
            raise ValueError(f"target KL must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.target = float(target)
        self.horizon = float(horizon)

    @property
    def coef(self) -> float:
        return self._coef

    def update(self, current_kl: float, num_steps: int) -> None:
        """Move the coefficient after measuring ``current_kl`` over ``num_steps`` steps."""
        if not math.isfinite(current_kl):
            raise ValueError(
                f"measured KL is {current_kl}; the coefficient would become NaN. The policy "
                "or the reference log-probabilities are broken (check the KL estimator input)"
            )
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        error = current_kl / self.target - 1.0
        error = min(max(error, -PROPORTIONAL_ERROR_CLIP), PROPORTIONAL_ERROR_CLIP)
        # Only num_steps > 5 * horizon could make the factor negative; a negative coefficient
        # would reward drifting away from the reference, so stop at 0 instead.
        self._coef *= max(1.0 + error * num_steps / self.horizon, 0.0)

    def state_dict(self) -> dict[str, float]:
        """Only the coefficient is state; target and horizon come from the config."""
        return {"coef": self._coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._coef = _coef_from_state(state, "AdaptiveKLController")
