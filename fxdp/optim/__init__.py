"""The DP optimizer: per-sample clipping, noise once per logical step, accumulation over physical
batches, over the gradient-sink contract (:mod:`fxdp.grad_sample.sink`) only."""

from fxdp.optim.dp_optimizer import CLIPPING_MODES, DPOptimizer


class DPOptimizerFastGradientClipping(DPOptimizer):
    """Opacus's optimizer for fast gradient (ghost) clipping: fxdp's DPOptimizer, which reads per-sample norms
    and clipped sums from the model's sink whichever sink it is (a book-keeping one here:
    ``DPLossFastGradientClipping`` points the optimizer at its module's sink, or pass ``sink=``)."""

from fxdp.optim.noise import add_gaussian_noise_, gaussian_noise, secure_standard_normal

__all__ = ["CLIPPING_MODES", "DPOptimizer", "DPOptimizerFastGradientClipping", "add_gaussian_noise_", "gaussian_noise", "secure_standard_normal"]
