"""Residual networks: the grammar (res<K>[s<stride>], gap, resnet<N>), the layer without
its ReLU (fused pass against the separate ops), the routing of shortcuts, and one
training step of a residual network against PyTorch (forward, loss and every gradient)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hetconv.engine.dense_part import DensePart
from hetconv.engine.routing import Routing, run_backward, run_forward
from hetconv.engine.stage import LocalConvStage, layer_settings
from hetconv.errors import UserError
from hetconv.model import (
    NO_ROUTE,
    conv_layer_shapes,
    dense_parameter_names,
    init_parameters,
    model_config,
    parse_network,
)
from hetconv.names import layer_key
from hetconv.ops.conv_layer import conv_layer_backward, conv_layer_forward


def shapes_of(text: str, input_shape: tuple[int, int, int] = (3, 32, 32)) -> list[Any]:
    return conv_layer_shapes(model_config(parse_network(text), input_shape))


def test_resnet20_is_the_cifar_resnet() -> None:
    shapes = shapes_of("resnet20")
    # 19 convs with weights in the paper's count, plus the two projection shortcuts
    assert len(shapes) == 21
    assert sum(s.kernel_size == 3 for s in shapes) == 19
    projections = [s for s in shapes if s.kernel_size == 1]
    assert [(p.kernels, p.stride, p.relu) for p in projections] == [(32, 2, False),
                                                                      (64, 2, False)]
    last = shapes[-1]
    assert (last.kernels, last.pooled_height, last.pooled_width) == (64, 8, 8)
    model = model_config(parse_network("resnet20"), (3, 32, 32))
    params = init_parameters(model, 0)
    conv_weights = sum(params[layer_key(s.index, "weight")].size for s in shapes)
    # 3x3: stem 432, stage 1 6 x 2304, stage 2 4608 + 5 x 9216, stage 3 18432 + 5 x 36864;
    # the 1x1 projections 16 x 32 and 32 x 64
    assert conv_weights == 432 + 6 * 2304 + 4608 + 5 * 9216 + 18432 + 5 * 36864 + 512 + 2048
    assert params["fc.weight"].shape == (10, 64)
    assert len(shapes_of("resnet56")) == 57


def test_identity_and_projection_blocks_are_wired() -> None:
    shapes = shapes_of("c8k3p1,res8,res16s2")
    # res8: conv1 (reads a1), conv2 (reads a2, adds a1)
    assert (shapes[1].input_from, shapes[1].shortcut_from, shapes[1].relu) == (NO_ROUTE,
                                                                                NO_ROUTE, True)
    assert (shapes[2].input_from, shapes[2].shortcut_from, shapes[2].relu) == (NO_ROUTE, 1,
                                                                                False)
    # res16s2: conv1 (reads a3), the 1x1 projection (reads a3), conv2 (reads a4, adds a5)
    assert (shapes[4].kernel_size, shapes[4].input_from, shapes[4].stride) == (1, 3, 2)
    assert (shapes[5].input_from, shapes[5].shortcut_from) == (4, 5)
    routing = Routing.of(shapes)
    assert routing.inputs == (0, 1, 2, 3, 3, 4) and not routing.straight
    assert routing.shortcuts == (None, None, 1, None, None, 5)
    assert Routing.of(shapes_of("c8k3p1,pool,c16k3p1")).straight


@pytest.mark.parametrize("text, words", [
    ("res16", "token 1 'res16': a residual block needs a conv layer before it"),
    ("c8k3p1,fc32,res8", "token 3 'res8': a conv layer after a dense layer"),
    ("c8k3p1,res8,pool", "token 3 'pool': a pooling with nothing to pool (after a residual"),
    ("c8k3p1,gap,c8k3p1", "token 3 'c8k3p1': a conv layer after gap"),
    ("c8k3p1,gap,res8", "token 3 'res8': a conv layer after gap"),
    ("c8k3p1,fc32,gap", "token 3 'gap': gap comes right after the last conv layer"),
    ("gap,c8k3p1", "token 1 'gap': gap before any conv layer"),
    ("c8k3p1,resnet20", "token 2 'resnet20': a named network comes first"),
    ("resnet21", "token 1 'resnet21': no such network"),
    ("c8k3p1,res0", "token 2 'res0': kernels and stride must be at least 1"),
])
def test_impossible_residual_specs_name_the_token(text: str, words: str) -> None:
    with pytest.raises(UserError, match="^" + "--arch: " + _escaped(words)):
        parse_network(text)


def test_a_stride_that_empties_the_map_names_the_token() -> None:
    with pytest.raises(UserError, match=r"token 2 'c8k5s2' \(conv layer 2\) gets a 4x4 map, "
                       r"too small for a 5x5 kernel with padding 0 and stride 2"):
        shapes_of("c8k3p1,c8k5s2,res8", (1, 4, 4))
    # a residual block's 3x3 convs are padded: a stride halves the map down to 1x1
    assert shapes_of("c8k3p1,res8s4,res8s4,res8s4", (1, 4, 4))[-1].pooled_height == 1


def test_shorthand_takes_more_tokens_after_it() -> None:
    spec = parse_network("resnet20,drop0.5")
    assert [d.kind for d in spec.dense] == ["gap", "dropout"] and spec.text == "resnet20,drop0.5"


def _escaped(text: str) -> str:
    import re
    return re.escape(text)


@pytest.mark.parametrize("fast", [True, False])
def test_a_layer_without_relu_is_batch_norm_output(fast: bool) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 6, 6)).astype(np.float32)
    weight = rng.standard_normal((5, 3, 3, 3)).astype(np.float32) * 0.3
    gamma, beta = np.full(5, 1.2, np.float32), np.full(5, -0.1, np.float32)
    mean, var = np.zeros(5, np.float32), np.ones(5, np.float32)
    y, cache, _, _ = conv_layer_forward(x, weight, gamma, beta, mean, var, True, padding=1,
                                        pool="none", fast=fast, relu=False)
    assert (y < 0).any()  # nothing rectified
    reference, ref_cache, _, _ = conv_layer_forward(x, weight, gamma, beta, mean, var, True,
                                                    padding=1, pool="none", fast=False,
                                                    relu=False)
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    got = conv_layer_backward(cache, dy, True)
    expected = conv_layer_backward(ref_cache, dy, True)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="no pool"):
        conv_layer_forward(x, weight, gamma, beta, mean, var, True, padding=1, pool="max",
                           relu=False)


def test_routing_adds_each_gradient_once() -> None:
    """Layers as scalings (y = w x): the routed backward equals the chain rule worked out
    by hand for conv1 -> projection -> conv2 + shortcut."""
    shapes = shapes_of("c2k3p1,res4s2", (1, 4, 4))
    routing = Routing.of(shapes)
    scale = {0: 2.0, 1: 3.0, 2: 5.0, 3: 7.0}
    seen: list[int] = []

    def forward(layer: int, a: np.ndarray) -> np.ndarray:
        return (a * scale[layer]).astype(np.float32)

    def backward(layer: int, dy: np.ndarray, need_dx: bool) -> np.ndarray | None:
        seen.append(layer)
        return (dy * scale[layer]).astype(np.float32) if need_dx else None

    x = np.full((1, 1, 1, 1), 1.0, np.float32)
    out, tape = run_forward(routing, forward, x)
    # a1 = 2; conv1 a2 = 6; projection a3 = 2 * 5 = 10; conv2 reads a2: 6 * 7 + 10 = 52
    assert out.item() == 52.0
    grads: dict[int, float] = {}

    def record(layer: int, dy: np.ndarray, need_dx: bool) -> np.ndarray | None:
        grads[layer] = float(dy.sum())
        return backward(layer, dy, need_dx)

    run_backward(routing, tape, record, np.ones_like(out))
    assert seen == [3, 2, 1, 0]
    # d out/d a1 = 7*3 (through conv2 and conv1) + 5 (the projection) = 26
    assert grads == {3: 1.0, 2: 1.0, 1: 7.0, 0: 26.0}


def _torch_resnet(torch: Any, model: Any, params: dict[str, np.ndarray]) -> Any:
    """The same network in PyTorch, built from the parsed layers, with hetconv's weights."""
    nn = torch.nn
    shapes = conv_layer_shapes(model)

    class Net(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.convs = nn.ModuleList(
                nn.Conv2d(s.in_channels, s.kernels, s.kernel_size, s.stride, s.padding,
                          bias=False) for s in shapes)
            self.bns = nn.ModuleList(nn.BatchNorm2d(s.kernels) for s in shapes)
            self.fc = nn.Linear(shapes[-1].kernels, model.classes)

        def forward(self, x: Any) -> Any:
            acts = [x]
            for s, conv, bn in zip(shapes, self.convs, self.bns):
                src = s.index if s.input_from == NO_ROUTE else s.input_from
                y = bn(conv(acts[src]))
                if s.shortcut_from != NO_ROUTE:
                    y = torch.relu(y + acts[s.shortcut_from])
                elif s.relu:
                    y = torch.relu(y)
                acts.append(y)
            return self.fc(acts[-1].mean(dim=(2, 3)))

    net = Net().double()
    with torch.no_grad():
        for s, conv in zip(shapes, net.convs):
            conv.weight.copy_(torch.tensor(params[layer_key(s.index, "weight")]))
        net.fc.weight.copy_(torch.tensor(params["fc.weight"]))
        net.fc.bias.copy_(torch.tensor(params["fc.bias"]))
    return net


def test_one_step_matches_pytorch() -> None:
    torch = pytest.importorskip("torch")
    model = model_config(parse_network("c4k3p1,res4,res8s2,gap"), (2, 8, 8), classes=3)
    params = init_parameters(model, 5)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 2, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 3, 6)
    lr = 1.0  # momentum and weight decay 0: each update is -gradient
    stage = LocalConvStage(model, params, layer_settings(model, 0.0, 0.0))
    routing = Routing.of(conv_layer_shapes(model))
    out, tape = run_forward(routing, lambda i, a: stage.forward(i, a, True, 0), x)
    dense = {n: params[n].copy() for n in dense_parameter_names(model)}
    part = DensePart(model.dense, dense, {n: np.zeros_like(v) for n, v in dense.items()}, 0)
    step = part.train_pass(out.reshape(len(x), -1), labels, 0)
    run_backward(routing, tape, lambda i, dy, need: stage.backward(i, dy, need, lr, 0),
                 step.dflat.reshape(out.shape))
    after = stage.snapshot()

    net = _torch_resnet(torch, model, params)
    logits = net(torch.tensor(x, dtype=torch.float64))
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(labels))
    loss.backward()
    assert step.loss == pytest.approx(loss.item(), rel=1e-5)
    np.testing.assert_allclose(step.grads["fc.weight"], net.fc.weight.grad.numpy(),
                               rtol=1e-4, atol=1e-5)
    for s, conv, bn in zip(conv_layer_shapes(model), net.convs, net.bns):
        i = s.index
        for name, grad in (("weight", conv.weight.grad), ("gamma", bn.weight.grad),
                           ("beta", bn.bias.grad)):
            moved = params[layer_key(i, name)] - after[layer_key(i, name)]
            np.testing.assert_allclose(moved, grad.numpy(), rtol=1e-3, atol=2e-5,
                                       err_msg=f"layer {i} {name}")
        np.testing.assert_allclose(after[layer_key(i, "running_var")],
                                   bn.running_var.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_the_kernel_split_of_a_residual_network_is_planned_on_the_star() -> None:
    """Whatever the sample split's settings (the peer plane, slice statistics, replicated
    dense part), the kernel split of a residual network gets the star plane and drops
    them; a straight network's settings stay as given."""
    from hetconv.config import MasterConfig
    from hetconv.master.setup import kernel_split_config

    asked = MasterConfig(listen="tcp://*:5555", bn_statistics="slice", dense_part="replicas")
    residual = model_config(parse_network("c8k3p1,res8,gap"), (1, 8, 8))
    planned = kernel_split_config(asked, residual)
    assert (planned.data_plane, planned.bn_statistics, planned.dense_part) == (
        "star", "batch", "auto")
    straight = model_config(parse_network("c8k3p1,pool"), (1, 8, 8))
    assert kernel_split_config(asked, straight) is asked
