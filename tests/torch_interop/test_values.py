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
from rpcdist.torch._remote_module import REMOTE_MODULE_CODE
from rpcdist.torch._values import (
    DEVICE_CODE,
    DTYPE_CODE,
    RETURN_TYPE_CODE,
    SIZE_CODE,
    SPARSE_CODE,
)

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
            shape = rpc.rpc_sync(
                "worker1",
                torch.zeros,
                args=(torch.Size([2, 2]),),
                kwargs={"dtype": torch.float64, "device": torch.device("cpu")},
            )
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
        (REMOTE_MODULE_CODE, ["worker1", 3, "cpu"]),  # not a WorkerInfo and an RRef
        (REMOTE_MODULE_CODE, "RemoteModule"),
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


def _sparse(*args, **kwargs):
    return torch.sparse_coo_tensor(*args, **kwargs, check_invariants=True)


def _sparse_cases():
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 1, 4])).sum().backward()
    return {
        "uncoalesced": _sparse(i, torch.tensor([3.0, 4.0, 5.0]), (2, 3)),
        "coalesced": _sparse(i, torch.tensor([3.0, 4.0, 5.0]), (2, 3)).coalesce(),
        "duplicates": _sparse(torch.tensor([[0, 0]]), torch.tensor([1.0, 2.0]), (3,)),
        "hybrid": _sparse(i, torch.randn(3, 4, dtype=torch.float64), (2, 3, 4)),
        "embedding gradient": emb.weight.grad,
        "empty": _sparse(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), (5, 5)),
        "requires grad": _sparse(i, torch.ones(3), (2, 3), requires_grad=True),
    }


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_sparse_tensors_cross_as_they_are(transport):
    # (an Embedding(sparse=True)'s gradient, sent to a parameter server by hand)
    cases = _sparse_cases()
    with local_agents(2, options=RpcOptions(token=None, transport=transport)) as agents:
        with as_current(agents[0]):
            got = rpc.rpc_sync("worker1", collections.OrderedDict, args=(list(cases.items()),))
    for name, t in cases.items():
        g = got[name]
        assert g.layout == torch.sparse_coo and g.shape == t.shape and g.dtype == t.dtype, name
        assert g.is_coalesced() == t.is_coalesced() and g.requires_grad == t.requires_grad, name
        assert torch.equal(g._indices(), t._indices()) and torch.equal(g._values(), t._values())


def test_a_sparse_tensor_that_requires_grad_crosses_inside_a_context():
    # (with its autograd edge, as a dense one: tests/torch_interop/test_edges.py)
    import rpcdist.torch.autograd as dist_autograd

    t = _sparse_cases()["requires grad"]
    with local_agents(2, options=RpcOptions(token=None, transport="inproc")) as agents:
        with as_current(agents[0]), dist_autograd.context():
            got = rpc.rpc_sync("worker1", collections.OrderedDict, args=([("t", t)],))["t"]
            plain = rpc.rpc_sync("worker1", torch.Tensor.to_dense, args=(t.detach(),))
    assert got.is_sparse and got.requires_grad and got.grad_fn is not None
    assert torch.equal(got.detach().to_dense(), t.detach().to_dense())
    assert torch.equal(plain, t.detach().to_dense())


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ([torch.tensor([[0, 9]]), torch.tensor([1.0, 2.0]), [3], False, False, -1], "index 9"),
        ([torch.tensor([[0, 0]]), torch.tensor([1.0, 2.0]), [3], True, False, -1], "uncoalesced"),
        ([torch.tensor([[0.5]]), torch.tensor([1.0]), [3], False, False, -1], "malformed"),
        ([torch.tensor([[0]]), torch.tensor([1.0]), [-3], False, False, -1], "malformed"),
        ([torch.tensor([[0]]), torch.tensor([1.0]), [3], 1, False, -1], "malformed"),
        ([torch.tensor([[0]]), torch.tensor([1.0]), [3], False, False, 0], "malformed"),
        ([torch.tensor([[0]])], "malformed"),
    ],
    ids=[
        "out of bounds",
        "falsely coalesced",
        "float indices",
        "negative size",
        "flag",
        "an edge without grad",
        "short",
    ],
)
def test_a_sparse_tensor_a_peer_makes_up_is_refused(payload, why):
    # torch's own invariant checks: indices a peer sends never reach memory unchecked
    header, buffers = encode([msgpack.ExtType(SPARSE_CODE, b""), payload], context=None)
    with pytest.raises(rpcdist.SerializationError, match=why):
        decode(header, buffers, context=None)


@pytest.mark.parametrize(
    "view",
    [
        torch.arange(25.0).reshape(5, 5).narrow(1, 2, 2),
        torch.arange(12.0).reshape(3, 4).t(),
        torch.arange(24).reshape(2, 3, 4).permute(2, 0, 1),
        torch.arange(36.0).reshape(6, 6)[::2, 1::3],
        torch.ones(1).expand(7),
        torch.arange(25.0).reshape(5, 5).to(torch.bfloat16)[:, 1:3],
    ],
    ids=["narrow", "transpose", "permute", "steps", "expand", "bfloat16"],
)
def test_a_non_contiguous_view_keeps_its_strides_as_in_pytorch(view):
    got = _back(view)
    assert torch.equal(got, view)
    assert got.stride() == view.stride() and not got.is_contiguous()


def test_a_small_view_of_a_large_tensor_arrives_contiguous_with_only_its_elements():
    # (PyTorch copies such a view before sending it: it arrives contiguous)
    view = torch.arange(400_000.0).reshape(4000, 100)[:, :3]
    header, buffers = encode(view, allow_pickle=False, context=None)
    assert sum(memoryview(b).nbytes for b in buffers) == view.numel() * 4
    got = decode(header, buffers, context=None)
    assert torch.equal(got, view) and got.is_contiguous()


@pytest.mark.parametrize(
    "strides", [[5, 1, 1], [-5, 1], [5, 1.0], [50, 1]], ids=["rank", "negative", "float", "span"]
)
def test_strides_a_peer_makes_up_are_refused(strides):
    header, buffers = encode(torch.arange(25.0).reshape(5, 5)[:, 2:4], context=None)
    items = msgpack.unpackb(header, strict_map_key=False)
    items[4] = strides
    with pytest.raises(rpcdist.SerializationError, match="malformed|bytes"):
        decode(msgpack.packb(items), buffers, context=None)


@pytest.mark.parametrize(
    "fut", [torch.futures.Future(), rpcdist.Future()], ids=["torch", "rpcdist"]
)
def test_a_future_is_refused_as_an_argument_in_pytorchs_words(fut):
    with local_agents(2, options=RpcOptions(token=None, transport="inproc")) as (a, _):
        with as_current(a), pytest.raises(RuntimeError, match="a Future cannot be sent") as got:
            rpc.rpc_sync("worker1", max, args=(fut,))
    torchs = isinstance(fut, torch.futures.Future)
    assert ("Can not pickle torch.futures.Future" in str(got.value)) == torchs
