"""Setting up a run split by samples (``--split-by samples`` or ``auto``).

Called by ``master/setup.py`` once the workers are in and calibrated: decides between
the kernel and the sample split (``master/samples/plan.py``), and for the sample split
hands every participant every whole layer (the seeded initial weights) and builds the
:class:`~hetconv.master.samples.stage.SampleConvStage`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from hetconv.config import (
    MASTER_PARTICIPANT,
    WIRE_DTYPE_AUTO,
    WIRE_FLOAT16_GAIN,
    MasterConfig,
)
from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.engine.stage import ConvStage
from hetconv.master.assign import assign
from hetconv.master.cluster import Cluster
from hetconv.master.data_ports import DataPortUnreachable
from hetconv.master.plan import Participant, Shard
from hetconv.master.run import RunControl
from hetconv.master.samples.balance import SampleBalance
from hetconv.master.samples.peers import SamplePeers
from hetconv.master.samples.plan import (
    choose_dense_part,
    choose_link_wires,
    choose_sample_members,
    choose_split_by,
    conv_weights,
    link_wires_text,
    predict_sample_step,
    sample_slices,
    samples_refusal,
)
from hetconv.master.samples.settings import SampleSetup
from hetconv.master.samples.stage import SampleConvStage
from hetconv.metrics import MetricsWriter
from hetconv.model import ConvLayerShape, ModelConfig, dense_parameter_names, layer_parameters
from hetconv.planning.perf_model import Link


def split_by_for(config: MasterConfig, model: ModelConfig, shapes: list[ConvLayerShape],
                 batch: int) -> tuple[str, str]:
    """(``"kernels"`` or ``"samples"``, why) for this run (UserError-free: a refused
    ``--split-by samples`` raises ValueError with the one-line reason)."""
    return choose_split_by(config.split_by, shapes, batch,
                           [s.kernel_size for s in model.conv_specs()],
                           samples_refusal_for(model, shapes, config.data_plane))


def samples_refusal_for(model: ModelConfig, shapes: list[ConvLayerShape],
                        data_plane: str = "peer") -> str | None:
    """Why ``model``'s conv layers cannot be split by samples (one line), or None."""
    if model.residual and data_plane != "peer":
        return ("a residual network split by samples joins its shortcuts in the "
                "participants' chains, which run over the peer data plane: --data-plane "
                "peer (the default), or --split-by kernels")
    specs = model.conv_specs()
    return samples_refusal(shapes, [s.kernel_size for s in specs], [s.stride for s in specs],
                           [s.padding for s in specs], [s.pool for s in specs])


def _seconds(config: MasterConfig, per_sample: list[float]) -> list[float]:
    """Per participant: its share's weight (all equal under ``--split equal``)."""
    return [1.0] * len(per_sample) if config.split == "equal" else list(per_sample)


def predict_samples(config: MasterConfig, participants: list[Participant],
                    per_sample: list[float], shapes: list[ConvLayerShape], batch: int,
                    links: dict[str, Link | None], dense_values: int = 0,
                    link_wires: Mapping[str, str] | None = None) -> float:
    """The predicted conv + transfer seconds of a step split by samples
    (``predict_sample_step`` over the slices of ``per_sample``, each participant's
    seconds per sample timed in place (``calibrate_samples``), and the probed links);
    ``link_wires``: a wire dtype per worker's link, over ``config``'s."""
    real = per_sample
    seconds = _seconds(config, per_sample)
    names = [p.participant for p in participants]
    slices = sample_slices(names, seconds, batch)
    return predict_sample_step(slices, dict(zip(names, real)), links, shapes,
                               conv_weights(shapes),
                               np.dtype(config.wire_dtype if config.wire_dtype != "auto"
                                        else "float32").itemsize,
                               "peer" if config.data_plane == "peer" else "master",
                               slice_statistics=config.bn_statistics == "slice",
                               dense_values=dense_values if config.dense_part != "master" else 0,
                               link_itemsizes={name: np.dtype(dtype).itemsize
                                               for name, dtype in (link_wires or {}).items()},
                               ahead=config.steps_in_flight > 1)


def largest_slice(config: MasterConfig, participants: list[Participant],
                  per_sample: list[float], batch: int) -> int:
    """Samples of the largest slice the run starts with."""
    slices = sample_slices([p.participant for p in participants],
                           _seconds(config, per_sample), batch)
    return max((s.samples for s in slices), default=batch) or batch


def time_dense_part(model: ModelConfig, params: dict[str, np.ndarray], samples: int,
                    repeats: int = 3) -> float:
    """Seconds of the dense part's forward, backward and update on ``samples`` samples
    on this machine (the best of ``repeats``; seeded random features and labels, a copy
    of the arrays: the run's are not touched)."""
    from hetconv.engine.dense_part import DensePart
    from hetconv.model import dense_features

    names = dense_parameter_names(model)
    part = DensePart(model.dense, {n: params[n].copy() for n in names},
                     {n: np.zeros_like(params[n]) for n in names}, seed=0)
    rng = np.random.default_rng(0)
    flat = np.abs(rng.standard_normal((samples, dense_features(model)))).astype(np.float32)
    labels = rng.integers(0, model.classes, samples)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        done = part.train_pass(flat, labels, 0)
        part.apply(done.grads, 0.0, 0.9, 0.0)
        best = min(best, time.perf_counter() - started)
    return best


def dense_values(model: ModelConfig, params: dict[str, np.ndarray]) -> int:
    """The dense part's parameter values (what its replicas reduce every step)."""
    return sum(int(params[name].size) for name in dense_parameter_names(model))


def dense_part_for(config: MasterConfig, participants: list[Participant],
                   per_sample: list[float], shapes: list[ConvLayerShape], batch: int,
                   links: dict[str, Link | None], model: ModelConfig,
                   params: dict[str, np.ndarray], report: Callable[[str], None] = print
                   ) -> tuple[float, float, MasterConfig]:
    """Where the sample split's dense part runs (``--dense-part``, docs/dense-replica.md):
    the choice's predicted seconds as the kernel split's compare (``choose_dense_part``),
    its conv + transfer seconds (``predict_sample_step``: the ``plan`` record's), and the
    config with ``dense_part`` settled to ``replicas`` or ``master``."""
    values = dense_values(model, params)
    on_master = predict_samples(replace(config, dense_part="master"), participants,
                                per_sample, shapes, batch, links, values)
    if config.data_plane != "peer" or config.dense_part == "master":
        return on_master, on_master, replace(config, dense_part="master")
    replicated = predict_samples(config, participants, per_sample, shapes, batch, links,
                                 values)
    whole_s = time_dense_part(model, params, batch)
    slice_s = time_dense_part(model, params,
                              largest_slice(config, participants, per_sample, batch))
    replicate, compared = choose_dense_part(config.dense_part, on_master, replicated,
                                            whole_s, slice_s)
    if config.dense_part == "auto":
        report(f"hetconv: the dense part {'on every participant' if replicate else 'on the master'}"
               f" (--dense-part auto: predicted {(replicated + slice_s) * 1e3:.1f} ms a step "
               f"replicated, {(on_master + whole_s) * 1e3:.1f} ms on the master, conv + "
               "transfer + dense part)")
    return compared, (replicated if replicate else on_master), \
        replace(config, dense_part="replicas" if replicate else "master")


def sample_members_for(config: MasterConfig, participants: list[Participant],
                       per_sample: list[float], shapes: list[ConvLayerShape], batch: int,
                       links: dict[str, Link | None], model: ModelConfig,
                       params: dict[str, np.ndarray], report: Callable[[str], None] = print
                       ) -> tuple[list[Participant], list[float], dict[str, Link | None],
                                  tuple[str, ...]]:
    """Under ``--split model``, the workers the sample split leaves out for their links
    (``choose_sample_members``, each candidate predicted with the dense part replicated
    unless it is pinned to the master, and with its own wire dtypes under
    ``--wire-dtype auto``: ``choose_link_wires``); the participants, seconds per sample
    and links of the rest, and the names left out."""
    if config.split != "model" or not any(link is not None for link in links.values()):
        return participants, per_sample, links, ()
    values = dense_values(model, params)
    wired = config if config.wire_dtype != WIRE_DTYPE_AUTO \
        else replace(config, wire_dtype="float32")

    def without(left_out: Sequence[str]) -> tuple[list[Participant], list[float],
                                                  dict[str, Link | None]]:
        kept = [i for i, p in enumerate(participants) if p.participant not in left_out]
        return ([participants[i] for i in kept], [per_sample[i] for i in kept],
                {name: link for name, link in links.items() if name not in left_out})

    def predict(left_out: Sequence[str]) -> float:
        used, seconds, used_links = without(left_out)
        if config.wire_dtype != WIRE_DTYPE_AUTO:
            return predict_samples(wired, used, seconds, shapes, batch, used_links, values)
        return choose_link_wires(
            lambda dtypes: predict_samples(wired, used, seconds, shapes, batch, used_links,
                                           values, dtypes), used_links).chosen_s

    chosen = choose_sample_members(predict, links)
    if not chosen.left_out:
        return participants, per_sample, links, ()
    report(f"hetconv: not used: {', '.join(chosen.left_out)} (split by samples, every "
           "participant's link carries its share of the weight reduction: predicted "
           f"{chosen.chosen_s * 1e3:.1f} ms a step without, {chosen.all_s * 1e3:.1f} ms "
           f"with; --split equal uses every worker)")
    return (*without(chosen.left_out), chosen.left_out)


def sample_wire_for(config: MasterConfig, participants: list[Participant],
                    per_sample: list[float], shapes: list[ConvLayerShape], batch: int,
                    links: dict[str, Link | None], model: ModelConfig,
                    params: dict[str, np.ndarray], report: Callable[[str], None] = print
                    ) -> tuple[MasterConfig, float, dict[str, str]]:
    """``--wire-dtype auto`` settled for the sample split, per worker's link
    (``choose_link_wires``: float16 on the slowest links where the step predicted for
    the dense placement ``config`` has settled is shorter with it); the config with the
    dtype of links not chosen for (``LinkWires.default``: joiners), the seconds the
    choice saves on the prediction (0 with float32 or a given dtype) and the dtype of
    every worker's link (empty for a given dtype: every link carries it)."""
    if config.wire_dtype != WIRE_DTYPE_AUTO:
        return config, 0.0, {}
    values = dense_values(model, params)
    wired = replace(config, wire_dtype="float32")
    chosen = choose_link_wires(
        lambda dtypes: predict_samples(wired, participants, per_sample, shapes, batch, links,
                                       values, dtypes), links)
    what = link_wires_text(chosen.dtypes)
    report("hetconv: wire dtype for the samples' inputs"
           + ("" if config.dense_part == "replicas" else " and the dense part's features")
           + f": {what} (--wire-dtype auto: predicted {chosen.chosen_s * 1e3:.1f} ms a step "
           f"so, {chosen.float32_s * 1e3:.1f} ms with float32 everywhere; float16 on the "
           f"slowest links when {WIRE_FLOAT16_GAIN:.0%} shorter; the weight gradients are "
           "reduced in float32)")
    return (replace(config, wire_dtype=chosen.default), chosen.float32_s - chosen.chosen_s,
            chosen.dtypes)


def open_sample_stage(cluster: Cluster, config: MasterConfig, participants: list[Participant],
                      calibration: list[Any], per_sample: list[float],
                      shapes: list[ConvLayerShape],
                      params: dict[str, np.ndarray], settings: LayerSettings,
                      metrics: MetricsWriter, batch: int, device: str,
                      local_stage: Callable[[], ConvStage],
                      report: Callable[[str], None] = print,
                      predicted_s: float | None = None,
                      links: dict[str, Link | None] | None = None,
                      link_wires: Mapping[str, str] | None = None,
                      left_out: Sequence[str] = (), split_why: str = "",
                      alone_conv_s: float | None = None) -> SampleConvStage:
    """Hand out the whole layers and build the stage (see the module doc). ``left_out``:
    workers of ``participants`` (and of ``per_sample``) the run does not use
    (``sample_members_for``): no layers, no samples, never taken in as joiners.
    ``split_why``: why the run is split by samples (the ``plan`` record's)."""
    seconds = _seconds(config, per_sample)
    balance = SampleBalance({p.participant: t for p, t in zip(participants, seconds)
                             if p.participant not in left_out})
    workers = [p for p in participants if p.worker is not None and p.participant not in left_out]
    rows = [[Shard(p.participant, p.worker, 0, shape.kernels) for p in workers]
            for shape in shapes]
    assign(cluster, rows, params, settings, {}, device, "first")
    local = {shape.index: ConvShard(shape.index, 0, shape.kernels, settings,
                                    layer_parameters(params, shape.index), device=device)
             for shape in shapes}
    master_computes = any(p.participant == MASTER_PARTICIPANT for p in participants)
    setup = SampleSetup(tuple(shapes), settings, device,
                        "float32" if config.wire_dtype == "auto" else config.wire_dtype,
                        batch, master_computes, local_stage, metrics, report,
                        rebalancing=config.rebalancing and config.split != "equal",
                        fall_back=config.fall_back, predicted_s=predicted_s,
                        alone_conv_s=alone_conv_s,
                        slice_statistics=config.bn_statistics == "slice"
                        and config.data_plane == "peer",
                        dense_replicas=config.dense_part != "master"
                        and config.data_plane == "peer",
                        steps_in_flight=config.steps_in_flight,
                        link_wires=dict(link_wires or {}), left_out=frozenset(left_out))
    control = RunControl((p.participant for p in workers),
                         stop_on_worker_loss=config.on_worker_loss == "stop")

    def finish() -> None:
        cluster.end_run("training finished")
        cluster.close()

    peers = SamplePeers(cluster, config.peer_timeout_s) if config.data_plane == "peer" else None
    stage = SampleConvStage(cluster, workers, local, balance, control, setup, finish, peers)
    try:
        stage.assign_peers()
    except DataPortUnreachable as fault:
        stage.pending_fault = fault  # the first forward raises it (a recovery)
    except BaseException:
        stage.rounds.close()
        if peers is not None:
            peers.close()
        raise  # the caller ends the run
    slices = stage.members.slices(batch)
    share = {s.participant: s.samples for s in slices}
    exchange = stage.replicas.runner.layers.exchange  # the peers' reduction plan (None under star)
    bucket = exchange.plan.bucket if exchange is not None else []
    for shape, cal in zip(shapes, calibration):  # what `hetconv plan` and the report read
        metrics.write("calibration", layer=shape.index, split=config.split, split_by="samples",
                      calibrated_kernels=cal.calibrated_kernels, kernels=shape.kernels,
                      small_kernels=cal.small_kernels,
                      participants=[{"participant": p.participant, "seconds": t, "small_seconds": small,
                                "fixed_s": cost[0], "per_kernel_s": cost[1],
                                "kernels": shape.kernels, "kernel_start": 0,
                                "kernel_stop": shape.kernels,
                                "samples": share.get(p.participant, 0),
                                "share": share.get(p.participant, 0) / batch}
                               for p, t, small, cost in zip(participants, cal.seconds,
                                                            cal.small_seconds,
                                                            cal.cost_models())])
    report("hetconv: split by samples: " + ", ".join(
        f"{s.participant} {s.samples} ({100 * s.samples / batch:.0f}%)" for s in slices)
        + f" of every batch of {batch}; every participant holds every layer; batch norm "
        + ("with each slice's own statistics (--bn-statistics slice)"
           if setup.slice_statistics else "with the whole batch's statistics")
        + ("; the dense part on every participant's slice (--dense-part)"
           if setup.dense_replicas else "; the dense part on the master")
        + (f"; layers 1-{len(bucket)}'s weight gradients reduced as one piece "
           f"({4 * sum(bucket) / 1024:.1f} KiB)" if len(bucket) > 1 else ""))
    metrics.write("plan", split_by="samples", split_by_why=split_why,
                  chosen=[s.participant for s in slices],
                  bn_statistics="slice" if setup.slice_statistics else "batch",
                  dense_part="replicas" if setup.dense_replicas else "master",
                  reduced_together=len(bucket), predicted_step_s=predicted_s,
                  samples=[{"participant": s.participant, "samples": s.samples} for s in slices],
                  not_used=list(left_out),
                  seconds_per_sample={p.participant: t for p, t in zip(participants, per_sample)},
                  wire_dtype=setup.wire_dtype,
                  link_wire_dtypes={p.participant: setup.wire_for(p.participant)
                                    for p in workers},
                  links=[{"participant": name, "down_bytes_per_s": link.down_bytes_per_s,
                          "up_bytes_per_s": link.up_bytes_per_s, "rtt_s": link.rtt_s}
                         for name, link in (links or {}).items() if link is not None])
    return stage
