"""``AdaClipDPOptimizer``: DP-SGD whose clipping bound follows a target quantile of the per-sample norms
(Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially private learning with adaptive clipping").

Each logical step releases, besides the noised clipped sum, a noised count of the samples that were not
clipped, centred: ``b = sum_i (1[norm_i <= C] - 1/2) + N(0, unclipped_num_std^2)``. The bound moves
geometrically towards the target quantile ``gamma``:

    frac = b / expected_batch_size + 1/2          (the expected, never the actual, batch size)
    C   <- clamp(C * exp(-clipbound_learning_rate * (frac - gamma)), min_clipbound, max_clipbound)

Privacy: adding or removing one sample moves the clipped sum by at most ``C`` and the centred count by at most
``1/2``. With the gradient's noise std ``sigma_g * C`` and the count's ``sigma_b`` (``unclipped_num_std``), the
two releases together are ONE Gaussian mechanism on the same Poisson batch whose sensitivity, in units of
its noise, is ``sqrt(sigma_g^-2 + (2 sigma_b)^-2)``. Choosing ``sigma_g = (sigma^-2 - (2 sigma_b)^-2)^-1/2``
makes that ``1 / sigma``: each step is exactly the Poisson-subsampled Gaussian mechanism with the user's
``noise_multiplier`` ``sigma``, which is what the accountant records (so ``sigma < 2 sigma_b`` is required).
The centring and the division by the expected batch size are what make the count's sensitivity 1/2 and the
batch's actual size unreleased; the count is computed over the logical batch (all its physical batches).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from fxdp.optim.dp_optimizer import DPOptimizer
from fxdp.optim.noise import gaussian_noise
from fxdp.sinks.contract import PrivacySettingError


class AdaClipDPOptimizer(DPOptimizer):
    """:class:`DPOptimizer` with an adaptive clipping bound (Opacus's signature; flat clipping only). See the
    module docstring for the update and its privacy; ``noise_multiplier`` is the accounted sigma, the gradient's
    own noise multiplier is :attr:`gradient_noise_multiplier`."""

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, target_unclipped_quantile: float,
                 clipbound_learning_rate: float, max_clipbound: float, min_clipbound: float,
                 unclipped_num_std: float, max_grad_norm: float, expected_batch_size: Optional[int],
                 loss_reduction: str = "mean", generator: Optional[torch.Generator] = None,
                 secure_mode: bool = False, **kwargs: Any):
        if kwargs.get("clipping", "flat") != "flat":
            raise PrivacySettingError("fxdp: AdaClipDPOptimizer adapts one flat bound; clipping must be 'flat'")
        if not max_clipbound > min_clipbound > 0:
            raise PrivacySettingError(f"fxdp: need max_clipbound > min_clipbound > 0, got {max_clipbound} and "
                                      f"{min_clipbound}")
        if not 0 <= target_unclipped_quantile <= 1:
            raise PrivacySettingError(f"fxdp: target_unclipped_quantile must lie in [0, 1], got "
                                      f"{target_unclipped_quantile}")
        if noise_multiplier > 0 and not noise_multiplier < 2 * unclipped_num_std:
            raise PrivacySettingError(
                f"fxdp: noise_multiplier must be smaller than 2 * unclipped_num_std (got {noise_multiplier} and "
                f"2 * {unclipped_num_std}): the count of unclipped samples spends part of each step's privacy, "
                "and the gradient's noise must make up the rest (Andrew et al. 2021, Theorem 1)")
        self.target_unclipped_quantile = float(target_unclipped_quantile)
        self.clipbound_learning_rate = float(clipbound_learning_rate)
        self.max_clipbound = float(max_clipbound)
        self.min_clipbound = float(min_clipbound)
        self.unclipped_num_std = float(unclipped_num_std)
        self._centred_count = 0.0  # sum over the logical batch so far of (1[unclipped] - 1/2)
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected_batch_size, loss_reduction=loss_reduction,
                         generator=generator, secure_mode=secure_mode, **kwargs)
        if self.expected_batch_size is None:
            raise PrivacySettingError("fxdp: AdaClipDPOptimizer needs expected_batch_size: the unclipped fraction "
                                      "is the noised count over it (the actual batch size is not released)")

    @property
    def gradient_noise_multiplier(self) -> float:
        """``(sigma^-2 - (2 sigma_b)^-2)^-1/2``: the gradient's share of the step's noise (module docstring)."""
        if self.noise_multiplier == 0:
            return 0.0
        return (self.noise_multiplier ** -2 - (2 * self.unclipped_num_std) ** -2) ** -0.5

    @property
    def noise_std(self) -> float:
        return self.gradient_noise_multiplier * self.sensitivity

    def _check_settings(self) -> None:
        super()._check_settings()
        if self.noise_multiplier > 0 and not self.noise_multiplier < 2 * self.unclipped_num_std:
            raise PrivacySettingError(f"fxdp: noise_multiplier ({self.noise_multiplier}) must stay smaller than "
                                      f"2 * unclipped_num_std ({2 * self.unclipped_num_std})")

    def _clip_factors(self, norms: Dict[nn.Parameter, torch.Tensor]) -> Dict[nn.Parameter, torch.Tensor]:
        factors = super()._clip_factors(norms)
        factor = next(iter(factors.values()))
        unclipped = int((factor >= 1.0).sum())
        self._centred_count += unclipped - factor.shape[0] / 2
        return factors

    def _before_update(self) -> None:
        count = self._centred_count
        self._centred_count = 0.0
        if self.noise_multiplier > 0:
            count += float(gaussian_noise(torch.zeros(1, dtype=torch.float64), self.unclipped_num_std,
                                          secure_mode=self.secure_mode, generator=self.generator))
        fraction = count / self.expected_batch_size + 0.5
        bound = self.max_grad_norm * math.exp(-self.clipbound_learning_rate * (fraction - self.target_unclipped_quantile))
        self.max_grad_norm = min(max(bound, self.min_clipbound), self.max_clipbound)

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        state["fxdp"]["adaclip_centred_count"] = self._centred_count
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "fxdp" in state_dict:  # the bound this optimizer learnt is its state, not a setting: it is resumed
            self.max_grad_norm = state_dict["fxdp"]["max_grad_norm"]
        super().load_state_dict(state_dict)
        self._centred_count = state_dict.get("fxdp", {}).get("adaclip_centred_count", 0.0)
