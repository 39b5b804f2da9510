"""An ordinary Lightning script: ``Trainer(devices=2, strategy=DDPStrategy(
process_group_backend=BACKEND))`` on the CPU. Lightning starts the second process itself and
initializes torch.distributed with env://; nothing gradstar-specific is set.

usage: python lightning_script.py BACKEND OUT_JSON
"""

from __future__ import annotations

import gc
import json
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradstar  # noqa: F401  (registers the backend)


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch, _index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    backend, out = sys.argv[1], sys.argv[2]
    data = TensorDataset(torch.randn(48, 8, generator=torch.Generator().manual_seed(1)),
                         torch.randn(48, 4, generator=torch.Generator().manual_seed(2)))
    model = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=2, logger=False,
                        strategy=DDPStrategy(process_group_backend=backend),
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=6))
    if trainer.global_rank == 0:
        params = [p.detach().reshape(-1).tolist() for p in model.parameters()]
        with open(out, "w") as f:
            json.dump({"params": params, "steps": trainer.global_step}, f)
    # Lightning leaves the process group to the interpreter's exit, where a gloo worker thread
    # may still be tearing down a work object: "terminate called without an active exception"
    # (SIGABRT, 1 in ~20 full-suite runs). Drop the DDP wrapper and destroy the group while
    # the interpreter lives, as tests/tools/torchrun_script.py does.
    del trainer, model
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
