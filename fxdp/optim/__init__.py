"""The DP optimizer: per-sample clipping, noise once per logical step, accumulation over physical
batches, over the gradient-sink contract (:mod:`fxdp.sinks.contract`) only; schedules of its noise and
clipping bound (:mod:`fxdp.optim.schedulers`)."""

from fxdp.optim.adaclip import AdaClipDPOptimizer
from fxdp.optim.dp_optimizer import CLIPPING_MODES, DPOptimizer, DPPerLayerOptimizer
from fxdp.optim.noise import add_gaussian_noise_, add_gaussian_noise_all_, gaussian_noise, secure_standard_normal
from fxdp.optim.user_level import UserLevelDPOptimizer
from fxdp.optim.schedulers import (ExponentialGradClip, ExponentialNoise, LambdaGradClip, LambdaNoise, StepGradClip,
                                   StepNoise)


class DPOptimizerFastGradientClipping(DPOptimizer):
    """Opacus's optimizer for fast gradient (ghost) clipping: fxdp's DPOptimizer, which reads per-sample norms
    and clipped sums from the model's sink whichever sink it is (a book-keeping one here:
    ``DPLossFastGradientClipping`` points the optimizer at its module's sink, or pass ``sink=``)."""


__all__ = ["AdaClipDPOptimizer", "CLIPPING_MODES", "DPOptimizer", "DPOptimizerFastGradientClipping",
           "DPPerLayerOptimizer", "ExponentialGradClip", "ExponentialNoise", "LambdaGradClip", "LambdaNoise",
           "StepGradClip", "StepNoise", "UserLevelDPOptimizer", "add_gaussian_noise_", "add_gaussian_noise_all_",
           "gaussian_noise", "secure_standard_normal"]
