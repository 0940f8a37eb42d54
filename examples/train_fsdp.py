"""Private training (DP-SGD) of a model sharded with FSDP2 (``fully_shard``) across processes.

    pip install -e ".[examples]"
    torchrun --nproc_per_node=2 examples/train_fsdp.py            # --quick: a short run

The usual FSDP2 pattern, unchanged: ``init_process_group``, a device mesh, ``fully_shard`` on each block
and then on the root model, each rank's ``DataLoader`` reading the whole training set through a
``DistributedSampler``, then ``PrivacyEngine.make_private``. Each rank keeps a shard of every parameter
(and of its gradient and optimizer state); a block's full weights exist only while FSDP runs its forward
or backward. fxdp Poisson-samples the global dataset (each rank keeps its share of one shared draw), clips
each sample on its rank (a sample's per-sample norm needs nothing from the other ranks), and reduce-scatters
the clipped sums into each rank's shard, with the noise of every coordinate drawn once. Every rank reports
the same epsilon: that of one process on the global batch. See docs/distributed.md ("FSDP2", and when to
use DDP instead).

The data are scikit-learn's digits (examples/train_digits.py), the model a stack of residual MLP blocks,
each one ``fully_shard`` unit. gloo on CPU by default; ``--backend nccl`` puts rank r on GPU ``LOCAL_RANK``.
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from train_digits import load_digits_split  # the script's own folder is on sys.path


class Block(nn.Module):
    """``x + tanh(W x + b)``: one fully_shard unit."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class DeepMLP(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, images):
        x = torch.tanh(self.stem(images.flatten(1)))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Private training (DP-SGD) of a model sharded with FSDP2 (torchrun) with fxdp.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=256,
                        help="expected GLOBAL (Poisson) batch size; each rank reads about batch size / world size")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4, help="residual blocks, each its own fully_shard unit")
    parser.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C")
    noise = parser.add_mutually_exclusive_group()
    noise.add_argument("--target-epsilon", type=float, default=3.0,
                       help="calibrate the noise so that the whole run spends this epsilon")
    noise.add_argument("--noise-multiplier", type=float, default=None, help="fixed noise multiplier sigma")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: one GPU per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-subset", type=int, default=None, help="train on the first N samples only")
    parser.add_argument("--quick", action="store_true", help="a short run: 2 epochs on 400 digits")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.train_subset, args.batch_size = 2, args.train_subset or 400, 100
    return args


def main(argv: Optional[List[str]] = None):
    args = parse_args(argv)
    import fxdp
    from fxdp.privacy_engine import PrivacyEngine
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(args.backend)  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(args.seed)  # every rank builds the same weights: fully_shard keeps each rank's rows of them
    model = DeepMLP(args.width, args.depth).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root last: the stem and the head are its own parameters

    train_set, test_set = load_digits_split(args.train_subset)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = DataLoader(train_set, batch_size=max(1, args.batch_size // world_size),
                        sampler=DistributedSampler(train_set, seed=args.seed))
    engine = PrivacyEngine()
    common = dict(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=args.max_grad_norm)
    if args.noise_multiplier is not None:
        model, optimizer, loader = engine.make_private(noise_multiplier=args.noise_multiplier, **common)
    else:
        model, optimizer, loader = engine.make_private_with_epsilon(
            target_epsilon=args.target_epsilon, target_delta=args.delta, epochs=args.epochs, **common)
    if rank == 0:
        print(fxdp.report(model), flush=True)
        print(f"{world_size} processes ({args.backend}), FSDP2 over a mesh of {world_size}; Poisson sampling of the "
              f"{len(train_set)} training digits at rate {loader.sample_rate:.4f}: expected global batch "
              f"{optimizer.expected_batch_size}, {len(loader)} steps per epoch; C = {optimizer.max_grad_norm}, "
              f"noise multiplier {optimizer.noise_multiplier:.3f}", flush=True)

    test_images, test_labels = (t.to(device) for t in test_set.tensors)
    for epoch in range(1, args.epochs + 1):
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            # A rank's share of a Poisson batch can be empty: loss 0; it still runs the model (FSDP gathers
            # the blocks on every rank) and steps (the reduce-scatter needs every rank).
            out = model(images)
            loss = F.cross_entropy(out, labels) if len(labels) else out.sum()
            loss.backward()
            optimizer.step()
        with torch.no_grad():  # every rank runs the evaluation: FSDP gathers each block on all ranks
            accuracy = (model(test_images).argmax(dim=1) == test_labels).float().mean().item()
        epsilon = engine.get_epsilon(args.delta)
        if rank == 0:
            print(f"epoch {epoch:3d}   test accuracy {100 * accuracy:5.1f}%   epsilon {epsilon:.2f} "
                  f"(delta {args.delta:g})", flush=True)

    epsilons = [None] * world_size
    dist.all_gather_object(epsilons, epsilon)
    plain = getattr(model, "module", model)
    plain.reshard()  # FSDP leaves the root's parameters gathered after a forward without backward (the evaluation)
    held = sum(p.to_local().numel() for p in plain.parameters())
    total = sum(p.numel() for p in plain.parameters())
    helds = [None] * world_size
    dist.all_gather_object(helds, held)
    if rank == 0:
        print(f"each rank holds {', '.join(map(str, helds))} of the {total} parameter values; "
              f"epsilon on every rank: {', '.join(f'{e:.4f}' for e in epsilons)}", flush=True)
        print(f"final: test accuracy {100 * accuracy:.1f}% at epsilon {epsilon:.2f} (delta {args.delta:g}); "
              f"same epsilon on all {world_size} ranks: {len(set(epsilons)) == 1}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return accuracy, epsilon


if __name__ == "__main__":
    main()
