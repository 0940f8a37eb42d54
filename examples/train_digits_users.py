"""User-level DP-SGD on scikit-learn's digits, with synthetic users of 1 to 50 records.

    pip install -e ".[examples]" && python examples/train_digits_users.py

The digits training set (1437 images, shipped inside scikit-learn: nothing is downloaded) is split into
synthetic users: user sizes are drawn uniformly from 1..50 (``--min-records``, ``--max-records``) with a fixed
seed until every record has a user. The privacy unit is the user: each step samples each user with probability
q = 1 / ``--steps-per-epoch``, takes up to ``--max-records-per-user`` (k) of a sampled user's records, clips the
average of their gradients to C as one unit and adds the noise once (docs/user_level.md). The noise is
calibrated so that the run spends ``--target-epsilon`` for one user, with all their records, at ``--delta``.

For contrast it prints the group-privacy ε: what example-level training with the same noise, rate and steps
would promise a user of the largest size, from the record-level guarantee (``fxdp.accounting.group_privacy_epsilon``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import evaluate, load_digits_split, make_model  # noqa: E402
from torch import nn  # noqa: E402

from fxdp import PrivacyEngine  # noqa: E402
from fxdp.accounting import create_accountant, group_privacy_epsilon  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="User-level DP-SGD on digits with synthetic users (fxdp).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20, help="an epoch is --steps-per-epoch steps")
    parser.add_argument("--steps-per-epoch", type=int, default=2, help="the user sampling rate q is 1 / this")
    parser.add_argument("--max-records-per-user", type=int, default=16, help="k: a user's records in one step")
    parser.add_argument("--min-records", type=int, default=1)
    parser.add_argument("--max-records", type=int, default=50)
    parser.add_argument("--lr", type=float, default=2.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="C, the bound on a user's gradient")
    parser.add_argument("--target-epsilon", type=float, default=8.0, help="for one user, all their records")
    parser.add_argument("--delta", type=float, default=1e-3,
                        help="about 1 / number of users (a few dozen here), not 1 / number of records")
    parser.add_argument("--accountant", default="pld", choices=["pld", "rdp"])
    parser.add_argument("--grad-sample-mode", default="fx", choices=["fx", "hooks", "ew", "functorch"])
    parser.add_argument("--model", default="linear", choices=["linear", "cnn"],
                        help="linear: softmax regression on the 64 pixels (650 parameters: with a few dozen users, "
                             "the noise drowns a larger model); cnn: train_digits.py's network")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-subset", type=int, default=None, help="the first N training records only")
    return parser.parse_args(argv)


def synthetic_users(num_records: int, low: int, high: int, seed: int = 0) -> List[int]:
    """One user id per record: users of ``low..high`` records (uniform, a fixed seed), the last one cut to fit."""
    g = torch.Generator().manual_seed(seed)
    ids, user = [], 0
    while len(ids) < num_records:
        size = int(torch.randint(low, high + 1, (1,), generator=g))
        ids += [user] * min(size, num_records - len(ids))
        user += 1
    return ids


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    train_set, test_set = load_digits_split(args.train_subset)
    user_ids = synthetic_users(len(train_set), args.min_records, args.max_records)
    num_users = len(set(user_ids))
    largest = max(user_ids.count(u) for u in set(user_ids))
    model = make_model() if args.model == "cnn" else nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = DataLoader(train_set, batch_size=-(-len(train_set) // args.steps_per_epoch))  # len(loader) = steps
    engine = PrivacyEngine(accountant=args.accountant)
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=args.target_epsilon,
        target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.max_grad_norm,
        grad_sample_mode=args.grad_sample_mode, privacy_unit="user", user_ids=user_ids,
        max_records_per_user=args.max_records_per_user)
    print(f"{len(train_set)} training records of {num_users} users ({args.min_records}-{args.max_records} records "
          f"each, the largest {largest}); users sampled at rate q = {loader.sample_rate:.4f}, up to "
          f"{args.max_records_per_user} records each; noise multiplier {optimizer.noise_multiplier:.3f}")
    for epoch in range(1, args.epochs + 1):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        if epoch % 10 == 0 or epoch == args.epochs:
            print(f"epoch {epoch:3d}   test accuracy {100 * evaluate(model, test_set):5.1f}%   "
                  f"user-level epsilon {engine.get_epsilon(args.delta):.2f}")
    accuracy, epsilon = evaluate(model, test_set), engine.get_epsilon(args.delta)
    # the contrast: example-level training with the same noise, rate and steps, its record-level epsilon, and
    # what group privacy makes of it for the largest user
    example_level = create_accountant(args.accountant)
    example_level.history = list(engine.accountant.history)
    per_record = example_level.get_epsilon(args.delta)
    group = group_privacy_epsilon(example_level, delta=args.delta, group_size=largest)
    group_text = f"{group:.1f}" if group != float("inf") else "inf (no finite bound: e^((k-1) eps) delta overflows)"
    print(f"final: test accuracy {100 * accuracy:.1f}% at user-level epsilon {epsilon:.2f} (delta {args.delta:g}, "
          f"privacy unit: {engine.privacy_unit})")
    print(f"contrast: example-level training with the same noise and steps gives epsilon {per_record:.2f} per record; "
          f"by group privacy, a user of {largest} records gets epsilon {group_text}")
    return {"accuracy": accuracy, "epsilon": epsilon, "per_record": per_record, "group": group,
            "users": num_users, "largest": largest, "noise_multiplier": optimizer.noise_multiplier}


if __name__ == "__main__":
    main()
