"""Private training (DP-SGD) on scikit-learn's digits across processes with torch.distributed.

    pip install -e ".[examples]"
    torchrun --nproc_per_node=2 examples/train_digits_distributed.py

The usual PyTorch pattern, unchanged: ``init_process_group``, the model wrapped in
``DistributedDataParallel``, each rank's ``DataLoader`` reading the whole training set through a
``DistributedSampler``, then ``PrivacyEngine.make_private``. fxdp replaces the loader by one that
Poisson-samples the global dataset (each rank keeps its share of one shared draw), lets each rank
clip its own samples, and all-reduces the clipped sums once per step with the noise added once, by
rank 0. Every rank ends each step with the same parameters and reports the same epsilon. See
docs/distributed.md for what is communicated and what is not supported yet.

gloo on CPU by default; ``--backend nccl`` puts rank r on GPU ``LOCAL_RANK``. The model, the data
split and the evaluation are those of examples/train_digits.py. ``--checkpoint PATH`` saves the
weights, the optimizer and the accountant's history from rank 0; any number of processes can load it.
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from train_digits import evaluate, load_digits_split, make_model  # the script's own folder is on sys.path


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Private training (DP-SGD) on digits across processes (torchrun) with fxdp.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=256,
                        help="expected GLOBAL (Poisson) batch size; each rank reads about batch size / world size")
    parser.add_argument("--lr", type=float, default=1.0, help="SGD learning rate")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C")
    noise = parser.add_mutually_exclusive_group()
    noise.add_argument("--target-epsilon", type=float, default=3.0,
                       help="calibrate the noise so that the whole run spends this epsilon")
    noise.add_argument("--noise-multiplier", type=float, default=None, help="fixed noise multiplier sigma")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--grad-sample-mode", default="fx", choices=["fx", "hooks"])
    parser.add_argument("--max-physical-batch-size", type=int, default=None,
                        help="cut each rank's share of a logical batch into physical batches of at most this size")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: one GPU per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-subset", type=int, default=None, help="train on the first N samples only")
    parser.add_argument("--checkpoint", metavar="PATH", default=None, help="save a checkpoint here at the end (rank 0)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    from fxdp.data import BatchMemoryManager
    from fxdp.privacy_engine import PrivacyEngine

    dist.init_process_group(args.backend)  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)  # DistributedDataParallel broadcasts rank 0's weights in any case

    train_set, test_set = load_digits_split(args.train_subset)
    model = DistributedDataParallel(make_model().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = DataLoader(train_set, batch_size=max(1, args.batch_size // world_size),
                        sampler=DistributedSampler(train_set, seed=args.seed))

    engine = PrivacyEngine()
    common = dict(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=args.max_grad_norm,
                  grad_sample_mode=args.grad_sample_mode, example_inputs=torch.zeros(2, 1, 8, 8, device=device))
    if args.noise_multiplier is not None:
        model, optimizer, loader = engine.make_private(noise_multiplier=args.noise_multiplier, **common)
    else:
        model, optimizer, loader = engine.make_private_with_epsilon(
            target_epsilon=args.target_epsilon, target_delta=args.delta, epochs=args.epochs, **common)
    if rank == 0:
        print(f"{world_size} processes ({args.backend}); Poisson sampling of the {len(train_set)} training digits at "
              f"rate {loader.sample_rate:.4f}: expected global batch {optimizer.expected_batch_size}, "
              f"{len(loader)} steps per epoch; C = {optimizer.max_grad_norm}, "
              f"noise multiplier {optimizer.noise_multiplier:.3f}", flush=True)

    for epoch in range(1, args.epochs + 1):
        model.train()
        if args.max_physical_batch_size is None:
            run_batches(model, optimizer, loader, device)
        else:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=args.max_physical_batch_size,
                                    optimizer=optimizer) as physical_loader:
                run_batches(model, optimizer, physical_loader, device)
        accuracy = evaluate(model.module, _to(test_set, device))  # every rank holds the same parameters
        epsilon = engine.get_epsilon(args.delta)  # and the same accountant history
        if rank == 0:
            print(f"epoch {epoch:3d}   test accuracy {100 * accuracy:5.1f}%   epsilon {epsilon:.2f} "
                  f"(delta {args.delta:g})", flush=True)

    same = parameters_agree(model)
    if rank == 0:
        print(f"final: test accuracy {100 * accuracy:.1f}% at epsilon {epsilon:.2f}; "
              f"parameters identical on all {world_size} ranks: {same}", flush=True)
        if args.checkpoint:
            engine.save_checkpoint(path=args.checkpoint, module=model, optimizer=optimizer)
            print(f"checkpoint written to {args.checkpoint}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_batches(model, optimizer, loader, device) -> None:
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad()
        # A rank's share of a Poisson batch can be empty: loss 0; the step still joins the all-reduce.
        loss = F.cross_entropy(model(images), labels) if len(labels) else model(images).sum()
        loss.backward()
        optimizer.step()


def parameters_agree(model) -> bool:
    """Whether every rank holds exactly rank 0's parameters (a check for this example, not needed)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    agree = torch.tensor([float(torch.equal(flat, reference))], device=flat.device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    return bool(agree.item())


def _to(dataset, device):
    if device.type == "cpu":
        return dataset
    return torch.utils.data.TensorDataset(*(t.to(device) for t in dataset.tensors))


if __name__ == "__main__":
    main()
