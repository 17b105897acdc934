"""The step channel: the leader's ordered command log to its followers (--nnodes > 1), over TCP.

The leader (rank 0) listens on the port after jax.distributed's coordinator port
(`--dist-init-addr HOST:PORT` -> PORT + 1, every interface); each follower connects, retrying
until a deadline, and says hello with its rank. A message is

    b"XLS1" | u32 header length | u64 payload length | JSON header | payload | HMAC-SHA256 tag

where the payload is the raw bytes of the header's arrays (name, dtype, shape; int32, uint32,
float32 and bool only) back to back, and the tag authenticates the direction, the message's
sequence number on its connection, and every byte before it, with a random secret the leader
puts into jax.distributed's key-value store (followers read it there). A receiver checks the
tag before it parses anything, so an unauthenticated peer can neither run a command nor feed
the JSON parser; nothing is ever unpickled. The secret is only as private as the coordinator's
key-value store, which has no authentication of its own: run multi-host jobs on a private
network, as JAX's own coordinator requires.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"XLS1"
_PREFIX = struct.Struct(">4sIQ")
_TAG_BYTES = 32
MAX_HEADER_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 28  # a step of 128K tokens or a 4 MiB grammar mask fits many times
DTYPES = {name: np.dtype(name) for name in ("int32", "uint32", "float32", "bool")}
TO_FOLLOWER, TO_LEADER = b"L", b"F"  # directions, in the tag: a message cannot be reflected
SECRET_KEY = "xlaserve/step_channel/secret"


class ChannelClosed(ConnectionError):
    """The peer closed the connection, or it broke."""


class ChannelError(RuntimeError):
    """A message that is not authentic or not well formed."""


def channel_port(dist_init_addr: str) -> tuple[str, int]:
    """(host, port) of the step channel for `--dist-init-addr HOST:PORT`: PORT + 1."""
    host, port = split_address(dist_init_addr)
    return host, port + 1


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def new_secret() -> bytes:
    return secrets.token_bytes(32)


class Connection:
    """One authenticated TCP connection. `send` and `receive` may run in different threads, but
    each in one thread at a time."""

    def __init__(self, sock: socket.socket, secret: bytes, outgoing: bytes, incoming: bytes):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
        self.sock = sock
        self._secret = secret
        self._outgoing, self._incoming = outgoing, incoming
        self._sent = self._received = 0

    def send(self, kind: str, meta: dict | None = None, **arrays: np.ndarray) -> None:
        message = encode(self._secret, self._outgoing, self._sent, kind, meta, arrays)
        self._sent += 1
        self.send_bytes(message)

    def send_bytes(self, message: bytes) -> None:
        try:
            self.sock.sendall(message)
        except OSError as error:
            raise ChannelClosed(f"sending failed: {error}") from error

    def receive(self) -> tuple[str, dict, dict[str, np.ndarray]]:
        """(kind, meta, arrays) of the next message; raises ChannelClosed at the end of the
        stream and ChannelError for a message that is not authentic or not well formed."""
        prefix = self._read(_PREFIX.size, at_start=True)
        magic, header_len, payload_len = _PREFIX.unpack(prefix)
        if magic != MAGIC or header_len > MAX_HEADER_BYTES or payload_len > MAX_PAYLOAD_BYTES:
            raise ChannelError("not a step channel message (bad magic or sizes)")
        header = self._read(header_len)
        payload = self._read(payload_len)
        tag = self._read(_TAG_BYTES)
        expected = _tag(self._secret, self._incoming, self._received, prefix, header, payload)
        if not hmac.compare_digest(tag, expected):
            raise ChannelError("a message failed authentication (wrong secret, or out of order)")
        self._received += 1
        return _decode(header, payload)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _read(self, n: int, at_start: bool = False) -> bytearray:
        buffer = bytearray(n)
        view = memoryview(buffer)
        got = 0
        while got < n:
            try:
                count = self.sock.recv_into(view[got:], n - got)
            except OSError as error:
                raise ChannelClosed(f"the connection broke: {error}") from error
            if count == 0:
                raise ChannelClosed("the peer closed the connection" if at_start and got == 0
                                    else "the connection closed in the middle of a message")
            got += count
        return buffer


def encode(secret: bytes, direction: bytes, seq: int, kind: str, meta: dict | None,
           arrays: dict[str, np.ndarray]) -> bytes:
    """Message number `seq` in `direction` (TO_FOLLOWER or TO_LEADER), as bytes: the leader
    encodes each command once for all its followers, whose connections count alike."""
    parts, described = [], []
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        if array.dtype.name not in DTYPES:
            raise TypeError(f"cannot send a {array.dtype} array ({name})")
        described.append([name, array.dtype.name, list(array.shape)])
        parts.append(array.tobytes())
    header = json.dumps({"kind": kind, "meta": meta or {}, "arrays": described},
                        separators=(",", ":")).encode()
    payload = b"".join(parts)
    prefix = _PREFIX.pack(MAGIC, len(header), len(payload))
    return b"".join((prefix, header, payload, _tag(secret, direction, seq, prefix, header, payload)))


def _tag(secret: bytes, direction: bytes, seq: int, prefix: bytes, header: bytes,
         payload: bytes) -> bytes:
    mac = hmac.new(secret, direction + seq.to_bytes(8, "big"), hashlib.sha256)
    mac.update(prefix)
    mac.update(header)
    mac.update(payload)
    return mac.digest()


def _decode(header: bytes, payload: bytes) -> tuple[str, dict, dict[str, np.ndarray]]:
    try:
        parsed = json.loads(header)
        kind, meta, described = parsed["kind"], parsed["meta"], parsed["arrays"]
        arrays, offset = {}, 0
        for name, dtype_name, shape in described:
            dtype = DTYPES[dtype_name]
            shape = tuple(int(d) for d in shape)
            if any(d < 0 for d in shape):
                raise ValueError(f"negative dimension in {shape}")
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if offset + size > len(payload):
                raise ValueError("arrays longer than the payload")
            arrays[str(name)] = np.frombuffer(payload, dtype, offset=offset,
                                              count=size // dtype.itemsize).reshape(shape)
            offset += size
        if offset != len(payload) or not isinstance(kind, str) or not isinstance(meta, dict):
            raise ValueError("payload and header do not agree")
    except (KeyError, TypeError, ValueError) as error:  # JSONDecodeError is a ValueError
        raise ChannelError(f"a malformed message: {error}") from None
    return kind, meta, arrays


def _keepalive(sock: socket.socket) -> None:
    """Notice a peer host that vanished without closing the connection within ~a minute."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class Listener:
    """The leader's side: accepts one authenticated connection per follower rank, in a thread,
    from the moment it is made (followers connect while the model loads)."""

    def __init__(self, port: int, secret: bytes, num_followers: int, hello_timeout_s: float = 30):
        self.secret = secret
        self._expected = set(range(1, num_followers + 1))
        self.connections: dict[int, Connection] = {}
        self._done = threading.Event()
        self._error: str | None = None
        self._hello_timeout_s = hello_timeout_s
        dual = socket.has_dualstack_ipv6()
        self._server = socket.create_server(
            ("", port), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual)
        self.port = port
        if not self._expected:
            self._done.set()
        threading.Thread(target=self._accept, name="xlaserve-step-channel-accept",
                         daemon=True).start()

    def wait(self, timeout_s: float) -> dict[int, Connection]:
        """{rank: connection} once every follower said hello; raises TimeoutError naming the
        missing ranks."""
        if not self._done.wait(timeout_s):
            missing = sorted(self._expected - set(self.connections))
            self.close()
            raise TimeoutError(f"followers {missing} did not connect to the step channel on port "
                               f"{self.port} within {timeout_s:.0f} s")
        if self._error is not None:
            raise RuntimeError(self._error)
        return dict(self.connections)

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        while not self._done.is_set():
            try:
                sock, address = self._server.accept()
            except OSError:
                return  # closed
            try:
                sock.settimeout(self._hello_timeout_s)
                connection = Connection(sock, self.secret, TO_FOLLOWER, TO_LEADER)
                kind, meta, _ = connection.receive()
                rank = meta.get("rank")
                if kind != "hello" or rank not in self._expected or rank in self.connections:
                    raise ChannelError(f"unexpected hello {kind!r} from rank {rank!r}")
                sock.settimeout(None)
            except (ChannelError, ChannelClosed, OSError) as error:
                logger.warning("step channel: refused a connection from %s: %s", address, error)
                sock.close()
                continue
            self.connections[rank] = connection
            logger.info("step channel: follower rank %d connected from %s", rank, address[0])
            if set(self.connections) == self._expected:
                self._done.set()
                self._server.close()


def connect(host: str, port: int, secret: bytes, rank: int, timeout_s: float) -> Connection:
    """The follower's side: connects (retrying until `timeout_s`, while the leader starts) and
    says hello."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            break
        except OSError as error:
            if time.monotonic() > deadline:
                raise TimeoutError(f"cannot reach the leader's step channel at {host}:{port} "
                                   f"within {timeout_s:.0f} s: {error}") from None
            time.sleep(0.2)
    sock.settimeout(None)
    connection = Connection(sock, secret, TO_LEADER, TO_FOLLOWER)
    connection.send("hello", {"rank": rank})
    return connection
