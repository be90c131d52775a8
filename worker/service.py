"""What a worker computes: request message in, reply message out (no sockets).

The service keeps the kernel shards assigned to this worker between batches
(weight-stationary), runs the calibration benchmark, the whole-block forward and
backward (with the optimizer update) and hands shards back for snapshots. Every
failure becomes an :class:`ErrorReply`, so one bad request never stops the worker.
With the peer data plane (``AssignPeers``) it runs its side of the exchange through
a :class:`~hetconv.participant.kernels.exchange.PeerParticipant` over the ``data_plane`` it was given
(the sockets are the daemon's; the service only calls the port). Tests make a worker
slow or wrong through a :class:`FaultInjector` given to the constructor.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from hetconv.backend import array_module_for, on_device
from hetconv.config import MASTER_PARTICIPANT
from hetconv.config import WIRE_DTYPES as WIRE_DTYPE_CHOICES
from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.names import STATE_NAMES
from hetconv.ops.conv_layer import POOLS
from hetconv.participant.calibration import time_block
from hetconv.participant.kernels.exchange import PeerParticipant
from hetconv.participant.peer_plan import PeerPlan
from hetconv.participant.ports import PeerLost, PiecePort
from hetconv.participant.progress import ComputeProgress
from hetconv.participant.samples.dense_replica import DenseReplica, dense_refusal, replica_from
from hetconv.participant.samples.runner import SampleRequestError, SampleRunner
from hetconv.participant.samples.weight_reduce import GradientExchange
from hetconv.participant.wire_cast import to_wire
from hetconv.planning.memory import USABLE, available_bytes, calibration_bytes, gib
from hetconv.protocol import (
    ERR_BAD_PEER_DATA,
    ERR_BAD_REQUEST,
    ERR_INTERNAL,
    ERR_PEER_LOST,
    ERR_UNKNOWN_LAYER,
    Ack,
    AssignDense,
    AssignPeers,
    AssignShard,
    BackwardReply,
    BackwardRequest,
    CalibrateReply,
    CalibrateRequest,
    EndRun,
    ErrorReply,
    ForwardReply,
    ForwardRequest,
    Message,
    PeerBackwardReply,
    PeerBackwardRequest,
    PeerForwardReply,
    PeerForwardRequest,
    SnapshotReply,
    SnapshotRequest,
    peer_error_message,
)
from hetconv.protocol.samples import SAMPLE_REQUESTS, SampleRequest
from hetconv.worker.validation import (
    ACTIVATION_DTYPES,
    calibrate_refusal,
    conv_size_refusal,
)

log = logging.getLogger(__name__)

class FaultInjector(Protocol):
    """How a test makes a worker misbehave (``tests/support/faulty_worker.py``): it
    builds the worker's shards and hears the step of every forward request before it is
    served. A real worker has none: its shards are plain :class:`ConvShard`."""

    def make_shard(self, layer: int, kernel_start: int, kernel_stop: int,
                   settings: LayerSettings, state: dict[str, Any], *,
                   device: str) -> ConvShard: ...

    def at_step(self, step: int, shards: Mapping[int, ConvShard]) -> None: ...


ENDS_EXCHANGES = (AssignShard, AssignPeers, AssignDense, SnapshotRequest, EndRun)
"""Requests after which no piece of an earlier exchange is worth waiting for."""


class RequestError(Exception):
    """A request this worker cannot serve; becomes an ErrorReply with ``code``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _check_wire_dtype(array: np.ndarray, name: str) -> None:
    if array.dtype not in ACTIVATION_DTYPES:
        raise RequestError(ERR_BAD_REQUEST, f"{name} must be float32 or float16, got {array.dtype}")


class DataPlane(Protocol):
    """The daemon's data endpoint, as the service sees it (hetconv.participant.peer_sockets)."""

    def open(self, me: str, peers: dict[str, str], peer_keys: dict[str, str],
             timeout_s: float) -> PiecePort: ...

    def reset(self) -> None: ...

    def drain(self) -> int: ...


class WorkerService:
    """Serves compute requests for one device (``cpu`` or ``gpu:N``)."""

    def __init__(self, device: str = "cpu", data_plane: DataPlane | None = None,
                 faults: FaultInjector | None = None):
        self.device = device
        array_module_for(device)  # a clear error for a bad or unavailable device
        self.shards: dict[int, ConvShard] = {}
        self.need_dx: dict[int, bool] = {}
        self.last_step: dict[int, int] = {}  # last step whose update each layer applied
        self.data_plane = data_plane
        self.peer: PeerParticipant | None = None  # set by AssignPeers
        self.sample = SampleRunner()  # the sample split's state between rounds
        # set (by the daemon's main thread) when a request arrives that ends the current
        # exchange (a new assignment, a snapshot, the end of the run): a wait for peers
        # stops at once instead of at its deadline
        self.cancel_wait = threading.Event()
        self.faults = faults  # tests only (FaultInjector); None in every real worker
        # the compute thread's marks, read by the heartbeats (hetconv/participant/progress.py)
        self.progress = ComputeProgress()

    def handle(self, message: Message) -> Message:
        """The reply to ``message``; never raises."""
        request_id = int(getattr(message, "request_id", 0))
        if isinstance(message, ENDS_EXCHANGES):
            self.cancel_wait.clear()
        self.progress.started()
        try:
            with on_device(self.device):
                return self._dispatch(message)
        except RequestError as error:
            return ErrorReply(request_id=request_id, code=error.code, message=str(error))
        except PeerLost as error:
            text = str(error) if not error.peers else peer_error_message(error.peers[0],
                                                                         str(error))
            return ErrorReply(request_id=request_id,
                              code=ERR_BAD_PEER_DATA if error.bad_data else ERR_PEER_LOST,
                              message=text)
        except (ValueError, TypeError, IndexError) as error:
            return ErrorReply(request_id=request_id, code=ERR_BAD_REQUEST,
                              message=f"{type(message).__name__}: {error}")
        except Exception as error:  # keep serving whatever happens
            log.exception("internal error serving %s", type(message).__name__)
            return ErrorReply(request_id=request_id, code=ERR_INTERNAL,
                              message=f"{type(error).__name__}: {error}")
        finally:
            self.progress.finished()

    def _dispatch(self, message: Message) -> Message:
        if isinstance(message, SAMPLE_REQUESTS):
            return self._sample_call(message)
        match message:
            case ForwardRequest():
                return self._forward(message)
            case BackwardRequest():
                return self._backward(message)
            case CalibrateRequest():
                return self._calibrate(message)
            case AssignShard():
                return self._assign(message)
            case SnapshotRequest():
                return self._snapshot(message)
            case AssignPeers():
                return self._assign_peers(message)
            case AssignDense():
                reason = dense_refusal(message)
                if reason is not None:
                    raise RequestError(ERR_BAD_REQUEST, reason)
                self.sample.layers.dense = replica_from(message)
                return Ack(request_id=message.request_id)
            case PeerForwardRequest():
                return self._peer_forward(message)
            case PeerBackwardRequest():
                return self._peer_backward(message)
            case EndRun():
                self.sample.layers.reset()
                self.sample.layers.exchange = None
                self.shards.clear()
                self.need_dx.clear()
                self.last_step.clear()
                self.peer = None
                if self.data_plane is not None:
                    self.data_plane.reset()
                return Ack(request_id=message.request_id)
        raise RequestError(ERR_BAD_REQUEST, f"a worker does not serve {type(message).__name__}")

    def _sample_call(self, request: SampleRequest) -> Message:
        """A sample-split request (hetconv/participant/samples/runner.py) over the shards
        held."""
        self._at_step(max(request.step, 0))
        try:
            return self.sample.serve(request, self.shards)
        except SampleRequestError as error:
            raise RequestError(error.code, str(error)) from None

    def _shard(self, layer: int) -> ConvShard:
        shard = self.shards.get(layer)
        if shard is None:
            raise RequestError(ERR_UNKNOWN_LAYER, f"no shard assigned for layer {layer}")
        return shard

    def drain_idle_data_plane(self) -> int:
        """Outside a run (no AssignPeers in force), release what waits on the data
        endpoint: nothing should, and a stranger's bytes must not stay in memory. How
        many messages were released."""
        if self.peer is None and self.data_plane is not None:
            return self.data_plane.drain()
        return 0

    def _calibrate(self, request: CalibrateRequest) -> CalibrateReply:
        reason = calibrate_refusal(request)  # sizes bounded as a training step's
        if reason is not None:
            raise RequestError(ERR_BAD_REQUEST, reason)
        need = calibration_bytes(request)
        available = available_bytes()
        if need > USABLE * available:  # a layer this machine cannot hold: refuse, not swell
            raise RequestError(ERR_BAD_REQUEST, f"layer {request.layer}: timing it needs about "
                               f"{gib(need)}; this worker has {gib(available)} available")
        seconds = time_block(request.batch, request.in_channels, request.height, request.width,
                             request.kernels, request.kernel_size, padding=request.padding,
                             stride=request.stride, repeats=request.repeats,
                             device=self.device, pool=request.pool,
                             batch_norm=request.batch_norm)
        return CalibrateReply(request_id=request.request_id, layer=request.layer, seconds=seconds)

    def _assign(self, request: AssignShard) -> Ack:
        if request.pool not in POOLS:
            raise RequestError(ERR_BAD_REQUEST, f"pool must be one of {POOLS}")
        settings = LayerSettings(stride=request.stride, padding=request.padding,
                                 bn_momentum=request.bn_momentum, bn_eps=request.bn_eps,
                                 momentum=request.momentum, weight_decay=request.weight_decay,
                                 pool=request.pool, batch_norm=request.batch_norm,
                                 relu=request.relu, input_from=request.input_from,
                                 shortcut_from=request.shortcut_from)
        if not request.relu and request.pool != "none":
            raise RequestError(ERR_BAD_REQUEST, "a layer without its ReLU has no pool")
        for name in ("input_from", "shortcut_from"):
            if not -1 <= getattr(request, name) <= request.layer:
                raise RequestError(ERR_BAD_REQUEST, f"{name} must be -1 or an activation "
                                   f"0..{request.layer} (one before layer {request.layer})")
        state = {name: getattr(request, name) for name in STATE_NAMES}
        if request.weight.ndim != 4:
            raise RequestError(ERR_BAD_REQUEST, "weight must be (K, C, k, k)")
        self.last_step.pop(request.layer, None)
        if request.kernel_stop == request.kernel_start:  # a re-split took the layer away
            self.shards.pop(request.layer, None)
            self.need_dx.pop(request.layer, None)
            return Ack(request_id=request.request_id)
        make_shard: Callable[..., ConvShard] = (
            ConvShard if self.faults is None else self.faults.make_shard)
        shard = make_shard(request.layer, request.kernel_start, request.kernel_stop, settings,
                           state, device=self.device)
        self.shards[request.layer] = shard
        self.need_dx[request.layer] = request.need_dx
        return Ack(request_id=request.request_id)

    @staticmethod
    def _check_sizes(shard: ConvShard, x: np.ndarray) -> None:
        """Refuse an input whose padded copy or output would not fit in a frame."""
        settings = shard.settings
        batch, channels, height, width = x.shape
        reason = conv_size_refusal(batch, channels, height, width, shard.kernels,
                                   shard.state["weight"].shape[2], settings.stride,
                                   settings.padding, settings.pool, x.dtype.itemsize)
        if reason is not None:
            raise RequestError(ERR_BAD_REQUEST, f"layer {shard.layer}: {reason}")

    def _at_step(self, step: int) -> None:
        """Tell the fault injector (tests only) the step about to be served."""
        if self.faults is not None:
            self.faults.at_step(step, self.shards)

    def _forward(self, request: ForwardRequest) -> ForwardReply:
        self._at_step(request.step)
        dense = self.sample.layers.dense
        if dense is not None and request.layer == dense.layer and not request.train:
            return self._dense_audit(request, dense)
        shard = self._shard(request.layer)
        x = request.x
        _check_wire_dtype(x, "x")
        if x.ndim != 4 or x.shape[1] != shard.state["weight"].shape[1]:
            raise RequestError(ERR_BAD_REQUEST, f"layer {request.layer}: input of shape "
                               f"{tuple(x.shape)} does not match the shard's weights")
        self._check_sizes(shard, x)
        start = time.perf_counter()
        y = shard.forward_host(x, request.train)  # host copies included, as in calibration
        compute_s = time.perf_counter() - start
        return ForwardReply(request_id=request.request_id, step=request.step,
                            layer=request.layer, attempt=request.attempt, compute_s=compute_s,
                            y=to_wire(y, x.dtype))

    @staticmethod
    def _dense_audit(request: ForwardRequest, dense: DenseReplica) -> ForwardReply:
        """The replicated dense part's evaluation-mode logits (the result audit)."""
        _check_wire_dtype(request.x, "x")
        problem = dense.part.input_problem(int(np.prod(request.x.shape[1:]))) \
            if request.x.ndim >= 2 else "x must be (N, ...)"
        if problem is not None:
            raise RequestError(ERR_BAD_REQUEST, f"{problem}: x of shape "
                               f"{tuple(request.x.shape)}")
        start = time.perf_counter()
        logits = dense.evaluate(request.x)
        return ForwardReply(request_id=request.request_id, step=request.step,
                            layer=request.layer, attempt=request.attempt,
                            compute_s=time.perf_counter() - start,
                            y=to_wire(logits, request.x.dtype))

    def _backward(self, request: BackwardRequest) -> BackwardReply:
        shard = self._shard(request.layer)
        last = self.last_step.get(request.layer)
        if last is not None and request.step <= last:
            raise RequestError(ERR_BAD_REQUEST, f"layer {request.layer}: step {request.step} was "
                               f"already applied (last {last}); a duplicate update is refused")
        need_dx = self.need_dx.get(request.layer, True)
        start = time.perf_counter()
        _check_wire_dtype(request.dy, "dy")
        if request.dy.ndim != 4 or request.dy.shape[1] != shard.kernels:
            raise RequestError(ERR_BAD_REQUEST, f"layer {request.layer}: dy of shape "
                               f"{tuple(request.dy.shape)} does not match the shard's "
                               f"{shard.kernels} kernels")
        wire = request.dy.dtype  # answer in the dtype the master chose for the wire
        dx = shard.backward_host(request.dy, need_dx, request.learning_rate)
        self.last_step[request.layer] = request.step
        compute_s = time.perf_counter() - start
        return BackwardReply(request_id=request.request_id, step=request.step,
                             layer=request.layer, attempt=request.attempt, compute_s=compute_s,
                             dx=None if dx is None else to_wire(dx, wire))

    def _snapshot(self, request: SnapshotRequest) -> SnapshotReply:
        shard = self._shard(request.layer)
        state = shard.snapshot()
        return SnapshotReply(request_id=request.request_id, layer=request.layer,
                             kernel_start=shard.kernel_start, kernel_stop=shard.kernel_stop,
                             **state)

    # --- the peer data plane ---------------------------------------------------------
    def _assign_peers(self, request: AssignPeers) -> Ack:
        if self.data_plane is None:
            raise RequestError(ERR_BAD_REQUEST, "this worker has no data endpoint")
        if request.wire_dtype not in WIRE_DTYPE_CHOICES:
            raise RequestError(ERR_BAD_REQUEST, f"wire dtype {request.wire_dtype!r}")
        plan = PeerPlan.from_wire(request.plan)
        peers = {str(k): str(v) for k, v in request.peers.items()}
        keys = {str(k): str(v) for k, v in request.peer_keys.items()}
        dense = self.sample.layers.dense
        for layer in range(plan.last_layer + 1):
            if dense is not None and layer == dense.layer:
                continue
            if plan.holds(layer, request.participant) and layer not in self.shards:
                raise RequestError(ERR_UNKNOWN_LAYER, f"the plan gives this worker kernels of "
                                   f"layer {layer}, but no shard was assigned")
        self.peer = None  # until every peer's data port answered (else PeerLost, one line)
        port = self.data_plane.open(request.participant, peers, keys, request.timeout_s)
        self.peer = PeerParticipant(request.participant, plan, self.shards, port,
                                    request.wire_dtype, request.timeout_s,
                                    cancelled=self.cancel_wait.is_set,
                                    on_drop=lambda reason: log.debug("dropped %s", reason),
                                    progress=self.progress)
        # the sample split reduces weight gradients over the same port and plan
        self.sample.layers.exchange = GradientExchange(request.participant, plan, port,
                                                request.timeout_s,
                                                cancelled=self.cancel_wait.is_set,
                                                progress=self.progress)
        return Ack(request_id=request.request_id)

    def _peer_participant(self) -> PeerParticipant:
        if self.peer is None:
            raise RequestError(ERR_BAD_REQUEST, "no AssignPeers for this run yet")
        return self.peer

    def _peer_forward(self, request: PeerForwardRequest) -> PeerForwardReply:
        self._at_step(request.step)
        peer = self._peer_participant()
        self._shard(request.layer)
        if request.x is not None:
            _check_wire_dtype(request.x, "x")
        y, stats = peer.forward(request.pass_id, request.step, request.layer, request.train,
                                request.x)
        sent, received = stats.bytes_with(lambda who: who != MASTER_PARTICIPANT)
        return PeerForwardReply(
            request_id=request.request_id, step=request.step, layer=request.layer,
            attempt=request.attempt, compute_s=stats.compute_s, peer_wait_s=stats.wait_s,
            peer_bytes_sent=sent, peer_bytes_received=received,
            y=None if y is None else to_wire(y, peer.wire_dtype))

    def _peer_backward(self, request: PeerBackwardRequest) -> PeerBackwardReply:
        peer = self._peer_participant()
        self._shard(request.layer)
        last = self.last_step.get(request.layer)
        if last is not None and request.step <= last:
            raise RequestError(ERR_BAD_REQUEST, f"layer {request.layer}: step {request.step} was "
                               f"already applied (last {last}); a duplicate update is refused")
        if request.dy is not None:
            _check_wire_dtype(request.dy, "dy")
        stats = peer.backward(request.pass_id, request.step, request.layer,
                              request.learning_rate, request.dy)
        self.last_step[request.layer] = request.step
        sent, received = stats.bytes_with(lambda who: who != MASTER_PARTICIPANT)
        return PeerBackwardReply(
            request_id=request.request_id, step=request.step, layer=request.layer,
            attempt=request.attempt, compute_s=stats.compute_s, peer_wait_s=stats.wait_s,
            peer_bytes_sent=sent, peer_bytes_received=received)
