"""The demo task: interleaved spirals, generated deterministically, and the MLP that learns them.

No download: :func:`make_spirals` builds the same dataset from a seed on every machine (numpy's
PCG64 stream is stable across platforms and releases). Each of ``classes`` arms winds
``turns`` times around the origin with Gaussian noise, so the classes are not linearly separable
and a linear model stays near chance while a small MLP reaches high accuracy: the accuracy in the
demo's report means something.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CLASSES = 3


@dataclass(frozen=True)
class Split:
    """Features (float32, standardised) and labels (int64) of one split."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return self.y.shape[0]


@dataclass(frozen=True)
class Spirals:
    train: Split
    test: Split
    classes: int

    @property
    def features(self) -> int:
        return self.train.x.shape[1]


def make_spirals(samples: int = 12_000, *, classes: int = CLASSES, turns: float = 1.5,
                 noise: float = 0.15, test_fraction: float = 0.2, seed: int = 0) -> Spirals:
    """``samples`` points on ``classes`` spiral arms, shuffled and split into train and test.

    Raises:
        ValueError: fewer than one sample per class or split, or a test fraction outside (0, 1).
    """
    if classes < 2 or samples < 2 * classes:
        raise ValueError(f"need at least 2 classes and 2 samples per class, got {classes} "
                         f"classes and {samples} samples")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.Generator(np.random.PCG64(seed))
    per_class = samples // classes
    t = np.sqrt(rng.uniform(0.02, 1.0, size=(classes, per_class)))  # denser towards the rim
    arm = np.arange(classes)[:, None] * (2 * np.pi / classes)
    angle = arm + t * turns * 2 * np.pi
    radius = t * 4.0
    x = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=-1)
    x += rng.normal(scale=noise, size=x.shape)
    x = x.reshape(-1, 2)
    y = np.repeat(np.arange(classes), per_class)
    order = rng.permutation(y.shape[0])
    x, y = x[order], y[order]
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    cut = round(y.shape[0] * (1 - test_fraction))
    if not 0 < cut < y.shape[0]:
        raise ValueError(f"{samples} samples leave an empty split at test_fraction "
                         f"{test_fraction}")
    return Spirals(Split(x[:cut].astype(np.float32), y[:cut].astype(np.int64)),
                   Split(x[cut:].astype(np.float32), y[cut:].astype(np.int64)), classes)


def make_model(features: int, classes: int, hidden: int = 128, *, seed: int = 0):
    """A 3-layer MLP with a deterministic initialisation.

    SiLU rather than ReLU: its smooth gradient keeps float32 rounding differences small. With
    ReLU a unit whose input sits at zero flips on one side of a rounding difference and off on
    the other, which moves a parameter by a whole gradient contribution.
    """
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                         nn.SiLU(), nn.Linear(hidden, classes))


def flat_parameters(model) -> np.ndarray:
    """The model's parameters as one flat float32 array (a copy)."""
    import torch

    with torch.no_grad():
        flat = [p.detach().reshape(-1) for p in model.parameters()]
        return torch.cat(flat).numpy().copy() if flat else np.empty(0, dtype=np.float32)


def load_flat_parameters(model, flat: np.ndarray) -> None:
    """Overwrite ``model``'s parameters with ``flat`` (as from :func:`flat_parameters`)."""
    import torch

    source = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(source[offset:offset + n].view_as(p))
            offset += n


def evaluate(model, split: Split) -> tuple[float, float, np.ndarray]:
    """(mean cross-entropy, accuracy, predicted labels) of ``model`` on ``split``."""
    import torch

    with torch.no_grad():
        logits = model(torch.from_numpy(split.x))
        target = torch.from_numpy(split.y)
        loss = torch.nn.functional.cross_entropy(logits, target).item()
        predicted = logits.argmax(dim=1)
        accuracy = (predicted == target).float().mean().item()
    return loss, accuracy, predicted.numpy()
