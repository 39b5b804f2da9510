"""Pipeline parallelism with ``gradstar.Pipeline``: rank r holds stage r of the model, and
micro-batches flow rank to rank over peer streams (not through the coordinator).

    gradstar launch --nproc 4 examples/pipeline.py

Any number of ranks from 1 to 4 works (the model has 4 layers; they are split over the ranks).
The last stage prints the loss; every stage prints the activations it held at most.
"""

import torch
from torch import nn

import gradstar

STEPS, BATCH, MICROBATCHES, LR = 30, 64, 4, 0.05

g = torch.Generator().manual_seed(0)
X = torch.randn(1024, 8, generator=g)
Y = X.sum(dim=1, keepdim=True) + 0.1 * torch.randn(1024, 1, generator=g)


def make_stage(rank: int, stages: int) -> nn.Module:
    """Rank ``rank``'s share of a 4-layer MLP. Each rank builds only its own layers."""
    torch.manual_seed(0)  # the same initial weights whatever the number of stages
    layers = [nn.Sequential(nn.Linear(8, 32), nn.Tanh()),
              nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
              nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
              nn.Linear(32, 1)]
    start, end = (len(layers) * r // stages for r in (rank, rank + 1))  # contiguous, even
    return nn.Sequential(*layers[start:end])


with gradstar.init_process_group() as pg:
    stage = make_stage(pg.rank, pg.world_size)
    pipe = gradstar.Pipeline(stage, pg, num_microbatches=MICROBATCHES, schedule="1f1b")
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        rows = torch.arange(step * BATCH, (step + 1) * BATCH) % len(X)
        opt.zero_grad()
        # Only the first stage has the inputs and only the last the targets; the rest pass
        # None. The batch is split into MICROBATCHES micro-batches that overlap in flight.
        loss = pipe.step(inputs=X[rows] if pipe.is_first else None,
                         targets=Y[rows] if pipe.is_last else None,
                         loss_fn=nn.functional.mse_loss)
        opt.step()  # every stage now holds the gradients of the mean loss over the batch
        if loss is not None:  # the last stage gets the batch's mean loss, the others None
            losses.append(loss.item())

    result = f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {STEPS} steps; " if losses else ""
    print(f"pipeline: stage {pg.rank} of {pg.world_size}: {result}at most "
          f"{pipe.max_live_activations} micro-batches' activations held", flush=True)
# Leaving the `with` block closes the group: this stage is done, while the stages before it
# may still be finishing their last backward with each other.
