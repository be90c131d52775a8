"""Named limits, deadlines and socket settings of the hetconv wire protocol.

Every bound the codec enforces on untrusted input and every deadline or socket
option the transport applies lives here, so that a reader can see the whole
resource envelope of a connection in one place and tests can refer to the same
names. Byte sizes are in bytes, times carry their unit in the name (``_MS`` for
milliseconds as ZeroMQ wants them, ``_S`` for seconds).
"""
from __future__ import annotations

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

# --- codec: sizes of one multipart message -------------------------------------------
MAX_HEADER_BYTES = 64 * KIB
"""Largest accepted msgpack header frame (frame 0)."""
MAX_FRAMES = 16
"""Largest number of frames in one message, header included."""
MAX_FRAME_BYTES = 1 * GIB
"""Largest accepted array frame."""
MAX_TOTAL_BYTES = 2 * GIB
"""Largest accepted sum of all frame lengths of one message."""

# --- codec: shapes of the msgpack header ------------------------------------------
MAX_NDIM = 8
"""Most dimensions an array may have on the wire."""
MAX_DIM = MAX_FRAME_BYTES
"""Largest single dimension (bounds shapes with a zero dimension, too)."""
MAX_ELEMENTS = MAX_FRAME_BYTES
"""Largest product of an array's dimensions, a zero dimension counted as 1: bounds the
shape itself, not only its byte count, so that a shape such as
``[0, 2**30, 2**30, 2**30]`` (0 bytes) is refused before numpy sees it."""
MAX_STR_LEN = 4 * KIB
"""Longest string anywhere in a header (error messages, names, device fields)."""
MAX_ARRAY_LEN = 256
"""Longest msgpack array anywhere in a header."""
MAX_MAP_LEN = 128
"""Most entries in any msgpack map of a header."""
MAX_NESTING_DEPTH = 6
"""Deepest nesting of lists/maps inside a dict-typed field (e.g. ``Hello.device``)."""

MAX_LINK_PROBE_BYTES = 64 * 1024 * 1024
"""Largest payload a ``LinkProbeRequest`` may ask the worker to send back."""

# --- transport: ZeroMQ socket options ---------------------------------------------
DEFAULT_LINGER_MS = 500
"""How long ``close()`` may wait to flush unsent messages; shutdown never hangs."""
DEFAULT_SNDHWM = 64
"""Send high-water mark in messages: a frozen peer cannot make us queue more."""
DEFAULT_RCVHWM = 0
"""Receive high-water mark in messages: 0, no limit, on purpose. libzmq 4.3 aborts the
process (``Assertion failed: !_io_error``, stream_engine_base.cpp) when a connection
whose receive queue reached its high-water mark (input stopped) is closed by the peer
and the engine then writes: a ZMTP heartbeat of ours, or the PONG to a PING the peer
left in its last bytes. Any peer can do that with a few thousand small messages and a
disconnect. Without a receive limit input never stops; the reader bounds what it
keeps instead (``MAX_MESSAGES_PER_POLL``, per-sender drops, ``MAXMSGSIZE``)."""
DEFAULT_SEND_TIMEOUT_MS = 10_000
"""SNDTIMEO: a send that cannot be queued within this raises ``SendTimeout``."""
MAX_RECV_TIMEOUT_S = 86_400.0
"""Longest wait ``recv_message`` accepts: a day is no deadline in practice, more is a bug."""
HEARTBEAT_IVL_MS = 1_000
"""ZMTP PING interval on every connection."""
HEARTBEAT_TIMEOUT_MS = 12_000
"""A connection with no traffic for this long after a PING is dropped. Longer than the
master's ``LINK_RETRY_S`` (10 s, ``hetconv.master.membership_types``) on purpose: behind
a cut link TCP retransmits with a growing back-off (0.2, 0.6, 1.4, 3.0, 6.2 s, ...), so
the first bytes after a 4 s cut arrive about 6 s after it began, and a connection closed
before then (by either side) would turn a short cut into a failover. A stopped worker
is found by the application's liveness check (``DEFAULT_HEARTBEAT_LIVENESS``, 5 s)
and a killed one by its closed connection, neither by this timeout
(docs/resilience.md, "Liveness bounds")."""
HEARTBEAT_TTL_MS = 12_000
"""TTL we ask the peer to apply to us (rounded by ZeroMQ to 100 ms): the peer drops the
connection after this long with nothing from us. Above ``LINK_RETRY_S`` for the same
reason as ``HEARTBEAT_TIMEOUT_MS``."""
HANDSHAKE_IVL_MS = 10_000
"""Longest ZMTP (and CURVE) handshake before the connection is dropped."""
RECONNECT_IVL_MS = 100
"""First reconnect delay of a worker's DEALER."""
RECONNECT_IVL_MAX_MS = 5_000
"""Exponential reconnect back-off stops growing at this delay."""
MAX_MSG_SIZE_BYTES = max(MAX_HEADER_BYTES, MAX_FRAME_BYTES)
"""ZMQ_MAXMSGSIZE, set on every socket (master ROUTER, worker DEALER, data-plane PULL
and PUSH). libzmq applies it to each frame (message part) as soon as the frame's size
arrives, before buffering it; it has no limit on the number of frames of one message.
The receiver drops frames past ``MAX_FRAMES`` as it reads them, and ``decode`` checks
the total against ``MAX_TOTAL_BYTES``."""

# --- receiving: what one reader does per poll, and per sender -----------------------
MAX_MESSAGES_PER_POLL = 64
"""Most messages the master's loop reads per pump: a flood waits in the queue (and is
dropped per sender, below) instead of holding the training thread."""
SENDER_WINDOW_S = 1.0
"""The window of the per-sender counters below."""
MAX_MESSAGES_PER_SENDER = 2000
"""Messages one sender may have decoded per window; past it the rest of the window's
messages from that sender are dropped undecoded (a worker sends a few per step and two
heartbeats a second: a run at 100 steps/s with 8 layers sends under this many)."""
MAX_MESSAGES_PER_JOINER = 200
"""The same for a worker that said Hello but is not in the run (yet): it heartbeats and
answers its calibration (one reply per layer and size, computed one after the other);
a heartbeat flood from it costs the training thread a read each past this, no decode."""
MAX_MESSAGES_PER_STRANGER = 20
"""The same for a sender that is not a known worker: it has a Hello to say, and little
else; a flood from a stranger costs a read each and no decode."""
MAX_ERROR_REPLIES_PER_SENDER = 1
"""Error replies (``ErrorReply``/``Refuse``) one sender gets per window, and warnings
logged about it; more bad messages are counted and summed up in the next line."""

# --- application level: handshake and liveness ------------------------------------
DEFAULT_HELLO_TIMEOUT_S = 10.0
"""How long a worker waits for ``Welcome``/``Refuse`` after sending ``Hello``."""
DEFAULT_HEARTBEAT_INTERVAL_S = 0.5
"""Interval of application ``Heartbeat`` messages (the master sends its value in
``Welcome.heartbeat_interval_s``)."""
DEFAULT_HEARTBEAT_LIVENESS = 10
"""Missed heartbeat intervals before the master declares a silent worker dead (Paranoid
Pirate): 10 x 0.5 s = 5 s. A killed worker is found sooner: its connection closes,
and the master's next heartbeat to it fails (``PeerUnreachable``), within one interval.
A worker whose TCP connection is retransmitting (a cut link, not a stopped process)
gets up to ``LINK_RETRY_S`` (10 s) instead (``hetconv.master.liveness``)."""
DEFAULT_PEER_TIMEOUT_S = 30.0
"""The longest a participant waits for a peer's piece (sent in ``AssignPeers``). Long
on purpose: a peer may compute a big layer for seconds before it sends, and a dead
peer is found by the master's liveness check, whose recovery ends every wait at once."""
MASTER_SILENCE_TIMEOUT_S = 30.0
"""A worker in a session drops its shards and says Hello again after this long
without any message from the master (a new master is noticed at once anyway: it
answers the worker's heartbeats with ``unknown_worker``)."""
DEFAULT_REQUEST_TIMEOUT_S = 900.0
"""Backstop deadline for one request/reply exchange (forward, backward, snapshot);
a dead or silent worker is caught much sooner by the heartbeat liveness check. Big
layers on slow CPUs (500:1500 at batch 1024) take minutes per phase."""

# --- security --------------------------------------------------------------------
ZAP_DOMAIN = "hetconv"
"""ZAP domain set on every CURVE listening socket, with domain enforcement on."""
