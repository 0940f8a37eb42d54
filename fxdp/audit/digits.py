"""Digits-sized data for audits from the command line, the docs' measurements and the tests.

scikit-learn's digits (1797 images of 8x8 pixels, 10 classes, flattened to 64 features in [0, 1]) when
scikit-learn is installed; otherwise a synthetic stand-in of the same size and shape (one random
prototype per class plus noise), so an audit runs without the optional extra. The audit's bound does
not depend on what the data are: the gradient canaries live in coordinates the data never touch.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch.utils.data import TensorDataset

SKLEARN = "scikit-learn's digits"
STAND_IN = "a digits-sized synthetic stand-in (scikit-learn is not installed)"


def digits(seed: int = 0) -> Tuple[TensorDataset, str]:
    """``(dataset of (x: (64,) float32 in [0, 1], y: int64), where the data came from)``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return synthetic_digits(seed), STAND_IN
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0  # pixels are 0..16: scale by the known maximum
    return TensorDataset(x, torch.tensor(data.target, dtype=torch.int64)), SKLEARN


def synthetic_digits(seed: int = 0, n: int = 1797, features: int = 64, classes: int = 10) -> TensorDataset:
    """``n`` samples of ``features`` values in [0, 1]: a random prototype per class plus noise."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.rand(classes, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    x = (prototypes[y] + 0.3 * torch.randn(n, features, generator=g)).clamp(0.0, 1.0)
    return TensorDataset(x, y)


__all__ = ["digits", "synthetic_digits"]
