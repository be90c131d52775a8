"""A performance model of one training step: compute and link costs -> step seconds.

Pure functions over measured numbers. The planner (``hetconv.master.kernels.planner``) uses
them to choose participants and kernels; ``hetconv bench scale`` prints the
prediction beside every measurement.

The star data plane (every worker exchanges everything with the master) is
simulated per layer and phase as it runs: the master sends the requests one after
another on its outgoing link (full duplex: its incoming link is separate), a worker
computes once its request has arrived, the master's own shard computes from time 0,
and the results come back one after another on the master's incoming link in the
order they are ready. Units: seconds, bytes, bytes per second. A participant's
compute cost for a layer is ``fixed_s + per_kernel_s * kernels`` for forward and
backward together (the calibration fit); ``FORWARD_FRACTION`` of it is the forward.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FORWARD_FRACTION = 1.0 / 3.0  # conv backward (dW and dx) costs about twice the forward


@dataclass(frozen=True)
class ParticipantCost:
    """One participant's calibrated cost for one layer (seconds) and its kernels there."""

    fixed_s: float
    per_kernel_s: float
    kernels: int

    def seconds(self) -> float:
        return 0.0 if self.kernels == 0 else self.fixed_s + self.per_kernel_s * self.kernels


@dataclass(frozen=True)
class Link:
    """A participant's link to the master as measured by the link probe (None = the master)."""

    down_bytes_per_s: float  # master -> participant
    up_bytes_per_s: float  # participant -> master
    rtt_s: float  # an empty round trip

    def __post_init__(self) -> None:
        if self.down_bytes_per_s <= 0 or self.up_bytes_per_s <= 0 or self.rtt_s < 0:
            raise ValueError("link rates must be positive and the round trip >= 0")


@dataclass(frozen=True)
class LayerTraffic:
    """Bytes of one layer for the whole batch on the wire: its input and its pooled output."""

    input_bytes: int  # x (B, C, H, W)
    output_bytes: int  # y (B, K, H', W') for all K kernels
    kernels: int
    need_dx: bool  # False for the first layer: no input gradient travels back


def compute_seconds(layers: Sequence[Sequence[ParticipantCost]]) -> float:
    """Conv compute of one step: per layer the slowest participant, summed over layers."""
    return sum(max((p.seconds() for p in layer), default=0.0) for layer in layers)


def star_step_seconds(layers: Sequence[Sequence[ParticipantCost]], dense_s: float,
                      master_link_bytes: float, link_bytes_per_s: float) -> float:
    """A coarse bound: compute, dense and the master link's bytes, nothing overlapping."""
    if link_bytes_per_s <= 0:
        raise ValueError("link_bytes_per_s must be positive")
    return dense_s + compute_seconds(layers) + master_link_bytes / link_bytes_per_s


def _phase_seconds(compute_s: Sequence[float], links: Sequence[Link | None],
                   send_bytes: Sequence[float], reply_bytes: Sequence[float]) -> float:
    """One layer phase of the star: serial sends, parallel compute, serial replies."""
    outgoing_free = 0.0
    ready: list[tuple[float, float]] = []  # (result ready at, seconds on the incoming link)
    for seconds, link, sent, reply in zip(compute_s, links, send_bytes, reply_bytes):
        if link is None:  # the master's own shard: no transfer
            ready.append((seconds, 0.0))
            continue
        outgoing_free += sent / link.down_bytes_per_s
        arrived = outgoing_free + link.rtt_s / 2
        ready.append((arrived + seconds + link.rtt_s / 2, reply / link.up_bytes_per_s))
    incoming_free = 0.0
    for at, transfer in sorted(ready):
        incoming_free = max(incoming_free, at) + transfer
    return incoming_free


def star_layer_seconds(costs: Sequence[ParticipantCost], links: Sequence[Link | None],
                       traffic: LayerTraffic) -> float:
    """Forward + backward seconds of one layer on the star plane (participants with
    0 kernels take no part)."""
    active = [(c, link) for c, link in zip(costs, links) if c.kernels > 0]
    if not active:
        return 0.0
    per_kernel_out = traffic.output_bytes / traffic.kernels
    forward = [FORWARD_FRACTION * c.seconds() for c, _ in active]
    backward = [(1 - FORWARD_FRACTION) * c.seconds() for c, _ in active]
    lk = [link for _, link in active]
    slices = [c.kernels * per_kernel_out for c, _ in active]
    x = [float(traffic.input_bytes)] * len(active)
    dx = x if traffic.need_dx else [0.0] * len(active)
    return _phase_seconds(forward, lk, x, slices) + _phase_seconds(backward, lk, slices, dx)


def predict_star_step(layers: Sequence[Sequence[ParticipantCost]], links: Sequence[Link | None],
                      traffic: Sequence[LayerTraffic], dense_s: float = 0.0) -> float:
    """Predicted step seconds of a plan on the star plane: every layer, plus the dense part.

    ``layers[l][p]`` is participant ``p``'s cost in layer ``l``; ``links[p]`` its link
    (None for the master's own device).
    """
    return dense_s + sum(star_layer_seconds(costs, links, t)
                         for costs, t in zip(layers, traffic))


def ideal_speedup(machine_speeds: Sequence[float]) -> float:
    """Sum of the machines' speeds over the fastest one's: the most N machines can give."""
    if not machine_speeds or min(machine_speeds) <= 0:
        raise ValueError("machine speeds must be positive")
    return sum(machine_speeds) / max(machine_speeds)


def _exchange_seconds(sent: Sequence[float], received: Sequence[float],
                      links: Sequence[Link]) -> float:
    """Participants exchanging at once over their own links (a switch): the slowest link,
    each full duplex (its sending and receiving overlap)."""
    return max((max(s / link.up_bytes_per_s, r / link.down_bytes_per_s)
                for s, r, link in zip(sent, received, links)), default=0.0)


def predict_peer_step(layers: Sequence[Sequence[ParticipantCost]],
                      links: Sequence[Link | None], traffic: Sequence[LayerTraffic],
                      dense_s: float = 0.0) -> float:
    """Predicted step seconds on the peer plane (worker to worker exchanges on a switch).

    Per layer and phase: the slowest participant's compute, then the exchange on every
    participant's own link at once (all-gather of outputs forward, reduce-scatter of
    input gradients backward), plus the master's request round trip. Layer 0's input
    crosses the master's link once (to the relay, which passes it on); the last
    layer's output and its gradient cross it once each. The master's own device, when
    it computes, exchanges over the master's link, taken to be as fast as the fastest
    worker link (its rate is not probed).
    """
    workers = [link for link in links if link is not None]
    if not workers:
        return dense_s + compute_seconds(layers)
    fastest = max(workers, key=lambda link: link.down_bytes_per_s + link.up_bytes_per_s)
    own = [link if link is not None else fastest for link in links]
    rtt = max(link.rtt_s for link in workers)
    total = dense_s
    last = len(traffic) - 1
    for index, (costs, t) in enumerate(zip(layers, traffic)):
        holders = [i for i, c in enumerate(costs) if c.kernels > 0]
        if not holders:
            continue
        share = {i: costs[i].kernels / t.kernels for i in holders}
        compute = max(costs[i].seconds() for i in holders)
        total += compute + 2 * rtt
        if index == 0:  # the input, once to the relay, which passes it on
            remote = [i for i in holders if links[i] is not None]
            if remote:
                relay = own[remote[0]]
                total += t.input_bytes / relay.down_bytes_per_s
                total += (len(remote) - 1) * t.input_bytes / relay.up_bytes_per_s
        if index == last:  # output slices to the master and gradient slices back
            total += sum(share[i] * t.output_bytes / own[i].up_bytes_per_s
                         + share[i] * t.output_bytes / own[i].down_bytes_per_s
                         for i in holders if links[i] is not None)
        else:  # all-gather of the outputs among the next layer's holders
            following = [i for i, c in enumerate(layers[index + 1]) if c.kernels > 0]
            sent = [share[i] * t.output_bytes * len([j for j in following if j != i])
                    if i in share else 0.0 for i in range(len(costs))]
            received = [(1 - share.get(i, 0.0)) * t.output_bytes if i in following else 0.0
                        for i in range(len(costs))]
            total += _exchange_seconds(sent, received, own)
        if t.need_dx and index > 0:  # reduce-scatter of the input gradient
            previous = layers[index - 1]
            channels = traffic[index - 1].kernels
            part = {i: previous[i].kernels / channels for i in range(len(costs))}
            sent = [t.input_bytes * (1 - part[i]) if i in share else 0.0
                    for i in range(len(costs))]
            received = [t.input_bytes * part[i] * len([j for j in holders if j != i])
                        for i in range(len(costs))]
            total += _exchange_seconds(sent, received, own)
    return total
