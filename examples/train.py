"""A complete data-parallel training script for ``gradstar launch``: arguments, a torch
DataLoader with a DistributedSampler, DDP, evaluation over all ranks, a checkpoint.

    gradstar launch --nproc 4 examples/train.py --epochs 3
    gradstar launch --nproc 4 --coordinator hub:29400 --job j examples/train.py --epochs 3

The first starts an embedded coordinator; the second joins a running one (`gradstar
coordinator`). The task: classify points of 3 Gaussian blobs in 8 dimensions, generated from a
fixed seed (nothing is downloaded).
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradstar

parser = argparse.ArgumentParser(description="data-parallel training with gradstar.DDP")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=64, help="global batch, over all ranks")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--save", metavar="PATH", help="rank 0 saves the model's state_dict here")
args = parser.parse_args()


def blobs(n: int, seed: int) -> TensorDataset:
    """n points around 3 centres; the label is the centre."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 3, (n,), generator=g)
    return TensorDataset(centres[labels] + torch.randn(n, 8, generator=g), labels)


train_set, test_set = blobs(1024, seed=1), blobs(512, seed=2)

with gradstar.init_process_group() as pg:  # settings from `gradstar launch`
    # Each rank reads its own 1/world_size of every epoch. The sampler pads so that every rank
    # gets the same number of batches: DDP needs every rank to run every backward.
    sampler = DistributedSampler(train_set, num_replicas=pg.world_size, rank=pg.rank, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size // pg.world_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=DistributedSampler(
        test_set, num_replicas=pg.world_size, rank=pg.rank, shuffle=False))

    torch.manual_seed(0)
    model = gradstar.DDP(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3)), pg)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        model.train()
        total = 0.0
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()  # gradients averaged over the ranks
            opt.step()
            total += loss.item()
        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for x, y in test_loader:  # this rank's share of the test set
                correct += (model(x).argmax(1) == y).sum().item()
                seen += len(y)
        # Metrics over all ranks: sum [correct, seen, mean loss] through the coordinator.
        stats = pg.all_reduce(torch.tensor([correct, seen, total / len(loader)]), op="sum")
        if pg.rank == 0:
            print(f"train: epoch {epoch + 1}/{args.epochs}: loss "
                  f"{stats[2].item() / pg.world_size:.4f}, test accuracy "
                  f"{100 * stats[0].item() / stats[1].item():.1f}%", flush=True)

    if args.save and pg.rank == 0:  # every rank holds the same parameters; one saves them
        torch.save(model.module.state_dict(), args.save)
        print(f"train: saved the model to {args.save}", flush=True)
