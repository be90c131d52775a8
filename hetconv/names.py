"""Names of the network's arrays, defined once.

A conv layer (conv -> [batch norm] -> ReLU -> [2x2 pool], distributed by kernels)
``i`` (0-based, as in messages and metrics) stores its arrays under
``conv{i}.<name>`` in ``weights.npz`` and every whole-network dictionary:

- parameters: ``weight`` (K, C, k, k), ``gamma`` (K,), ``beta`` (K,)
- batch-norm statistics: ``running_mean`` (K,), ``running_var`` (K,)
- SGD velocities: ``velocity_weight``, ``velocity_gamma``, ``velocity_beta``
  (shaped like the parameter they belong to)

A conv layer without batch norm (``nobn``) uses ``beta`` as the convolution's bias;
its ``gamma`` and running statistics are kept (so every layer has the same arrays)
but unused.

The dense classifier is ``fc.weight`` (classes, features) and ``fc.bias`` (classes,).
Hidden dense layer ``j`` (0-based, in spec order) is ``dense{j}.weight`` (units,
features) and ``dense{j}.bias`` (units,). The master keeps their SGD velocities
under the same keys.
A shard (kernels [start, stop) of one layer on one participant) holds the same
names sliced along the first axis; ``AssignShard`` and ``SnapshotReply`` carry
them as fields of the same names.
"""
from __future__ import annotations

TRAINABLE_NAMES = ("weight", "gamma", "beta")
STATISTIC_NAMES = ("running_mean", "running_var")
PARAMETER_NAMES = TRAINABLE_NAMES + STATISTIC_NAMES  # what weights.npz holds per layer
VELOCITY_NAMES = tuple(f"velocity_{name}" for name in TRAINABLE_NAMES)
STATE_NAMES = PARAMETER_NAMES + VELOCITY_NAMES  # everything a shard keeps between steps

CLASSIFIER = "fc"
DENSE_WEIGHT = f"{CLASSIFIER}.weight"
DENSE_BIAS = f"{CLASSIFIER}.bias"


def hidden_prefix(index: int) -> str:
    """``dense{index}``: the key prefix of hidden dense layer ``index`` (0-based)."""
    return f"dense{index}"


def layer_key(layer: int, name: str) -> str:
    """``conv{layer}.{name}``: the whole-network key of one conv layer array."""
    return f"conv{layer}.{name}"


def split_key(key: str) -> tuple[int, str] | None:
    """``"conv3.gamma"`` -> ``(3, "gamma")``; None for a key that is not a conv layer's."""
    prefix, _, name = key.partition(".")
    if not prefix.startswith("conv") or not prefix[4:].isdigit() or name not in STATE_NAMES:
        return None
    return int(prefix[4:]), name


def velocity_name(name: str) -> str:
    """``"weight"`` -> ``"velocity_weight"``."""
    return f"velocity_{name}"
