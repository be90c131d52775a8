"""Planning the sample split: whether to split by samples, and who gets which samples.

Pure functions and one small sans-IO class; the socket side is
``master/samples/stage.py``, the design docs/sample-split.md.

- :func:`choose_split_by`: ``--split-by auto`` picks samples when every conv layer can
  be split by samples and moves fewer bytes that way: per layer and step the kernel
  split moves activations (∝ B·H·W per input channel) and the sample split the weight
  gradient (∝ K·k² per input channel), so samples win where K·k² < B·H·W on every
  layer (the chain is all-sample or all-kernel: a switch between them would move the
  activations anyway).
- :func:`model_split_by`: under ``--split model`` the predicted steps of the two splits
  decide instead (the rule weighs bytes layer by layer, not what they cost on the
  step's path: a wide late layer's weight gradient is reduced beside the compute).
- :func:`sample_slices`: consecutive samples per participant, in proportion to its
  speed (equation 1 of the paper applied to samples: n_i ∝ 1/t_i), whole samples by
  largest remainder.
- :func:`choose_link_wires`: ``--wire-dtype auto`` under the sample split, per worker's
  link: float16 for what the master sends and receives per sample (x, and y and dy
  with the dense part on the master) on the slowest links, where the model predicts a
  step at least WIRE_FLOAT16_GAIN shorter with it; the weight gradients are reduced in
  float32 either way.
- the slices' re-weighting from measured compute: ``master/samples/balance.py``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hetconv.config import WIRE_FLOAT16_GAIN
from hetconv.model import ConvLayerShape
from hetconv.participant.samples.reduction_plan import bucket_sizes
from hetconv.participant.samples.replica import sample_splittable
from hetconv.planning.perf_model import Link

SPLIT_BY = ("auto", "kernels", "samples")
"""``--split-by`` choices; the first is the default."""

def samples_refusal(shapes: Sequence[ConvLayerShape], kernel_sizes: Sequence[int],
                    strides: Sequence[int], paddings: Sequence[int], pools: Sequence[str]
                    ) -> str | None:
    """Why these layers cannot be split by samples (one line), or None."""
    for shape, k, s, p, pool in zip(shapes, kernel_sizes, strides, paddings, pools):
        if not sample_splittable(pool, shape.height, shape.width, k, s, p):
            return (f"conv layer {shape.index + 1} cannot be split by samples (a 2x2 pool of "
                    "an odd map); use --split-by kernels")
    return None


def choose_split_by(requested: str, shapes: Sequence[ConvLayerShape], batch: int,
                    kernel_sizes: Sequence[int], refusal: str | None) -> tuple[str, str]:
    """(``"samples"`` or ``"kernels"``, why) for ``--split-by requested``."""
    if requested == "kernels":
        return "kernels", "--split-by kernels"
    if requested == "samples":
        if refusal is not None:
            raise ValueError(refusal)
        return "samples", "--split-by samples"
    if refusal is not None:
        return "kernels", refusal.split(";")[0]
    for shape, k in zip(shapes, kernel_sizes):
        if shape.kernels * k * k >= batch * shape.height * shape.width:
            return "kernels", (f"layer {shape.index + 1} moves fewer bytes split by kernels "
                               f"(K*k^2 = {shape.kernels * k * k} >= B*H*W = "
                               f"{batch * shape.height * shape.width})")
    return "samples", "every layer moves fewer bytes split by samples (K*k^2 < B*H*W)"


def model_split_by(rule: str, rule_why: str, samples_s: float, kernels_s: float,
                   band: float = 0.0) -> tuple[str, str]:
    """``--split-by auto`` with a model (``--split model``): (``"samples"`` or
    ``"kernels"``, why) from the predicted seconds of a step split by samples and of
    the kernel planner's best plan, the shorter where it is shorter by more than
    ``band`` (the calibration model's stated error); otherwise the byte rule's choice
    stands (``rule``, ``rule_why``: :func:`choose_split_by`). The rule alone looks at
    one layer at a time and cannot weigh that the sample split moves weight gradients
    beside the compute while the kernel split moves every layer's activations on the
    step's path; but two calibration predictions within the band cannot overrule it:
    the demo's two workers on one machine took the kernel split on 50.6 ms predicted
    against 56.1 by samples and ran 85 ms a step, where the sample split runs 44."""
    choice = "samples" if samples_s < kernels_s else "kernels"
    figures = (f"predicted {samples_s * 1e3:.1f} ms per step split by samples, "
               f"{kernels_s * 1e3:.1f} ms by kernels")
    if samples_s == kernels_s or max(samples_s, kernels_s) <= (1 + band) * min(
            samples_s, kernels_s) and choice != rule:
        if band <= 0 or samples_s == kernels_s:
            return rule, rule_why
        return rule, (f"{rule_why}; {figures}: within the calibration model's {band:.0%} "
                      "error of each other, the byte rule decides")
    why = figures
    if choice != rule:
        why += f"; the byte rule alone would take {rule}: {rule_why}"
    return choice, why


@dataclass(frozen=True)
class Slice:
    """Samples [start, stop) of a batch on one participant."""

    participant: str
    start: int
    stop: int

    @property
    def samples(self) -> int:
        return self.stop - self.start


def sample_slices(names: Sequence[str], seconds_per_sample: Sequence[float], batch: int
                  ) -> list[Slice]:
    """Consecutive slices of ``batch`` samples in participant order, n_i ∝ 1/t_i (whole
    samples, largest remainder; ties to the earlier participant). Empty slices kept."""
    if not names:
        raise ValueError("no participants to split the batch over")
    speeds = [1.0 / max(t, 1e-12) for t in seconds_per_sample]
    total = sum(speeds)
    exact = [batch * s / total for s in speeds]
    counts = [int(e) for e in exact]
    order = sorted(range(len(names)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:batch - sum(counts)]:
        counts[i] += 1
    out, start = [], 0
    for name, n in zip(names, counts):
        out.append(Slice(name, start, start + n))
        start += n
    return out


def sample_rounds(layers: int) -> int:
    """Round trips of one training step: L + 1 forward (one starting each layer, one
    returning the output) and L + 1 backward (one starting the last layer, L - 1 that
    finish a layer and start the one below, one finishing layer 0). The step's last
    update travels with the next step's first round, so it costs none of its own.
    (A traced step of 32:64 showed 6 rounds for L = 2; this said 2L + 1 until then.)"""
    return 2 * layers + 2


def conv_weights(shapes: Sequence[ConvLayerShape]) -> int:
    """Weight values of the conv chain (each layer's K·C·k²): what the reduction moves."""
    return sum(s.weight_values for s in shapes)


def sample_bytes(shapes: Sequence[ConvLayerShape], wire_itemsize: int) -> tuple[int, int]:
    """Bytes per sample on the wire: the chain's input x and its output y (dy alike)."""
    first, last = shapes[0], shapes[-1]
    return (first.in_channels * first.height * first.width * wire_itemsize,
            last.kernels * last.pooled_height * last.pooled_width * wire_itemsize)


def chain_hops(layers: int, slice_statistics: bool = False, step_chain: bool = False) -> float:
    """Round trips of one step as two chains (``--data-plane peer``): one per chain
    through the master, plus each layer's batch-norm barrier in each chain, a one-way
    hop between peers (half a round trip); none under ``--bn-statistics slice``, whose
    pieces are collected once, at each chain's end. ``step_chain`` (the dense part
    replicated): one request a step, so one round trip through the master."""
    return (1.0 if step_chain else 2.0) + (0.0 if slice_statistics else 2 * layers * 0.5)


def predict_sample_step(slices: Sequence[Slice], seconds_per_sample: dict[str, float],
                        links: dict[str, Link | None], shapes: Sequence[ConvLayerShape],
                        weights: int, wire_itemsize: int, reduce: str = "master",
                        slice_statistics: bool = False, dense_values: int = 0,
                        link_itemsizes: Mapping[str, int] | None = None,
                        ahead: bool = False) -> float:
    """Predicted seconds of one step's conv part under the sample split: the slowest
    slice's compute, plus the transfers (the master's link, each direction at the
    fastest measured worker link rate: the master's own port; or a worker's own link
    where its slice takes longer on it), plus the round trips at the slowest worker's
    rtt: ``sample_rounds`` under the rounds (``reduce`` "master"), the two chains'
    ``chain_hops`` with the weight gradients reduced among the peers.

    Bytes per worker with samples: its x slice and dy slice down, its y slice up, in
    ``wire_itemsize`` bytes a value, or ``link_itemsizes[worker]`` where given (the wire
    dtype chosen per link: ``choose_link_wires``). The weight gradients (``weights``
    float32 values): with ``reduce`` "master" (``--data-plane star``) each worker's goes
    up and the sum comes down to every worker, on the master's link; with "peer"
    (hetconv/participant/samples/weight_reduce.py) every participant's link carries 2·(P-1)/P of them each
    way (the bucket's first layers (P-1) of theirs: sent whole to every peer), at the
    slowest link's rate, waited for where they take longer than the compute
    (``reduction_wait``), plus one more round trip (the reduce-scatter, then the
    all-gather).

    ``dense_values`` > 0 (the dense part replicated, its N values; peer reduction
    only): one step chain, no y or dy slice on the master's link, and the dense part's
    gradients reduced with the conv layers' (docs/dense-replica.md). ``ahead`` (with
    it: two steps in flight, the default) the next step's x slices travel while this
    step computes, so only the transfer beyond the compute is waited for (measured on
    the lab: float16 slices on 100 Mbit links, half the bytes, gave no shorter step,
    docs/sample-split.md "The wire")."""
    compute = max((seconds_per_sample[s.participant] * s.samples for s in slices), default=0.0)
    hub = reduce != "peer"
    replicated = dense_values > 0 and not hub
    gradient = 4 * (weights + (dense_values if replicated else 0))
    down = up = own = 0.0
    workers = [s for s in slices if links.get(s.participant) is not None]
    for piece in workers:
        itemsize = (link_itemsizes or {}).get(piece.participant, wire_itemsize)
        x_bytes, y_bytes = sample_bytes(shapes, itemsize)
        if replicated:
            y_bytes = 0
        piece_down = piece.samples * (x_bytes + y_bytes) + (gradient if hub else 0)
        piece_up = piece.samples * y_bytes + (gradient if hub and piece.samples else 0)
        down, up = down + piece_down, up + piece_up
        link = links[piece.participant]
        assert link is not None
        own = max(own, piece_down / link.down_bytes_per_s, piece_up / link.up_bytes_per_s)
    rates = [link for link in links.values() if link is not None]
    if not rates:
        return compute
    down_rate = max(link.down_bytes_per_s for link in rates)
    up_rate = max(link.up_bytes_per_s for link in rates)
    rtt = max(link.rtt_s for link in rates)
    trips = chain_hops(len(shapes), slice_statistics, replicated) if not hub \
        else sample_rounds(len(shapes))
    transfer = max(down / down_rate, up / up_rate, own)
    if ahead and replicated:
        transfer = max(0.0, transfer - compute)
    predicted = compute + transfer + trips * rtt
    if not hub and workers:
        participants = len(workers) + 1  # and the master, always in the reduction
        bucket = 4 * sum(bucket_sizes([s.weight_values for s in shapes]))
        per_link = (2 * (participants - 1) / participants * (gradient - bucket)
                    + (participants - 1) * bucket)
        slowest = min(min(link.down_bytes_per_s, link.up_bytes_per_s) for link in rates)
        predicted += reduction_wait(per_link / slowest, compute) + rtt
    return predicted


def reduction_wait(transfer_s: float, compute_s: float) -> float:
    """Seconds a step waits for the peers' weight reduction whose pieces take
    ``transfer_s`` on the slowest link: what the links cannot carry while the
    participants compute. Each layer's dW is scattered as its backward ends and its
    sum gathered before its next forward, the dense part's (replicated) before the conv
    backward and after the conv forward, so the pieces drain behind the step's compute
    (hetconv/participant/samples/weight_reduce.py; the VGG-style network's 5.2 MB a link at 1 Gbit, 42 ms,
    waited 2-3 ms more than the barriers did, figures/scale-dense-vgg.md)."""
    return max(0.0, transfer_s - compute_s)



def choose_dense_part(flag: str, on_master_s: float, replicated_s: float,
                      dense_batch_s: float, dense_slice_s: float) -> tuple[bool, float]:
    """Whether to replicate the dense part on the participants (``--dense-part``;
    docs/dense-replica.md) and the predicted conv + transfer seconds of the choice, as
    the kernel split's are counted (the dense part on the master for the whole batch
    left out, so the two compare): ``on_master_s`` and ``replicated_s`` are
    ``predict_sample_step`` without and with the dense part's values, ``dense_batch_s``
    and ``dense_slice_s`` the dense part timed on the whole batch and on the largest
    slice. ``auto`` replicates when the whole step is predicted shorter that way."""
    replicated = replicated_s + dense_slice_s - dense_batch_s
    replicate = flag == "replicas" or (flag == "auto" and replicated < on_master_s)
    return replicate, (replicated if replicate else on_master_s)


def slowest_links_first(links: Mapping[str, Link | None]) -> list[str]:
    """The workers with a measured link, the slowest first (by its slower direction;
    ties by name)."""
    rates = {name: min(link.down_bytes_per_s, link.up_bytes_per_s)
             for name, link in links.items() if link is not None}
    return sorted(rates, key=lambda name: (rates[name], name))


def link_wires_text(dtypes: Mapping[str, str]) -> str:
    """``float32 on every link``, ``float16 on the link of m3, float32 on the others``:
    the wire dtype of every worker's link in a few words (the console, the report)."""
    float16 = sorted(name for name, dtype in dtypes.items() if dtype == "float16")
    if not float16 or len(float16) == len(dtypes):
        return f"{'float16' if float16 else 'float32'} on every link"
    return (f"float16 on the link{'s' if len(float16) > 1 else ''} of {', '.join(float16)}, "
            "float32 on the others")


LINK_WIRE_TOLERANCE = 0.01
"""``choose_link_wires`` keeps float16 off a link whose float16 would shorten the
predicted step by less than this share (its casts are CPU for nothing)."""


@dataclass(frozen=True)
class LinkWires:
    """The wire dtype of every worker's link (``--wire-dtype auto`` under the sample
    split) and the predictions it was chosen from (seconds)."""

    dtypes: dict[str, str]  # worker -> "float32" | "float16"
    float32_s: float  # the step predicted with float32 on every link
    chosen_s: float  # with ``dtypes``

    @property
    def default(self) -> str:
        """The dtype of a link not in ``dtypes`` (a worker that joins later, unprobed):
        float16 only when every link is float16 (a uniformly slow LAN)."""
        return "float16" if self.dtypes and set(self.dtypes.values()) == {"float16"} \
            else "float32"


def choose_link_wires(predict: Callable[[Mapping[str, str]], float],
                      links: Mapping[str, Link | None]) -> LinkWires:
    """Float16 on the slowest links, where it pays: ``predict`` maps a dtype per worker
    to the predicted step (``predict_sample_step`` with ``link_itemsizes``). The
    candidates put float16 on the k slowest links (by their slower direction; k in
    0..W, ties by name), so that a link never gets float16 while a slower one keeps
    float32; the fewest float16 links within LINK_WIRE_TOLERANCE of the best candidate's
    step win, and only when that step is WIRE_FLOAT16_GAIN shorter than float32's
    everywhere (the casts' CPU is not in the model; the rule the kernel split's
    ``choose_wire_dtype`` applies to the whole run)."""
    order = slowest_links_first(links)
    candidates = [{name: "float16" if rank < k else "float32"
                   for rank, name in enumerate(order)} for k in range(len(order) + 1)]
    predicted = [predict(dtypes) for dtypes in candidates]
    best = min(predicted)
    k = next(i for i, step in enumerate(predicted) if step <= best * (1 + LINK_WIRE_TOLERANCE))
    if predicted[k] >= predicted[0] * (1 - WIRE_FLOAT16_GAIN):
        k = 0
    return LinkWires(candidates[k], predicted[0], predicted[k])


MEMBER_GAIN = 0.10
"""``choose_sample_members`` leaves workers out only for a predicted step this much
shorter without them (a prediction, not a measurement: a margin like the rebalancer's)."""


@dataclass(frozen=True)
class SampleMembers:
    """Who takes part in the sample split (``choose_sample_members``), and the
    predictions it was chosen from (seconds)."""

    left_out: tuple[str, ...]  # workers not used, slowest link first
    all_s: float  # the step predicted with every worker
    chosen_s: float  # without ``left_out``


def choose_sample_members(predict: Callable[[Sequence[str]], float],
                          links: Mapping[str, Link | None]) -> SampleMembers:
    """Leave out the workers whose links cost the step more than their compute saves:
    ``predict`` maps the workers left out to the predicted step (``predict_sample_step``
    over the rest: every worker's link carries its share of the weight reduction at the
    slowest link's rate, so one slow link slows every participant). The candidates
    leave out the k slowest links (by their slower direction; k in 0..W-1: one worker at
    least stays, the master alone is the fall-back's to try); the shortest prediction
    wins when it is MEMBER_GAIN shorter than with every worker."""
    order = slowest_links_first(links)
    candidates = [tuple(order[:k]) for k in range(max(1, len(order)))]
    predicted = [predict(left_out) for left_out in candidates]
    best = min(range(len(candidates)), key=lambda k: (predicted[k], k))
    if predicted[best] > predicted[0] * (1 - MEMBER_GAIN):
        best = 0
    return SampleMembers(candidates[best], predicted[0], predicted[best])
