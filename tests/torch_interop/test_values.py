"""torch values besides tensors and modules that programs pass in calls:
shapes, dtypes, devices and state dicts (OrderedDicts) travel without
pickle, and what a peer sends in their place is refused."""

from __future__ import annotations

import collections

import msgpack
import pytest
import torch

import rpcdist
import rpcdist.torch.rpc as rpc
from rpcdist import RpcOptions
from rpcdist._serialization import decode, encode
from rpcdist.testing import as_current, local_agents
from rpcdist.torch._values import DEVICE_CODE, DTYPE_CODE, RETURN_TYPE_CODE, SIZE_CODE

pytestmark = pytest.mark.torch


def _back(value):
    header, buffers = encode(value, allow_pickle=False, context=None)
    return decode(header, buffers, context=None)


@pytest.mark.parametrize(
    "value",
    [
        torch.Size([2, 3]),
        torch.Size([]),
        torch.float32,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.int64,
        torch.bool,
        torch.device("cpu"),
        torch.device("cuda", 1),  # (only its name: no device is needed)
        torch.device("meta"),
    ],
    ids=repr,
)
def test_torch_shapes_dtypes_and_devices_round_trip(value):
    got = _back(value)
    assert type(got) is type(value) and got == value


def test_a_state_dict_is_an_ordered_dict_of_tensors_and_stays_one():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    state = model.state_dict()
    with local_agents(2, options=RpcOptions(token=None, transport="inproc")) as agents:
        with as_current(agents[0]):
            got = rpc.rpc_sync("worker1", collections.OrderedDict, args=(state,))
            shape = rpc.rpc_sync("worker1", torch.zeros, args=(torch.Size([2, 2]),),
                                 kwargs={"dtype": torch.float64, "device": torch.device("cpu")})  # fmt: skip
    assert type(got) is collections.OrderedDict and list(got) == list(state)
    for k, v in state.items():
        torch.testing.assert_close(got[k], v)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    fresh.load_state_dict(got)  # (what a checkpointing parameter server does)
    assert shape.dtype == torch.float64 and shape.shape == (2, 2)


@pytest.mark.parametrize(
    ("code", "payload"),
    [
        (DTYPE_CODE, "load"),  # a torch attribute, not a dtype
        (DTYPE_CODE, "_dynamo"),  # would import a submodule, were it looked up on torch
        (DTYPE_CODE, 4),
        (DEVICE_CODE, "bogus:0"),
        (DEVICE_CODE, ["cpu"]),
        (SIZE_CODE, [-1]),
        (SIZE_CODE, "2"),
        (RETURN_TYPE_CODE, ["max", [1]]),  # one field of two
        (RETURN_TYPE_CODE, ["Tensor", [1]]),  # not a return type
        (RETURN_TYPE_CODE, ["__builtins__", []]),
        (RETURN_TYPE_CODE, "max"),
    ],
)
def test_what_a_peer_sends_instead_is_refused(code, payload):
    header = msgpack.packb([msgpack.ExtType(code, b""), payload])
    with pytest.raises(rpcdist.SerializationError):
        decode(header, [], context=None)


def test_a_packed_sequence_crosses_as_one():
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

    batch = torch.randn(5, 3, 4)
    packed = pack_padded_sequence(batch, [5, 3, 2], enforce_sorted=False)
    got = _back(packed)
    assert type(got) is PackedSequence
    for mine, theirs in zip(packed, got, strict=True):
        assert (mine is None and theirs is None) or torch.equal(mine, theirs)
    torch.testing.assert_close(pad_packed_sequence(got)[0], pad_packed_sequence(packed)[0])


def test_the_named_tuples_of_torchs_operators_keep_their_type_and_fields():
    x = torch.arange(12.0).reshape(3, 4)
    for result in (torch.max(x, dim=0), torch.topk(x, 2), torch.linalg.slogdet(torch.eye(3))):
        got = _back(result)
        assert type(got) is type(result)
        for mine, theirs in zip(result, got, strict=True):
            torch.testing.assert_close(theirs, mine)
    assert _back(torch.max(x, dim=1)).indices.tolist() == [3, 3, 3]


def test_collectives_name_the_way_to_pass_a_torch_tensor():
    import numpy as np

    from rpcdist.collectives._ops import check_array

    t = torch.ones(3)
    with pytest.raises(rpcdist.ConfigError, match=r"got Tensor \(for a torch tensor, pass t.numpy"):
        check_array(t, "all_reduce buf", writable=True)
    view = check_array(t.numpy(), "all_reduce buf", writable=True)
    np.multiply(view, 2, out=view)  # what an in-place reduction does to the buffer
    assert t.tolist() == [2.0, 2.0, 2.0]
