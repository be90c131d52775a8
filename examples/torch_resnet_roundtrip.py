"""A small ResNet written in PyTorch, brought into hetconv through ONNX, trained, and
loaded back into the same PyTorch module.

    python examples/torch_resnet_roundtrip.py [--images N] [--epochs E]

Needs torch, onnx and safetensors (pip install 'hetconv[bench,export]').
"""
from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

import hetconv


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: two 3x3 convs, the shortcut projected where it must be."""

    def __init__(self, inputs: int, width: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = None
        if stride != 1 or inputs != width:
            self.downsample = nn.Sequential(nn.Conv2d(inputs, width, 1, stride, bias=False),
                                            nn.BatchNorm2d(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class SmallResNet(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.layer1 = nn.Sequential(BasicBlock(16, 16))
        self.layer2 = nn.Sequential(BasicBlock(16, 32, 2))
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(x.mean(dim=(2, 3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    from train_arrays import quarter_images  # the same made-up images

    x, y = quarter_images(args.images)
    data = hetconv.arrays(x, y)
    module = SmallResNet()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "resnet.onnx"
        with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice
            warnings.simplefilter("ignore")
            # training mode keeps every batch norm and every parameter's name
            torch.onnx.export(module.train(), (torch.zeros(2, 1, 28, 28),), str(path),
                              input_names=["images"], output_names=["logits"],
                              dynamic_axes={"images": {0: "n"}}, dynamo=False,
                              training=torch.onnx.TrainingMode.TRAINING)
        network = hetconv.Network.from_onnx(path)
        print("hetconv reads it as", network.text)
        run = hetconv.train(network, data, epochs=args.epochs, batch=64,
                            run_dir=Path(folder) / "run", progress=False)
        module.load_state_dict(load_file(str(run.export("safetensors"))))  # strict
        ours = run.predict(data.test_images)
    module.eval()
    with torch.no_grad():
        theirs = torch.softmax(module(torch.from_numpy(data.test_images)), dim=1).numpy()
    accuracy = float((theirs.argmax(axis=1) == data.test_labels).mean())
    print(f"hetconv test accuracy {run.test_accuracy:.4f}; the PyTorch module with the "
          f"trained weights: {accuracy:.4f}; largest probability difference "
          f"{float(np.abs(theirs - ours).max()):.2e}")


if __name__ == "__main__":
    main()
