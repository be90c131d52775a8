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
garbage) for the kernels it holds. With the dense part replicated (the sample split's
step chain), the same request at layer L (the conv layers' count) asks each worker for
its dense part's evaluation-mode logits of seeded features (:func:`dense_audit_input`),
compared with the master's own dense part: a replica whose dense arrays diverged is
caught too. What it cannot: a worker whose stored weights
went wrong while it computes consistently with them (the snapshot carries the
same wrong weights), errors only in the backward pass or in the batch-statistics
path of training mode, errors below :data:`AUDIT_TOLERANCE` of the output's
magnitude, and corruption that comes and goes between snapshots.

:func:`audit_input` and :func:`audit_mismatch` are pure; :func:`audit_workers` asks
the workers (both splits' stages use it, each with its own reference).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hetconv.master.assign import exchange
from hetconv.master.cluster import Cluster, WorkerHandle, WorkerLost
from hetconv.master.plan import Shard
from hetconv.model import ConvLayerShape
from hetconv.protocol import ForwardReply, ForwardRequest

AUDIT_SAMPLES = 4
"""Images in an audit's forward request: enough to exercise every kernel, cheap to send."""
AUDIT_TOLERANCE = 1e-2
"""Largest |worker - reference| allowed, relative to the reference's largest |value|
(float16 on the wire rounds at about 5e-4 relative; different BLAS paths far less)."""


def audit_input(shape: ConvLayerShape, step: int, layer: int) -> np.ndarray:
    """Seeded standard-normal input of the layer, (AUDIT_SAMPLES, C, H, W) float32."""
    rng = np.random.default_rng([step % 2**32, layer, 0xA0D17])
    return rng.standard_normal(shape.input_shape(AUDIT_SAMPLES)).astype(np.float32)


def dense_audit_input(last: ConvLayerShape, step: int, layer: int) -> np.ndarray:
    """Seeded input of the replicated dense part (docs/dense-replica.md): what the last
    conv layer outputs, (AUDIT_SAMPLES, K, H', W') float32, non-negative as after a ReLU."""
    rng = np.random.default_rng([step % 2**32, layer, 0xA0D17])
    shape = (AUDIT_SAMPLES, last.kernels, last.pooled_height, last.pooled_width)
    return np.abs(rng.standard_normal(shape)).astype(np.float32)


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


def audit_workers(cluster: Cluster, step: int, asked: Sequence[tuple[Shard, int, np.ndarray]],
                  timeout_s: float,
                  reference: Callable[[Shard, int, np.ndarray], np.ndarray]) -> None:
    """Send every worker's shard in ``asked`` (shard, layer, audit input as sent) an
    evaluation-mode forward request and compare each answer with ``reference(shard,
    layer, x)`` (the master's own output, x as float32): WorkerLost (evict) for the
    first worker that answers differently."""
    sent: list[tuple[Shard, int, np.ndarray]] = []
    requests: list[tuple[WorkerHandle, ForwardRequest]] = []
    for shard, layer, x in asked:
        if shard.worker is not None:  # the master's own shards are not audited
            sent.append((shard, layer, x))
            requests.append((shard.worker, ForwardRequest(
                request_id=cluster.request_id(), step=step, layer=layer, attempt=0,
                train=False, x=x)))
    replies = exchange(cluster, requests, "result audit", timeout_s=timeout_s)
    for (shard, layer, x), reply in zip(sent, replies):
        message = reply.message  # a ForwardReply of this layer (Membership checked)
        assert isinstance(message, ForwardReply)
        expected = reference(shard, layer, x.astype(np.float32))
        problem = audit_mismatch(np.asarray(message.y), np.asarray(expected))
        if problem is not None:
            raise WorkerLost(f"worker {shard.participant} failed the result audit of layer "
                             f"{layer + 1}: {problem}; evicting it", shard.participant,
                             evict=True)
