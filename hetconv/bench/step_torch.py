"""The PyTorch side of ``hetconv bench step``: the same network as a plain CPU loop,
its SGD step, and where torch.profiler's ops go in the breakdown.

torch is imported only by the benchmark (the optional ``bench`` extra), never by hetconv
itself; without it ``import_torch`` raises a one-line ``UserError``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hetconv.errors import UserError
from hetconv.model import ModelConfig, conv_layer_shapes, dense_shapes
from hetconv.names import layer_key

TORCH_MISSING = "hetconv bench step needs PyTorch (the other side of the comparison): " \
                "pip install '.[bench]'"
LEARNING_RATE = 0.01
ROWS = ("conv forward", "BN+ReLU+pool forward", "BN+ReLU+pool backward", "conv backward",
        "dense", "loss", "SGD update", "other")
"""The breakdown's rows, hetconv's timer names (``hetconv.ops.timers``) and "other"."""


def import_torch() -> Any:
    """torch, or a one-line UserError that says how to install it."""
    try:
        import torch
    except ImportError:
        raise UserError(TORCH_MISSING) from None
    return torch


TORCH_ROWS = (  # (substring of the op name, row); the first match wins, backward first
    ("convolution_backward", "conv backward"), ("conv", "conv backward|conv forward"),
    ("batch_norm", "BN+ReLU+pool"), ("max_pool", "BN+ReLU+pool"),
    ("avg_pool", "BN+ReLU+pool"), ("threshold_backward", "BN+ReLU+pool backward"),
    ("relu", "dense|BN+ReLU+pool forward"), ("clamp_min", "dense|BN+ReLU+pool forward"),
    ("softmax", "loss"), ("nll_loss", "loss"), ("cross_entropy", "loss"),
    ("addmm", "dense"), ("aten::mm", "dense"), ("linear", "dense"), ("dropout", "dense"),
    ("_foreach", "SGD update"), ("sgd", "SGD update"))


def torch_row(name: str) -> str:
    """The breakdown row of a torch op (self time), by its name."""
    lowered = name.lower()
    backward = "backward" in lowered
    for key, row in TORCH_ROWS:
        if key in lowered:
            if row == "conv backward|conv forward":
                return "conv backward" if backward else "conv forward"
            if row == "BN+ReLU+pool":
                return "BN+ReLU+pool backward" if backward else "BN+ReLU+pool forward"
            if row == "dense|BN+ReLU+pool forward":  # the dense ReLU is a small share
                return "BN+ReLU+pool backward" if backward else "BN+ReLU+pool forward"
            return row
    return "other"


def torch_network(torch: Any, model: ModelConfig, params: dict[str, np.ndarray]) -> Any:
    """The same layers in PyTorch, with hetconv's initial weights copied in (a residual
    network: :func:`torch_residual_network`)."""
    if model.residual:
        return torch_residual_network(torch, model, params)
    nn = torch.nn
    layers: list[Any] = []
    for shape in conv_layer_shapes(model):
        conv = nn.Conv2d(shape.in_channels, shape.kernels, shape.kernel_size, shape.stride,
                         shape.padding, bias=not shape.batch_norm)
        with torch.no_grad():
            conv.weight.copy_(torch.from_numpy(params[layer_key(shape.index, "weight")]))
        layers.append(conv)
        if shape.batch_norm:
            layers.append(nn.BatchNorm2d(shape.kernels))
        layers.append(nn.ReLU(inplace=True))
        if shape.pool == "max":
            layers.append(nn.MaxPool2d(2))
        elif shape.pool == "avg":
            layers.append(nn.AvgPool2d(2))
    layers.append(nn.Flatten())
    shapes = iter(dense_shapes(model))
    for spec in model.dense:
        if spec.kind == "fc":
            prefix, features, units = next(shapes)
            layers += [_linear(torch, features, units, params, prefix), nn.ReLU(inplace=True)]
        else:
            layers.append(nn.Dropout(spec.rate))
    prefix, features, units = next(shapes)
    layers.append(_linear(torch, features, units, params, prefix))
    return nn.Sequential(*layers)


def torch_residual_network(torch: Any, model: ModelConfig, params: dict[str, np.ndarray]
                           ) -> Any:
    """A residual network in PyTorch as a ResNet module is written (conv -> BN -> ReLU;
    a block's second conv -> BN, + the shortcut, ReLU; global average pooling), with
    hetconv's initial weights; the layers are routed as hetconv routes them
    (hetconv/engine/routing.py)."""
    nn = torch.nn
    shapes = conv_layer_shapes(model)
    convs, norms = [], []
    for shape in shapes:
        conv = nn.Conv2d(shape.in_channels, shape.kernels, shape.kernel_size, shape.stride,
                         shape.padding, bias=not shape.batch_norm)
        with torch.no_grad():
            conv.weight.copy_(torch.from_numpy(params[layer_key(shape.index, "weight")]))
        convs.append(conv)
        norms.append(nn.BatchNorm2d(shape.kernels) if shape.batch_norm else nn.Identity())
    head: list[Any] = []
    dense = iter(dense_shapes(model))
    for spec in model.dense:
        if spec.kind == "fc":
            prefix, features, units = next(dense)
            head += [_linear(torch, features, units, params, prefix), nn.ReLU(inplace=True)]
        elif spec.kind == "dropout":
            head.append(nn.Dropout(spec.rate))
    prefix, features, units = next(dense)
    head.append(_linear(torch, features, units, params, prefix))
    pools = {"max": nn.MaxPool2d(2), "avg": nn.AvgPool2d(2)}

    class ResidualNet(nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.convs, self.norms = nn.ModuleList(convs), nn.ModuleList(norms)
            self.head = nn.Sequential(*head)

        def forward(self, x: Any) -> Any:
            outputs = [x]
            for shape, conv, norm in zip(shapes, self.convs, self.norms):
                source = shape.index if shape.input_from < 0 else shape.input_from
                y = norm(conv(outputs[source]))
                if shape.shortcut_from >= 0:
                    y = torch.relu(y + outputs[shape.shortcut_from])
                elif shape.relu:
                    y = torch.relu(y)
                if shape.pool in pools:
                    y = pools[shape.pool](y)
                outputs.append(y)
            y = outputs[-1]
            y = y.mean(dim=(2, 3)) if model.global_pool else y.flatten(1)
            return self.head(y)
    return ResidualNet()


def _linear(torch: Any, features: int, units: int, params: dict[str, np.ndarray],
            prefix: str) -> Any:
    layer = torch.nn.Linear(features, units)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(params[f"{prefix}.weight"]))
        layer.bias.copy_(torch.from_numpy(params[f"{prefix}.bias"]))
    return layer


def torch_step(torch: Any, network: Any, x: np.ndarray, labels: np.ndarray
               ) -> Callable[[], None]:
    """One SGD step of ``network`` (momentum 0.9, weight decay 5e-4 on the weights)."""
    decay = [p for n, p in network.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in network.named_parameters() if not (n.endswith("weight")
                                                              and p.dim() > 1)]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4},
                                 {"params": rest, "weight_decay": 0.0}],
                                lr=LEARNING_RATE, momentum=0.9)
    inputs, targets = torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64))
    network.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(network(inputs), targets)
        loss.backward()
        optimizer.step()
    return step


def torch_breakdown(torch: Any, step: Callable[[], None], steps: int
                    ) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """(seconds per step by row, the ten largest ops by self CPU seconds per step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            step()
    rows = {row: 0.0 for row in ROWS}
    ops = []
    for event in profiler.key_averages():
        seconds = event.self_cpu_time_total / 1e6 / steps
        rows[torch_row(event.key)] += seconds
        ops.append((event.key, seconds))
    ops.sort(key=lambda op: -op[1])
    return rows, ops[:10]
