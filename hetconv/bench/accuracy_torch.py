"""The PyTorch side of ``hetconv bench accuracy --peer torch``: the same network, initial
weights, data order and recipe trained in PyTorch, its test accuracy after every epoch.

Same as hetconv's run: the network from ``torch_network`` (hetconv's seeded initial
weights copied in, residual blocks routed as hetconv routes them); the dataset loaded as
``hetconv train`` loads it (the same normalisation); every epoch's batch order from
hetconv's own :class:`~hetconv.data.batches.BatchSource` (seed, epoch); SGD with momentum
0.9 and weight decay on the weights only (hetconv's ``sgd_update`` is PyTorch's SGD:
tests/unit/test_model.py), the learning rate of every step from ``learning_rate_at``;
batch norm with the whole batch's statistics and momentum 0.1. What differs: dropout's
masks (each side draws its own) and the float order of the sums.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hetconv.data.batches import BatchSource
from hetconv.data.dataset import Dataset
from hetconv.engine.optim import OptimizerConfig, learning_rate_at
from hetconv.model import ModelConfig, init_parameters


def torch_accuracy(torch: Any, model: ModelConfig, data: Dataset, seed: int, epochs: int,
                   batch: int, optimizer: OptimizerConfig, eval_batch: int = 1000,
                   after_epoch: Callable[[int, float], None] | None = None) -> list[float]:
    """Test accuracy (a fraction) after every epoch of the PyTorch training (module doc)."""
    from hetconv.bench.step_torch import torch_network

    torch.manual_seed(seed)
    network = torch_network(torch, model, init_parameters(model, seed))
    decay = [p for n, p in network.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in network.named_parameters()
            if not (n.endswith("weight") and p.dim() > 1)]
    sgd = torch.optim.SGD([{"params": decay, "weight_decay": optimizer.weight_decay},
                           {"params": rest, "weight_decay": 0.0}],
                          lr=optimizer.learning_rate, momentum=optimizer.momentum)
    source = BatchSource(data.train_images, data.train_labels, batch, seed)
    steps = source.steps_per_epoch
    test_x = torch.from_numpy(np.ascontiguousarray(data.test_images, np.float32))
    test_y = torch.from_numpy(data.test_labels.astype(np.int64))
    accuracies = []
    for epoch in range(epochs):
        network.train()
        for position in range(steps):
            rate = learning_rate_at(optimizer, epoch * steps + position, steps, epochs)
            for group in sgd.param_groups:
                group["lr"] = rate
            x, labels = source.batch(epoch, position)
            sgd.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(
                network(torch.from_numpy(np.ascontiguousarray(x, np.float32))),
                torch.from_numpy(labels.astype(np.int64)))
            loss.backward()
            sgd.step()
        network.eval()
        correct = 0
        with torch.no_grad():
            for begin in range(0, len(test_y), eval_batch):
                logits = network(test_x[begin:begin + eval_batch])
                correct += int((logits.argmax(dim=1) == test_y[begin:begin + eval_batch]).sum())
        accuracy = correct / max(1, len(test_y))
        accuracies.append(accuracy)
        if after_epoch is not None:
            after_epoch(epoch, accuracy)
    return accuracies
