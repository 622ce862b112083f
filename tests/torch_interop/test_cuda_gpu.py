"""CUDA tensors through rpcdist.torch: they arrive on their CUDA device, and
distributed autograd runs across workers on it (needs a CUDA build of torch
and a device; skipped otherwise)."""

from __future__ import annotations

import pytest
import tfuncs as tf
import torch

import rpcdist.torch.autograd as dist_autograd
import rpcdist.torch.rpc as rpc
from rpcdist import RpcOptions
from rpcdist.testing import as_current, local_agents

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.torch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with a CUDA device"),
]


def test_cuda_tensors_arrive_on_their_device_and_replies_come_back_there():
    x = torch.arange(6, dtype=torch.float32, device="cuda:0").reshape(2, 3)
    with local_agents(2, options=RpcOptions(token=None)) as (a, _):
        with as_current(a):
            y, seen = rpc.rpc_sync("worker1", tf.double_with_device, args=(x,))
    assert seen == "cuda:0"
    assert y.device == x.device
    torch.testing.assert_close(y, x * 2)


def test_distributed_backward_on_cuda_matches_the_local_gradients():
    tf.PARAMS.clear()
    tf.PARAMS.update({f"worker{i}": tf.param(i).cuda().detach().requires_grad_() for i in range(2)})
    x0 = tf.param(9, (2, 3))
    with local_agents(2, options=RpcOptions(token=None)) as (a, _):
        with as_current(a):
            x = x0.detach().cuda().requires_grad_()
            with dist_autograd.context() as cid:
                y = rpc.rpc_sync("worker1", tf.layer, args=(tf.layer(x),))
                dist_autograd.backward(cid, [(y * y).sum()])
                got = dist_autograd.get_gradients(cid)[x]
                remote = rpc.rpc_sync("worker1", tf.grads_here, args=(cid,))["worker1"]
    xs = x0.detach().clone().requires_grad_()
    ws = [tf.PARAMS[f"worker{i}"].detach().cpu().clone().requires_grad_() for i in range(2)]
    out = torch.tanh(torch.tanh(xs @ ws[0]) @ ws[1])
    (out * out).sum().backward()
    assert got.device.type == "cuda" and remote.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), xs.grad)
    torch.testing.assert_close(remote.cpu(), ws[1].grad)


def _cuda_ipc_worker(rank: int, world: int, init: str) -> dict[str, object] | None:
    import rpcdist

    opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=60)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    try:
        if rank != 0:
            return None
        warm = torch.ones(1 << 20, device="cuda:0")
        for _ in range(200):  # the first tensors go by host while the probes run
            rpc.rpc_sync("w1", tf.double_with_device, args=(warm,))
            s = rpcdist.statistics()
            if s["cuda_ipc_sent"] and s["cuda_ipc_received"]:
                break
        before = rpcdist.statistics()["cuda_ipc_sent"]
        g = torch.Generator(device="cuda:0").manual_seed(0)
        base = torch.randn(1 << 20, device="cuda:0", generator=g)
        for x in (base, base.to(torch.bfloat16), base.reshape(1024, 1024).T, base.double()):
            y, seen = rpc.rpc_sync("w1", tf.double_with_device, args=(x,))
            assert seen == "cuda:0" and y.device == x.device and y.dtype == x.dtype
            torch.testing.assert_close(y, x * 2, rtol=0, atol=0)
        # A tensor still being written on a side stream when it is sent: the
        # copy out of it waits for that stream.
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # (~25 ms of GPU time ahead of the write)
            x = base * 3
            y, _ = rpc.rpc_sync("w1", tf.double_with_device, args=(x,))
        side.synchronize()
        torch.testing.assert_close(y, base * 6, rtol=0, atol=0)
        # One backward across both processes, the gradient crossing by handle.
        x = base.reshape(1024, 1024)[:, :256].contiguous().requires_grad_()
        with dist_autograd.context() as cid:
            y, _ = rpc.rpc_sync("w1", tf.double_with_device, args=(x,))
            dist_autograd.backward(cid, [(y * y).sum()])
            grad = dist_autograd.get_gradients(cid)[x]
        torch.testing.assert_close(grad, 8 * x.detach())
        return {"sent": rpcdist.statistics()["cuda_ipc_sent"] - before}
    finally:
        rpc.shutdown()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_cuda_tensors_cross_processes_by_cuda_ipc():
    pytest.importorskip("cupy")
    from rpcdist.testing import run_workers

    out = run_workers(_cuda_ipc_worker, 2, timeout=150)[0]
    assert out["sent"] >= 6  # the five tensors, the one in the context (and its gradient)
