"""hetconv export: the ONNX graph gives hetconv's probabilities under onnxruntime, the
safetensors file loads into the PyTorch module of docs/export.md (built from that very
page) and gives them too, and both carry the class names; docs/export.md's tables
list exactly what the files hold. onnx, onnxruntime and safetensors come with the
extra ``hetconv[export]``, which deploy/test.sh installs; torch is the optional oracle
(a missing torch fails with HETCONV_REQUIRE_TORCH=1, see tests/conftest.py)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

try:
    import onnx
    import onnxruntime
    import safetensors.numpy
    from safetensors import safe_open
except ImportError as error:  # loud: the extra is part of the test environment
    raise ImportError(f"tests/unit/test_export.py needs hetconv[export] (pip install -e "
                      f"'.[test,export]'; deploy/test.sh installs it): {error}") from None

from hetconv.commands.cli import main
from hetconv.commands.export import run_export
from hetconv.errors import UserError
from hetconv.export.metadata import export_metadata, layer_records
from hetconv.export.onnx import INPUT_NAME, OPSET, OUTPUT_NAME, build_onnx_model
from hetconv.export.safetensors import torch_tensors
from hetconv.inference.use import Classifier, load_run, load_run_data, run_preprocessing

ROOT = Path(__file__).resolve().parents[2]
EXPORT_MD = ROOT / "docs" / "export.md"
SPECS = {"paper": "4:8", "tokens": "c4k3p1,pool,c8k3p1,pool,fc16,drop0.1",
         "variants": "c4k3p1s2nobn,avgpool,c6k3,fc8", "residual": "c4k3p1,res4,res8s2,gap"}
TOLERANCE = 1e-4
BATCH = 64


def train_run(run_dir: Path, arch: str) -> Path:
    status = main(["train", "--local", "--data", "synthetic", "--limit", "256", "--arch", arch,
                   "--epochs", "1", "--no-progress", "--threads", "1", "--run-dir", str(run_dir)])
    assert status == 0
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("export")
    return {name: train_run(base / name, spec) for name, spec in SPECS.items()}


def hetconv_batch(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(a test batch (BATCH, C, H, W), hetconv's probabilities for it)."""
    run = load_run(run_dir)
    images = load_run_data(run).test_images[:BATCH]
    return images, Classifier(run.model, run.params).probabilities(images)


# --- ONNX ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SPECS))
def test_onnxruntime_gives_hetconv_s_probabilities(runs: dict[str, Path], name: str,
                                                   tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    assert run_export(str(runs[name]), "onnx", str(path), out=lambda line: None) == 0
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == [INPUT_NAME]
    assert [o.name for o in session.get_outputs()] == [OUTPUT_NAME]
    images, expected = hetconv_batch(runs[name])
    got = session.run([OUTPUT_NAME], {INPUT_NAME: images})[0]
    assert got.shape == (BATCH, 10) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)
    assert (got.argmax(axis=1) == expected.argmax(axis=1)).mean() >= 0.98
    single = session.run([OUTPUT_NAME], {INPUT_NAME: images[:1]})[0]  # N is free
    np.testing.assert_allclose(single, expected[:1], atol=TOLERANCE, rtol=0)
    meta = session.get_modelmeta().custom_metadata_map
    assert json.loads(meta["class_names"]) == [f"class {i}" for i in range(10)]
    assert meta["network"] == SPECS[name]
    assert json.loads(meta["input_shape"]) == [1, 28, 28]


def test_the_onnx_graph_has_the_documented_shape(runs: dict[str, Path]) -> None:
    run = load_run(runs["variants"])
    proto = build_onnx_model(run.model, run.params, run.network, run_preprocessing(run))
    assert proto.opset_import[0].version == OPSET
    ops = [node.op_type for node in proto.graph.node]
    # nobn conv (bias, no batch norm) -> ReLU -> average pool; conv -> BN -> ReLU; fc; classifier
    assert ops == ["Conv", "Relu", "AveragePool", "Conv", "BatchNormalization", "Relu",
                   "Flatten", "Gemm", "Relu", "Gemm", "Softmax"]
    assert len(proto.graph.node[0].input) == 3  # the conv's bias is beta
    initializers = {t.name for t in proto.graph.initializer}
    assert "conv0.beta" in initializers and "conv0.gamma" not in initializers
    props = {p.key: p.value for p in proto.metadata_props}
    assert set(props) == set(export_metadata(run.model, run.network, run_preprocessing(run)))
    onnx.checker.check_model(proto)


# --- safetensors ---------------------------------------------------------------------------
def test_safetensors_holds_pytorch_names(runs: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    run_export(str(runs["tokens"]), "safetensors", str(path), out=lambda line: None)
    tensors = safetensors.numpy.load_file(str(path))
    run = load_run(runs["tokens"])
    assert set(tensors) == {
        "conv0.weight", "bn0.weight", "bn0.bias", "bn0.running_mean", "bn0.running_var",
        "bn0.num_batches_tracked", "conv1.weight", "bn1.weight", "bn1.bias",
        "bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked",
        "dense0.weight", "dense0.bias", "fc.weight", "fc.bias"}
    np.testing.assert_array_equal(tensors["bn1.weight"], run.params["conv1.gamma"])
    np.testing.assert_array_equal(tensors["bn1.bias"], run.params["conv1.beta"])
    np.testing.assert_array_equal(tensors["dense0.weight"], run.params["dense0.weight"])
    assert tensors["conv1.weight"].shape == (8, 4, 3, 3)
    assert tensors["bn0.num_batches_tracked"].shape == () and \
        tensors["bn0.num_batches_tracked"].dtype == np.int64
    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata()
    assert json.loads(metadata["class_names"]) == [f"class {i}" for i in range(10)]
    assert json.loads(metadata["layers"]) == layer_records(run.model)
    nobn = torch_tensors(load_run(runs["variants"]).model, load_run(runs["variants"]).params)
    assert "conv0.bias" in nobn and "bn0.weight" not in nobn and "bn1.weight" in nobn


def test_a_resnet_s_tensors_take_torchvision_s_names(runs: dict[str, Path]) -> None:
    run = load_run(runs["residual"])
    names = set(torch_tensors(run.model, run.params))
    bn = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    expected = {"conv1.weight", "fc.weight", "fc.bias"} | {f"bn1.{n}" for n in bn}
    for block, convs in (("layer1.0", ("conv1", "conv2")),
                         ("layer2.0", ("conv1", "conv2", "downsample.0"))):
        expected |= {f"{block}.{conv}.weight" for conv in convs}
        norms = [c.replace("conv", "bn").replace("downsample.0", "downsample.1") for c in convs]
        expected |= {f"{block}.{norm}.{n}" for norm in norms for n in bn}
    assert names == expected
    assert torch_tensors(run.model, run.params)["layer2.0.downsample.0.weight"].shape == (
        8, 4, 1, 1)


def documented_module() -> dict[str, Any]:
    """The namespace of docs/export.md's ``class HetconvNet`` code block, executed."""
    blocks = re.findall(r"```python\n(.*?)```", EXPORT_MD.read_text(encoding="utf-8"), re.S)
    code = [block for block in blocks if "class HetconvNet" in block]
    assert len(code) == 1, "docs/export.md: expected one python block with class HetconvNet"
    namespace: dict[str, Any] = {"__name__": "export_doc"}
    exec(compile(code[0], str(EXPORT_MD), "exec"), namespace)
    return namespace


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_documented_pytorch_module_loads_it(runs: dict[str, Path], name: str,
                                                tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    path = tmp_path / "model.safetensors"
    run_export(str(runs[name]), "safetensors", str(path), out=lambda line: None)
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    net = documented_module()["HetconvNet"](metadata)
    net.load_state_dict(load_file(str(path)))  # strict
    net.eval()
    images, expected = hetconv_batch(runs[name])
    with torch.no_grad():
        got = net(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)


# --- the docs list what the files hold --------------------------------------------------------
def test_the_docs_tables_match_the_files(runs: dict[str, Path]) -> None:
    text = EXPORT_MD.read_text(encoding="utf-8")
    keys = set(re.findall(r"^\| `(\w+)`(?:, `(\w+)`)? \|", text, re.M))
    documented_keys = {k for pair in keys for k in pair if k}
    run = load_run(runs["variants"])
    assert documented_keys == set(export_metadata(run.model, run.network,
                                                  run_preprocessing(run)))
    rows = re.findall(r"^\| `([\w{}.]+)`[^|]*\| \(([^)]*)\) \| (\w+) \|", text, re.M)
    documented = {name for name, _, _ in rows}
    produced = set()
    for spec in SPECS:
        if spec == "residual":  # torchvision's ResNet names: the prose, and the test below
            continue
        loaded = load_run(runs[spec])
        for key in torch_tensors(loaded.model, loaded.params):
            produced.add(re.sub(r"^(conv|bn)\d+", r"\1{i}", re.sub(r"^dense\d+", "dense{j}", key)))
    assert produced == documented


# --- errors ---------------------------------------------------------------------------------------
def test_a_missing_extra_is_one_line(runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                     tmp_path: Path) -> None:
    for module, fmt in (("onnx", "onnx"), ("safetensors", "safetensors")):
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, module, None)  # import fails as when not installed
            patch.setitem(sys.modules, f"{module}.numpy", None)
            with pytest.raises(UserError, match=r"install hetconv\[export\]") as caught:
                run_export(str(runs["paper"]), fmt, str(tmp_path / "x"), out=lambda line: None)
            assert "\n" not in str(caught.value)
    assert not (tmp_path / "x").exists()


def test_bad_format_and_output_are_one_line(runs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--format 'tflite'"):
        run_export(str(runs["paper"]), "tflite")
    with pytest.raises(UserError, match="is a directory"):
        run_export(str(runs["paper"]), "onnx", str(tmp_path))
    with pytest.raises(UserError, match="does not exist"):
        run_export(str(runs["paper"]), "onnx", str(tmp_path / "no" / "x.onnx"))
    with pytest.raises(UserError, match="no such run directory"):
        run_export(str(tmp_path / "none"), "onnx")
