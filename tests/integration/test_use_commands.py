"""``hetconv evaluate``, ``predict`` and ``export`` as a user runs them: real processes on
a real run directory and real image files; their output, the files they write, and one
line (``hetconv: error: ...``, status 2, no traceback) for every bad input."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import child_env, epoch_records, hetconv_command, run_hetconv

pytestmark = [pytest.mark.integration]

CLASSES = ("circle", "square")


def draw(shape: str, size: int, seed: int) -> Image.Image:
    """A white circle or square on black, at a seeded position and size."""
    rng = np.random.default_rng(seed)
    image = np.zeros((size, size), np.uint8)
    radius = int(rng.integers(size // 5, size // 3))
    cy, cx = (int(v) for v in rng.integers(radius, size - radius, 2))
    yy, xx = np.mgrid[:size, :size]
    if shape == "circle":
        image[(yy - cy) ** 2 + (xx - cx) ** 2 <= radius ** 2] = 255
    else:
        image[cy - radius:cy + radius, cx - radius:cx + radius] = 255
    return Image.fromarray(image)


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained on an image folder of two named classes (a non-paper spec)."""
    base = tmp_path_factory.mktemp("use")
    data = base / "shapes"
    for label, name in enumerate(CLASSES):
        (data / name).mkdir(parents=True)
        for index in range(60):
            draw(name, 16, 100 * label + index).save(data / name / f"{index}.png")
    run_dir = base / "run"
    result = run_hetconv("train", "--local", "--data", "folder", "--data-dir", str(data),
                         "--arch", "c4k3p1,pool,c8k3p1,pool,fc16,drop0.1", "--epochs", "3",
                         "--batch", "16", "--threads", "1", "--no-progress",
                         "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return run_dir


def one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hetconv: error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(240)
def test_evaluate_prints_and_writes_the_page(folder_run: Path) -> None:
    result = run_hetconv("evaluate", str(folder_run))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    accuracy = epoch_records(folder_run)[-1]["test_accuracy"]
    assert any(line.startswith(f"test accuracy {accuracy:.4f} (") for line in lines), lines
    assert "per-class accuracy:" in lines
    assert any("confusion matrix" in line for line in lines)
    for name in CLASSES:  # the class names come along: per-class rows, matrix rows
        assert sum(name in line for line in lines) >= 2, name
    page = (folder_run / "evaluation.html").read_text(encoding="utf-8")
    assert "data:image/png;base64," in page and all(name in page for name in CLASSES)
    assert f"wrote {folder_run / 'evaluation.html'}" in lines


@pytest.mark.timeout(240)
def test_predict_names_the_top_classes(folder_run: Path, tmp_path: Path) -> None:
    circle, square = tmp_path / "circle.png", tmp_path / "square.jpg"
    draw("circle", 40, 7).convert("RGB").save(circle)  # another size, colour mode, format
    draw("square", 24, 8).save(square, quality=95)
    result = run_hetconv("predict", str(folder_run), str(circle), str(square), "--top", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"{circle}:" and lines[3] == f"{square}:"
    rows = [lines[1].split(), lines[2].split(), lines[4].split(), lines[5].split()]
    assert all(row[2] in CLASSES for row in rows)
    assert float(rows[0][0]) + float(rows[1][0]) == pytest.approx(1.0, abs=2e-4)
    result = run_hetconv("predict", str(folder_run), str(circle), "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer[0]["image"] == str(circle)
    assert {t["name"] for t in answer[0]["top"]} == set(CLASSES)  # --top 3: both classes


@pytest.mark.timeout(240)
def test_export_writes_files_onnxruntime_runs(folder_run: Path, tmp_path: Path) -> None:
    import onnxruntime

    result = run_hetconv("export", str(folder_run), "--format", "onnx")
    assert result.returncode == 0, result.stderr
    path = folder_run / "model.onnx"
    assert result.stdout.startswith(f"wrote {path} (") and "circle, square" in result.stdout
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    assert json.loads(meta["class_names"]) == list(CLASSES)
    out = tmp_path / "weights.safetensors"
    result = run_hetconv("export", str(folder_run), "--format", "safetensors", "--output",
                         str(out))
    assert result.returncode == 0, result.stderr
    assert out.is_file() and out.stat().st_size > 0


@pytest.mark.timeout(240)
def test_bad_input_is_one_line(folder_run: Path, tmp_path: Path) -> None:
    one_line_error(run_hetconv("evaluate", str(tmp_path / "nope")), "no such run directory")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_bytes((folder_run / "config.json").read_bytes())
    one_line_error(run_hetconv("evaluate", str(no_weights)), "no weights.npz")
    one_line_error(run_hetconv("predict", str(no_weights), str(tmp_path / "x.png")),
                   "no weights.npz")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    one_line_error(run_hetconv("predict", str(folder_run), str(broken)), str(broken),
                   "cannot read it as an image")
    one_line_error(run_hetconv("predict", str(folder_run), str(tmp_path / "missing.png")),
                   "no such file")
    one_line_error(run_hetconv("export", str(folder_run), "--format", "tflite"),
                   "invalid choice: 'tflite'")
    one_line_error(run_hetconv("export", str(folder_run)), "--format")


@pytest.mark.timeout(240)
def test_a_missing_extra_says_how_to_install_it(folder_run: Path, tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"  # modules named onnx and safetensors that fail to import
    shadow.mkdir()
    for name in ("onnx", "safetensors"):
        (shadow / f"{name}.py").write_text(f'raise ImportError("No module named {name}")\n')
    env = child_env()
    env["PYTHONPATH"] = f"{shadow}:{env['PYTHONPATH']}"
    for fmt in ("onnx", "safetensors"):
        result = subprocess.run(hetconv_command("export", str(folder_run), "--format", fmt,
                                                "--output", str(tmp_path / f"m.{fmt}")),
                                capture_output=True, text=True, timeout=120, env=env)
        one_line_error(result, "install hetconv[export]")
        assert not (tmp_path / f"m.{fmt}").exists()
