"""What the sample stage needs besides its cluster and members: one frozen record."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hetconv.engine.shard import LayerSettings
from hetconv.engine.stage import ConvStage
from hetconv.metrics import MetricsWriter
from hetconv.model import ConvLayerShape


@dataclass(frozen=True)
class SampleSetup:
    """What the sample stage needs besides its cluster and members."""

    shapes: tuple[ConvLayerShape, ...]
    settings: LayerSettings
    device: str  # the master's own device (its replicas)
    wire_dtype: str  # activations (x, y, dy) on the wire; statistics and gradients float32
    batch: int  # the training batch (calibrating joiners)
    master_computes: bool  # the master's own device takes a slice
    local_stage: Callable[[], ConvStage]  # the master alone (no worker left)
    metrics: MetricsWriter
    report: Callable[[str], None]
    rebalancing: bool = True  # re-slice from measured compute (``--rebalance``)
    fall_back: bool = True  # train alone when measured slower than alone (``--fall-back``)
    predicted_s: float | None = None  # the setup's prediction of the conv part (the plan's)
    alone_conv_s: float | None = None  # the master alone's conv part, measured at set-up
    slice_statistics: bool = False  # batch norm per slice (``--bn-statistics slice``)
    dense_replicas: bool = False  # the dense part on every participant (``--dense-part``)
    steps_in_flight: int = 1  # step chains sent before the last one's replies (2: ahead)
    link_wires: Mapping[str, str] = field(default_factory=dict)  # worker -> its link's dtype
    left_out: frozenset[str] = frozenset()  # workers the plan does not use (their links)

    @property
    def layers(self) -> int:
        """The number of conv layers."""
        return len(self.shapes)

    def wire_for(self, participant: str) -> str:
        """The wire dtype of ``participant``'s activations: its link's
        (``choose_link_wires``), else ``wire_dtype`` (a worker that joined later)."""
        return self.link_wires.get(participant, self.wire_dtype)
