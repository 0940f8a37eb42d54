"""One short run: a DP step (make_private, book-keeping, noise) eager vs ``torch.compile`` (inductor) of the
private model, on a small MLP and a one-head attention model. ``python benchmarks/compile_speed.py``;
figures in docs/torch_compile.md."""
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

warnings.simplefilter("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402


from torch.utils.data import DataLoader, TensorDataset
from fxdp.privacy_engine import PrivacyEngine
torch.set_num_threads(2)
def bench(name, make, make_x, compiled, steps=30):
    torch.manual_seed(0); model = make()
    data = TensorDataset(make_x(64), torch.randint(0, 3, (64,)))
    pm, opt, _ = PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=64), noise_multiplier=1.0, max_grad_norm=1.0, example_inputs=(make_x(64),), poisson_sampling=False)
    run = torch.compile(pm) if compiled else pm
    x, y = make_x(64), torch.randint(0, 3, (64,))
    def step():
        opt.zero_grad(); F.cross_entropy(run(x), y).backward(); opt.step()
    for _ in range(3): step()
    t = time.perf_counter()
    for _ in range(steps): step()
    return (time.perf_counter() - t) / steps * 1e3
mlp = lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3))
for name, make, mx in [("mlp 64-256-256-3, batch 64", mlp, lambda n: torch.randn(n, 64)),
                       ("attention d=16 T=6, batch 64", models.OneHeadAttention, lambda n: torch.randint(0, 20, (n, 6)))]:
    e = bench(name, make, mx, False); c = bench(name, make, mx, True)
    print(f"{name}: eager {e:.2f} ms/step, torch.compile {c:.2f} ms/step ({e / c:.2f}x)")
