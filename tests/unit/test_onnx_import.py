"""A PyTorch CNN brought in through ONNX and taken back out (issue 48): the graph read
into hetconv's tokens and starting weights, a round trip through training and the
safetensors export into the same module (``load_state_dict``, strict) with hetconv's
predictions, the ONNX export under the file's input and output names, and one error
line naming the node for what hetconv cannot train."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hetconv
from hetconv.errors import UserError
from hetconv.export.onnx_import import convert, load_onnx

onnx = pytest.importorskip("onnx")


def torch_modules(torch: Any) -> dict[str, Any]:
    """A plain CNN and a small ResNet, written the usual way (torchvision's names)."""
    nn = torch.nn

    class Plain(nn.Module):  # type: ignore[misc]
        def __init__(self, size: int) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(1, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
            self.conv2, self.bn2 = nn.Conv2d(6, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.hidden, self.fc = nn.Linear(8 * (size // 4) ** 2, 16), nn.Linear(16, 10)

        def forward(self, x: Any) -> Any:
            x = nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
            x = nn.functional.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
            return self.fc(nn.functional.dropout(torch.relu(self.hidden(x.flatten(1))), 0.25,
                                                 self.training))

    class Block(nn.Module):  # type: ignore[misc]
        def __init__(self, inputs: int, width: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(inputs, width, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.downsample = None
            if stride != 1 or inputs != width:
                self.downsample = nn.Sequential(nn.Conv2d(inputs, width, 1, stride, bias=False),
                                                nn.BatchNorm2d(width))

        def forward(self, x: Any) -> Any:
            out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
            return torch.relu(out + (x if self.downsample is None else self.downsample(x)))

    class ResNet(nn.Module):  # type: ignore[misc]
        def __init__(self, size: int) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.layer1 = nn.Sequential(Block(8, 8, 1))
            self.layer2 = nn.Sequential(Block(8, 16, 2))
            self.fc = nn.Linear(16, 10)

        def forward(self, x: Any) -> Any:
            x = self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(x)))))
            return self.fc(x.mean(dim=(2, 3)))

    return {"plain": Plain, "resnet": ResNet}


TOKENS = {"plain": ("c6k3p1", "pool", "c8k3p1", "pool", "fc16", "drop0.25"),
          "resnet": ("c8k3p1", "res8", "res16s2", "gap")}


def exported(torch: Any, name: str, folder: Path, seed: int = 0, size: int = 16
             ) -> tuple[Any, Path]:
    torch.manual_seed(seed)
    module = torch_modules(torch)[name](size)
    with torch.no_grad():  # batch-norm statistics that are not the defaults
        for child in module.modules():
            if isinstance(child, torch.nn.BatchNorm2d):
                child.running_mean.uniform_(-0.1, 0.1)
                child.running_var.uniform_(0.5, 1.5)
    path = folder / f"{name}.onnx"
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice
        warnings.simplefilter("ignore")
        torch.onnx.export(module.train(), (torch.zeros(2, 1, size, size),), str(path),
                          input_names=["pixels"], output_names=["scores"],
                          dynamic_axes={"pixels": {0: "n"}}, dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING)
    return module.eval(), path


@pytest.mark.parametrize("name", sorted(TOKENS))
def test_a_torch_export_reads_as_hetconv_tokens_and_weights(name: str, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    module, path = exported(torch, name, tmp_path)
    imported = load_onnx(path)
    assert imported.tokens == TOKENS[name]
    assert (imported.input_shape, imported.classes) == ((1, 16, 16), 10)
    assert (imported.input_name, imported.output_name) == ("pixels", "scores")
    state = module.state_dict()
    for key, source in imported.source_names.items():  # every array kept its module name
        got = imported.params[key].T if key in imported.transposed else imported.params[key]
        np.testing.assert_array_equal(got, state[source].numpy(), err_msg=key)


@pytest.mark.parametrize("name", sorted(TOKENS))
def test_the_round_trip_gives_the_module_hetconv_s_predictions(name: str,
                                                               tmp_path: Path) -> None:
    """torch -> ONNX -> hetconv trains it -> safetensors -> load_state_dict (strict) ->
    the module predicts what hetconv predicts; the ONNX export keeps the names."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    module, path = exported(torch, name, tmp_path)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (320, 1, 16, 16), dtype=np.uint8)
    y = (x[:, 0, :8].mean(axis=(1, 2)) > x[:, 0, 8:].mean(axis=(1, 2))).astype(np.int64)
    y += 2 * (x[:, 0, :, :8].mean(axis=(1, 2)) > 127.5)
    data = hetconv.arrays(x, y, class_names=[f"kind {i}" for i in range(10)])
    run = hetconv.train(hetconv.Network.from_onnx(path), data, epochs=1, batch=32,
                        run_dir=tmp_path / "run", quiet=True, threads=1)
    assert run.history and run.test_accuracy == run.history[-1]["test_accuracy"]
    state = load_file(str(run.export("safetensors")))
    module.load_state_dict(state)  # strict: every name and shape
    module.eval()
    images = data.test_images
    with torch.no_grad():
        theirs = torch.softmax(module(torch.from_numpy(images)), dim=1).numpy()
    ours = run.predict(images)
    np.testing.assert_allclose(theirs, ours, atol=2e-5, rtol=0)
    assert run.evaluate().accuracy == pytest.approx(run.test_accuracy, abs=1e-9)
    graph = onnx.load(str(run.export("onnx"))).graph
    assert [i.name for i in graph.input] == ["pixels"]
    assert [o.name for o in graph.output] == ["scores"]


def test_data_that_does_not_fit_the_model_is_one_line(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    _, path = exported(torch, "resnet", tmp_path)
    x = np.zeros((40, 1, 12, 12), np.uint8)
    with pytest.raises(UserError, match=r"^the ONNX model takes 1x16x16 images into 10 "
                       r"classes; the data has 10 classes of 1x12x12 images$"):
        hetconv.train(hetconv.Network.from_onnx(path), hetconv.arrays(
            x, np.arange(40) % 10), epochs=1, run_dir=tmp_path / "run", quiet=True)


def _graph(*nodes: Any, initializers: tuple[Any, ...] = ()) -> Any:
    helper = onnx.helper
    graph = helper.make_graph(
        list(nodes), "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        initializer=list(initializers))
    return helper.make_model(graph)


def _weight(name: str, shape: tuple[int, ...]) -> Any:
    return onnx.numpy_helper.from_array(np.ones(shape, np.float32), name)


@pytest.mark.parametrize("nodes, words", [
    (("Sigmoid", {}), "node 'bad' (Sigmoid): hetconv cannot train this op"),
    (("Conv", {"group": 2}), "node 'bad' (Conv): group 2: only groups 1 train here"),
    (("Conv", {"dilations": [2, 2]}), "node 'bad' (Conv): dilations [2, 2]"),
    (("Conv", {"pads": [1, 0, 1, 0]}), "node 'bad' (Conv): pads [1, 0, 1, 0] and strides"),
])
def test_what_hetconv_cannot_train_is_one_line_naming_the_node(nodes: Any, words: str) -> None:
    op, attrs = nodes
    inputs = ["x", "w"] if op == "Conv" else ["x"]
    model = _graph(onnx.helper.make_node(op, inputs, ["y"], name="bad", **attrs),
                   initializers=(_weight("w", (2, 1, 3, 3)),))
    with pytest.raises(UserError) as caught:
        convert(model, "--model net.onnx")
    assert str(caught.value).startswith("--model net.onnx: " + words)
    assert "\n" not in str(caught.value)


def test_a_file_that_is_not_onnx_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "net.onnx"
    path.write_bytes(b"not a protobuf at all")
    with pytest.raises(UserError, match=r"^--model .*net.onnx: not a readable ONNX file"):
        load_onnx(path)
