"""Result audits: catching a participant whose results are finite but wrong.

Non-finite or wrongly shaped replies are caught on arrival (``checked_result``);
a worker with broken memory or a broken BLAS can also answer finite numbers that
are simply wrong (y x 1000), and training would go on from them. Every snapshot
the master pulls (``DistributedConvStage.snapshot``, before every checkpoint and
every re-split) is therefore audited: each worker holding kernels of a layer gets
a small evaluation-mode forward request (:data:`AUDIT_SAMPLES` images of seeded
random input, BN with running statistics, so no state changes on the worker) and
its output is compared with the master's own recomputation from the shard state
that worker has just sent. A mismatch evicts the worker like any bad data, and
the trainer restores the previous snapshot, which passed its audit: corrupted
updates never survive a recovery.

What it catches: a worker whose forward computation is wrong now (scaled, shifted,
garbage) for the kernels it holds. What it cannot: a worker whose stored weights
went wrong while it computes consistently with them (the snapshot carries the
same wrong weights), errors only in the backward pass or in the batch-statistics
path of training mode, errors below :data:`AUDIT_TOLERANCE` of the output's
magnitude, and corruption that comes and goes between snapshots.
"""
from __future__ import annotations

import numpy as np

from hetconv.model import ConvLayerShape

AUDIT_SAMPLES = 4
"""Images in an audit's forward request: enough to exercise every kernel, cheap to send."""
AUDIT_TOLERANCE = 1e-2
"""Largest |worker - reference| allowed, relative to the reference's largest |value|
(float16 on the wire rounds at about 5e-4 relative; different BLAS paths far less)."""


def audit_input(shape: ConvLayerShape, step: int, layer: int) -> np.ndarray:
    """Seeded standard-normal input of the layer, (AUDIT_SAMPLES, C, H, W) float32."""
    rng = np.random.default_rng([step % 2**32, layer, 0xA0D17])
    return rng.standard_normal(shape.input_shape(AUDIT_SAMPLES)).astype(np.float32)


def audit_mismatch(answered: np.ndarray, reference: np.ndarray) -> str | None:
    """None when ``answered`` matches ``reference`` within :data:`AUDIT_TOLERANCE`;
    otherwise a short description of how far off it is. Shapes must match."""
    if answered.shape != reference.shape:
        return f"output of shape {answered.shape}, expected {reference.shape}"
    answered = np.asarray(answered, dtype=np.float32)
    if not np.isfinite(answered).all():
        return "output holding NaN or Inf"
    scale = float(np.max(np.abs(reference))) if reference.size else 0.0
    error = float(np.max(np.abs(answered - reference))) if reference.size else 0.0
    if error <= AUDIT_TOLERANCE * max(scale, 1e-6):
        return None
    return (f"output off by up to {error:.3g} where the master's recomputation peaks at "
            f"{scale:.3g} (tolerance {AUDIT_TOLERANCE:g} of it)")
