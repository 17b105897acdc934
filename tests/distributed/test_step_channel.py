"""The multi-host step channel (runtime/distributed/channel.py): arrays and JSON arrive as sent; a message
with a wrong key, a changed byte, out of order or reflected back is refused before it is parsed;
nothing but plain numeric arrays can be sent."""
import socket
import threading

import numpy as np
import pytest

from tests.http.conftest import _free_port
from xlaserve.runtime.distributed.channel import (TO_FOLLOWER, TO_LEADER, ChannelClosed, ChannelError,
                                           Connection, Listener, channel_port, connect, encode,
                                           new_secret)


SECRET = b"k" * 32


def _pair(leader_secret=SECRET, follower_secret=SECRET):
    a, b = socket.socketpair()
    return (Connection(a, leader_secret, TO_FOLLOWER, TO_LEADER),
            Connection(b, follower_secret, TO_LEADER, TO_FOLLOWER))


def test_messages_arrive_whole_and_in_order():
    leader, follower = _pair()
    ints = np.arange(10, dtype=np.int32)
    mask = np.array([[True, False], [False, True]])
    leader.send("step", {"shape": [16, 4, 2], "widths": [300, 64]}, ints=ints,
                floats=np.linspace(0, 1, 5, dtype=np.float32), mask=mask,
                seeds=np.array([2**32 - 1], np.uint32), empty=np.zeros((0, 3), np.int32))
    leader.send("shutdown")
    kind, meta, arrays = follower.receive()
    assert kind == "step" and meta == {"shape": [16, 4, 2], "widths": [300, 64]}
    np.testing.assert_array_equal(arrays["ints"], ints)
    assert arrays["floats"].dtype == np.float32 and arrays["mask"].dtype == np.bool_
    np.testing.assert_array_equal(arrays["mask"], mask)
    assert arrays["seeds"][0] == 2**32 - 1 and arrays["empty"].shape == (0, 3)
    assert follower.receive()[0] == "shutdown"
    leader.close()
    with pytest.raises(ChannelClosed):
        follower.receive()


def test_a_wrong_key_a_changed_byte_a_replay_or_a_reflection_is_refused():
    leader, follower = _pair(follower_secret=b"x" * 32)
    leader.send("step", {}, ints=np.zeros(4, np.int32))
    with pytest.raises(ChannelError, match="authentication"):
        follower.receive()

    a, b = socket.socketpair()
    receiver = Connection(b, SECRET, TO_LEADER, TO_FOLLOWER)
    message = bytearray(encode(SECRET, TO_FOLLOWER, 0, "assign_slot", {"slot": 1},
                               {"prompt_ids": np.array([1, 2, 3], np.int32)}))
    message[-40] ^= 1  # a payload byte
    a.sendall(bytes(message))
    with pytest.raises(ChannelError, match="authentication"):
        receiver.receive()

    a, b = socket.socketpair()
    receiver = Connection(b, SECRET, TO_LEADER, TO_FOLLOWER)
    first = encode(SECRET, TO_FOLLOWER, 0, "shutdown", None, {})
    a.sendall(first + first)  # the same message again: its sequence number is used up
    assert receiver.receive()[0] == "shutdown"
    with pytest.raises(ChannelError, match="authentication"):
        receiver.receive()

    a, b = socket.socketpair()
    receiver = Connection(b, SECRET, TO_LEADER, TO_FOLLOWER)
    a.sendall(encode(SECRET, TO_LEADER, 0, "shutdown", None, {}))  # the other direction's
    with pytest.raises(ChannelError, match="authentication"):
        receiver.receive()


def test_only_numeric_arrays_go_and_garbage_is_refused_before_any_parsing():
    leader, follower = _pair()
    with pytest.raises(TypeError):
        leader.send("step", {}, objects=np.array([object()], dtype=object))
    with pytest.raises(TypeError):
        leader.send("step", {}, floats=np.zeros(2, np.float64))
    a, b = socket.socketpair()
    receiver = Connection(b, SECRET, TO_LEADER, TO_FOLLOWER)
    a.sendall(b"\x80\x04\x95" + b"\x00" * 64)  # a pickle's opening bytes
    with pytest.raises(ChannelError, match="not a step channel message"):
        receiver.receive()


def test_followers_connect_and_say_hello_a_stranger_is_refused():
    port = _free_port()
    secret = new_secret()
    listener = Listener(port, secret, num_followers=2, hello_timeout_s=5)
    stranger = connect("127.0.0.1", port, b"w" * 32, rank=1, timeout_s=10)  # wrong secret
    connections = {}
    threads = [threading.Thread(target=lambda r=r: connections.__setitem__(
        r, connect("127.0.0.1", port, secret, rank=r, timeout_s=10))) for r in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    accepted = listener.wait(10)
    assert sorted(accepted) == [1, 2]
    accepted[2].send("runner", {"num_pages": 41})
    assert connections[2].receive() == ("runner", {"num_pages": 41}, {})
    stranger.close()
    assert channel_port("10.0.0.1:5000") == ("10.0.0.1", 5001)
    assert channel_port("[::1]:5000") == ("::1", 5001)
    with pytest.raises(ValueError):
        channel_port("10.0.0.1")
