"""The report's results as plain frozen dataclasses (what :mod:`master.report.analysis`
computes and the renderers show).

Times are seconds (``_s``), sizes bytes, shares and efficiencies fractions
(0..1), ratios plain numbers (1.0 = equal). ``None`` means "cannot be computed
from this run" (no steps yet, a participant without kernels in a layer, a local run
without calibration). Layers are numbered from 0, as in ``metrics.jsonl``. The names
with ``device`` in them (``DeviceSummary``, ``devices``, ``fastest_device``, ...) are
about participants; they are the keys of ``hetconv report --json``
(:mod:`master.report.json_out`, ``hetconv-report/1``) and keep their spelling.
"""
from __future__ import annotations

from dataclasses import dataclass

from hetconv.analysis.report.events import MembershipEvent
from hetconv.analysis.report.records import EpochRecord, StepModelCheck


@dataclass(frozen=True)
class DeviceLayer:
    """One participant in one conv layer."""

    layer: int
    kernels: int
    kernel_share: float  # kernels / layer kernels
    calibration_s: float | None  # calibration block forward+backward time (equal share)
    calibrated_speed: float | None  # fastest calibration time / this one's (1.0 = fastest)
    compute_s: float | None  # median forward+backward compute seconds per step
    throughput_share: float | None  # k/c~ over the sum of k/c~ of the layer's participants
    speed_vs_calibration: float | None  # measured kernels/s over calibrated kernels/s


@dataclass(frozen=True)
class DeviceSummary:
    """One participant (``id``) over the run."""

    id: str
    kind: str
    name: str
    layers: tuple[DeviceLayer, ...]
    compute_s: float | None  # median per step of forward+backward summed over layers
    wait_s: float | None  # median per step of the time the master waited on it
    bytes_sent: float | None  # median per step, master -> participant
    bytes_received: float | None  # median per step, participant -> master
    single_device_conv_s: float | None  # alone, est. from the cost fit or per sample (None: not in every layer)
    peer_bytes: float | None = None  # median per step, worker <-> worker (peer plane)
    blas: str = ""  # a CPU's numpy BLAS kernels ("openblas SkylakeX"; "" unknown)


@dataclass(frozen=True)
class TimeSplit:
    """Median step time and its parts (paper figures 6 and 8: Comm / Conv / Comp)."""

    step_s: float
    comm_s: float  # median comm_s
    conv_s: float  # median (conv_s - comm_s): distributed conv compute
    dense_s: float  # median dense_s
    other_s: float  # median max(0, step_s - conv_s - dense_s)
    comm_fraction: float  # each part over comm + conv + dense + other
    conv_fraction: float
    dense_fraction: float
    other_fraction: float
    # median of conv_s minus, per layer and phase, the latest participant's latency summed:
    # conv wall time after the last result was in the master's hands (None: no latencies)
    after_results_s: float | None = None


@dataclass(frozen=True)
class LayerBalance:
    layer: int
    kernels: int
    ideal_s: float | None  # median over steps of sum_p K_l / sum_d v_dlps
    slowest_s: float | None  # median over steps of sum_p max_d t_dlp
    efficiency: float | None  # ideal_s / slowest_s
    imbalance: float | None  # median over steps of max_d c_dl / mean_d c_dl


@dataclass(frozen=True)
class WhatIf:
    step_s: float  # the measured median step time both predictions start from
    extra_device: str | None  # the participant a new one would be a copy of (the fastest)
    extra_device_step_s: float | None
    extra_device_speedup: float | None  # step_s / extra_device_step_s
    fast_network_step_s: float
    fast_network_speedup: float
    notes: tuple[str, ...]


@dataclass(frozen=True)
class SnapshotCost:
    """What the training snapshots cost in a run (``checkpoint`` records): the
    fault-free price of resilience (pulling every shard, checking it, writing the file)."""

    count: int  # snapshots taken (the start, every --checkpoint-every steps, epoch ends)
    total_s: float  # seconds, all snapshots
    median_s: float  # seconds per snapshot (median)
    state_bytes: int  # array bytes pulled and kept, all snapshots
    file_bytes: int  # bytes written to checkpoint.npz, all snapshots
    steps: int  # steps trained (one per step, replays not counted)
    per_step_s: float | None  # total_s / steps
    per_step_state_bytes: float | None  # state_bytes / steps
    per_step_file_bytes: float | None  # file_bytes / steps
    step_fraction: float | None  # per_step_s / median step time


@dataclass(frozen=True)
class Resilience:
    """Membership events and what faults and snapshots cost (seconds, steps)."""

    events: tuple[MembershipEvent, ...]  # in time order
    start_time: float | None  # Unix time of the run's first record (events are shown after it)
    recoveries: int
    recovery_s: float  # the recoveries' own seconds, summed
    replayed_steps: int  # step records a later record of the same step replaced
    snapshots: SnapshotCost | None  # None: no checkpoint records (an older run)


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    name: str
    mode: str
    status: str  # run_end status, or "in progress"
    arch: tuple[int, ...]
    batch: int | None
    steps_total: int
    steps_used: int
    epochs_planned: int | None
    devices: tuple[DeviceSummary, ...]
    split: TimeSplit | None
    layers: tuple[LayerBalance, ...]
    conv_ideal_s: float | None
    conv_slowest_s: float | None
    balance_efficiency: float | None
    imbalance: float | None  # the worst layer's
    imbalance_layer: int | None
    fastest_device: str | None
    single_device_step_s: float | None
    speedup: float | None
    amdahl_bound: float | None
    predicted_step_s: float | None  # set-up's: the rehearsed plan's step model, or the
    # planner's model (conv + transfers) + measured dense (``predicted_by``)
    what_if: WhatIf | None
    epochs: tuple[EpochRecord, ...]
    final_test_accuracy: float | None
    images_per_s: float | None
    warnings: tuple[str, ...]
    resilience: Resilience | None = None
    checkpoint_every: int | None = None  # the run's --checkpoint-every (None: not recorded)
    network: str = ""  # the run's network spec (--arch / --model), "" for older runs
    step_model: StepModelCheck | None = None  # the sample split's model calibrated in place

    split_by: str = "kernels"  # what the layers were cut into: kernels or samples
    bn_statistics: str = "batch"  # split by samples: the whole batch's or each slice's own
    dense_part: str = "master"  # where the dense part ran: "master" or "replicas"
    wire: str = ""  # the wire dtype(s) the plan chose; "" for a local run
    split_choice: tuple[str, str] = ("", "")  # the plan's split and why; empty: unknown
    not_used: tuple[str, ...] = ()  # participants the plan left out
    ended_alone: tuple[int, str] | None = None  # (first step alone, why): the alone check
    predicted_by: str = "planner"  # whose predicted_step_s: "rehearsal" or "planner"
