"""The DP optimizer: per-sample clipping, noise once per logical step, accumulation over physical
batches, over the gradient-sink contract (:mod:`fxdp.grad_sample.sink`) only."""

from fxdp.optim.dp_optimizer import CLIPPING_MODES, DPOptimizer
from fxdp.optim.noise import add_gaussian_noise_, gaussian_noise, secure_standard_normal

__all__ = ["CLIPPING_MODES", "DPOptimizer", "add_gaussian_noise_", "gaussian_noise", "secure_standard_normal"]
