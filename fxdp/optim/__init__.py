"""The DP optimizer: per-sample clipping, noise once per logical step, accumulation over physical
batches, over the gradient-sink contract (:mod:`fxdp.grad_sample.sink`) only; schedules of its noise and
clipping bound (:mod:`fxdp.optim.schedulers`)."""

from fxdp.optim.adaclip import AdaClipDPOptimizer
from fxdp.optim.dp_optimizer import CLIPPING_MODES, DPOptimizer, DPPerLayerOptimizer
from fxdp.optim.noise import add_gaussian_noise_, gaussian_noise, secure_standard_normal
from fxdp.optim.schedulers import (ExponentialGradClip, ExponentialNoise, LambdaGradClip, LambdaNoise, StepGradClip,
                                   StepNoise)

__all__ = ["AdaClipDPOptimizer", "CLIPPING_MODES", "DPOptimizer", "DPPerLayerOptimizer", "ExponentialGradClip", "ExponentialNoise", "LambdaGradClip", "LambdaNoise",
           "StepGradClip", "StepNoise", "add_gaussian_noise_", "gaussian_noise", "secure_standard_normal"]
