"""What the wire's value layer (bus/wire/values.py) guarantees and mutation testing found
no test pinning: each dtype's size, the zero copy, a tensor frame referred to exactly once,
the size limits at their boundaries, and errors that name the frame or field at fault."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from offloop.bus.wire import EventEncoder, Limits, WireError, decode_event
from offloop.bus.wire.values import DEFAULT_LIMITS, DTYPE_SIZES, TENSOR_EXT, check_size

TS = (0, 1, 1, 32, 0)


def _encode(data: dict) -> list:
    return EventEncoder("run", "pub", 0).encode_event(["batch_end", 1, 1, 0.5, TS, data])


def _descriptor(index, dtype: str = "float32", shape=(1,)) -> msgpack.ExtType:
    return msgpack.ExtType(TENSOR_EXT, msgpack.packb([index, dtype, list(shape)]))


def _crafted(data: dict, tensor_frames: list) -> list:
    """A valid event's frames with `data` put in its body as is (tensor descriptors made by
    `_descriptor`, however wrong) and `tensor_frames` after it."""
    head = bytes(_encode({})[0])
    cut = head.index(b"\0") + 1
    body = msgpack.unpackb(head[cut:], raw=False)
    body[-1] = data
    return [head[:cut] + msgpack.packb(body, use_bin_type=True), *tensor_frames]


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_every_dtype_travels_with_its_size(dtype):
    source = (torch.arange(6) % 2).to(getattr(torch, dtype)).reshape(2, 3)
    received = decode_event(_encode({"x": source})).data["x"]
    assert received.dtype == dtype and received.shape == (2, 3)
    assert received.nbytes == 6 * DTYPE_SIZES[dtype] == len(received.data)
    assert torch.equal(received.to_torch(), source)


def test_a_contiguous_array_is_sent_without_a_copy_and_a_strided_one_as_its_values():
    contiguous = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = _encode({"c": contiguous, "t": contiguous.T})
    assert any(np.shares_memory(np.frombuffer(frame, dtype=np.float32), contiguous)
               for frame in frames[1:])
    data = decode_event(frames).data
    assert np.array_equal(data["c"].to_numpy(), contiguous)
    assert np.array_equal(data["t"].to_numpy(), contiguous.T)


def test_a_tensor_frame_referred_to_twice_is_refused_by_its_number():
    frames = _crafted({"a": _descriptor(1), "b": _descriptor(1)}, [bytes(4), bytes(4)])
    with pytest.raises(WireError, match=r"^tensor frame 1 is referred to by 2 tensor descriptors; each "
                                        r"of the message's 2 tensor frames must be referred to by exactly one$"):
        decode_event(frames)


def test_a_tensor_frame_referred_to_by_none_is_refused_by_its_number():
    frames = _crafted({"a": _descriptor(1)}, [bytes(4), bytes(4)])
    with pytest.raises(WireError, match=r"^tensor frame 2 is referred to by 0 tensor descriptors; each "
                                        r"of the message's 2 tensor frames"):
        decode_event(frames)


@pytest.mark.parametrize("index", [0, 2])
def test_a_frame_index_outside_the_tensor_frames_is_named(index):
    frames = _crafted({"a": _descriptor(index)}, [bytes(4)])
    with pytest.raises(WireError, match=rf"^tensor frame_index {index} is not an int naming one of the "
                                        r"message's 1 tensor frames \(1\.\.1\)$"):
        decode_event(frames)


def test_an_empty_dimension_is_a_tensor_and_a_negative_one_is_refused():
    empty = decode_event(_crafted({"a": _descriptor(1, shape=(0, 3))}, [b""])).data["a"]
    assert empty.shape == (0, 3) and empty.nbytes == 0
    with pytest.raises(WireError, match=r"shape \[-1\] is not a list of non-negative ints"):
        decode_event(_crafted({"a": _descriptor(1, shape=(-1,))}, [b""]))


def test_an_extension_value_is_named_with_or_without_tensor_frames():
    with pytest.raises(WireError, match="body refers to a tensor frame, but the message has none"):
        decode_event(_crafted({"a": _descriptor(1)}, []))
    for tensor_frames in ([], [bytes(4)]):
        data = {"a": msgpack.ExtType(5, b"x")} | ({"b": _descriptor(1)} if tensor_frames else {})
        with pytest.raises(WireError, match="unknown msgpack ext type 5"):
            decode_event(_crafted(data, tensor_frames))


def test_frames_as_bytes_or_buffers_decode_alike():
    frames = _encode({"x": torch.arange(4, dtype=torch.int32)})
    head, tensor = bytes(frames[0]), bytes(frames[1])
    for mixed in ([head, tensor], [memoryview(head), memoryview(tensor)],
                  [memoryview(head), tensor], [head, memoryview(tensor)]):
        message = decode_event(mixed)
        assert message.topic == "batch_end" and message.from_state is False
        assert message.data["x"].to_torch().tolist() == [0, 1, 2, 3]


def test_the_default_body_limit_is_4_mib_exactly():
    limit = 4 << 20
    probe = len(_encode({"s": "x" * limit})[0])
    fits = _encode({"s": "x" * (2 * limit - probe)})
    assert len(fits[0]) == limit
    assert decode_event(fits).topic == "batch_end"
    too_big = _encode({"s": "x" * (2 * limit - probe + 1)})
    with pytest.raises(WireError, match=rf"message body is {limit + 1} bytes, the limit is {limit}"):
        decode_event(too_big)


class _Sized:
    """A frame known by its length alone: the message limit is checked before any byte is read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_the_default_message_limit_is_256_mib_exactly():
    limit = 256 << 20
    check_size([b"x", _Sized(limit - 1)])
    with pytest.raises(WireError, match=rf"message is {limit + 1} bytes, the limit is {limit}"):
        check_size([b"x", _Sized(limit)])
    check_size([b"x", _Sized(9)], Limits(max_message_bytes=10))


def test_limits_cannot_be_changed_in_place():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_LIMITS.max_body_bytes = 1  # shared by every decoder in the process
