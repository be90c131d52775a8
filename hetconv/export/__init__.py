"""Export a trained run for use outside hetconv: ONNX (:mod:`hetconv.export.onnx`) and
safetensors (:mod:`hetconv.export.safetensors`). Both need the optional extra
``hetconv[export]``; tensor names, layouts and metadata are in docs/export.md."""
from __future__ import annotations

from hetconv.errors import UserError

EXPORT_FORMATS = ("onnx", "safetensors")
"""What ``hetconv export --format`` writes."""
SUFFIXES = {"onnx": ".onnx", "safetensors": ".safetensors"}
EXTRA_HINT = "install hetconv[export] (pip install 'hetconv[export]')"


def missing_extra(package: str, error: ImportError) -> UserError:
    """The one-line error for an optional package that is not installed."""
    return UserError(f"exporting needs the Python package {package!r}, which is not "
                     f"installed ({error}); {EXTRA_HINT}")
