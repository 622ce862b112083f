"""End-of-backward callbacks: what data parallelism waits for its all-reduces in."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import AutogradError
from rpcdist.tensor import GraphTask, Tensor, run_backward, tensor_roots
from rpcdist.tensor._engine import current_graph_task, queue_callback


def test_callback_queued_by_a_hook_runs_once_after_every_leaf() -> None:
    a = rt.tensor([1.0, 2.0], requires_grad=True)
    b = rt.tensor([3.0], requires_grad=True)
    events: list[str] = []

    def post(t: Tensor) -> None:
        events.append("a" if t is a else "b")
        if len(events) == 1:
            queue_callback(lambda: events.append("end"))

    a.register_post_accumulate_grad_hook(post)
    b.register_post_accumulate_grad_hook(post)
    ((a * b).sum() + b.sum()).backward()
    assert sorted(events[:2]) == ["a", "b"] and events[2:] == ["end"]
    assert current_graph_task() is None


def test_callbacks_run_in_order_and_may_queue_more() -> None:
    w = rt.tensor([1.0], requires_grad=True)
    order: list[int] = []
    tasks: list[GraphTask | None] = []

    def first() -> None:
        order.append(1)
        assert current_graph_task() is None  # the walk is over
        task = tasks[0]
        assert task is not None
        task.queue_callback(lambda: order.append(3))  # runs after the ones queued before

    def hook(t: Tensor) -> None:
        tasks.append(current_graph_task())
        queue_callback(first)
        queue_callback(lambda: order.append(2))

    w.register_post_accumulate_grad_hook(hook)
    (w * 2).sum().backward()
    assert order == [1, 2, 3]


def test_queue_callback_outside_backward_raises() -> None:
    with pytest.raises(AutogradError, match="backward pass"):
        queue_callback(lambda: None)


def test_failing_callback_propagates_and_drops_the_rest() -> None:
    w = rt.tensor([1.0], requires_grad=True)
    ran: list[str] = []

    def boom() -> None:
        raise AutogradError("reduction failed")

    def hook(t: Tensor) -> None:
        queue_callback(boom)
        queue_callback(lambda: ran.append("after"))

    w.register_post_accumulate_grad_hook(hook)
    with pytest.raises(AutogradError, match="reduction failed"):
        (w * 3).sum().backward()
    assert ran == []
    np.testing.assert_array_equal(w.grad.numpy(), [3.0])  # type: ignore[union-attr]


def test_run_backward_leaves_final_callbacks_to_its_caller() -> None:
    """Distributed autograd feeds a task in several calls and ends it itself."""
    w = rt.tensor([2.0], requires_grad=True)
    grads: dict[Tensor, Any] = {}
    ran: list[str] = []
    task = run_backward(tensor_roots([(w * w).sum()]), grad_map=grads)
    task.queue_callback(lambda: ran.append("end"))
    assert ran == []
    task.run_final_callbacks()
    task.run_final_callbacks()  # each callback runs once
    assert ran == ["end"]
    np.testing.assert_array_equal(grads[w], [4.0])
