import asyncio
import gc
import threading
import weakref

import pytest

from rpcdist import Future, RpcTimeoutError
from rpcdist.futures import collect_all, wait_all


def test_set_result_then_wait_and_value():
    f: Future[int] = Future()
    assert not f.done()
    with pytest.raises(RuntimeError):
        f.value()
    f.set_result(3)
    assert f.done() and f.wait() == 3 and f.value() == 3
    with pytest.raises(RuntimeError):
        f.set_result(4)


def test_exception_propagates_from_wait_and_value():
    f: Future[int] = Future()
    f.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        f.wait()
    with pytest.raises(KeyError):
        f.value()


class _Marked(Exception):
    """An exception a weak reference can follow."""


def _raise(box: list[BaseException]) -> None:
    raise box.pop()  # (held by no local: a frame that did would be a cycle itself)


@pytest.mark.parametrize("how", ["wait", "value", "then"])
def test_a_raised_failure_is_freed_without_the_collector(how):
    # Raising an exception stored in a future puts the raising frames in its
    # traceback; were those frames to keep the future, the future (and all
    # the frames hold) would live on in a cycle until the collector ran,
    # after every failed call.
    exc = _Marked("x")
    gone = weakref.ref(exc)
    f: Future[int] = Future()
    if how == "then":
        box = [exc]
        src, f = f, f.then(lambda _: _raise(box))
        src.set_result(1)
    else:
        f.set_exception(exc)
    del exc
    gc.disable()
    try:
        with pytest.raises(_Marked):
            f.wait() if how != "value" else f.value()
        del f
        if how == "then":
            del src
        assert gone() is None
    finally:
        gc.enable()


def test_wait_timeout():
    with pytest.raises(RpcTimeoutError):
        Future().wait(timeout=0.01)


def test_completion_from_another_thread_wakes_waiter():
    f: Future[str] = Future()
    t = threading.Thread(target=f.set_result, args=("x",))
    t.start()
    assert f.wait(timeout=5) == "x"
    t.join()


def test_every_waiting_thread_wakes_and_a_timed_out_waiter_leaves_the_others_waiting():
    """Waiters pass the gate the first of them makes; one that gave up does
    not keep it from the others, or from a later waiter."""
    f: Future[str] = Future()
    with pytest.raises(RpcTimeoutError):
        f.wait(timeout=0.01)  # made the gate, gave up
    got: list[str] = []
    waiting = threading.Barrier(5)

    def waiter() -> None:
        waiting.wait()
        got.append(f.wait(timeout=30))

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for t in threads:
        t.start()
    waiting.wait()
    f.set_result("x")
    for t in threads:
        t.join(30)
    assert got == ["x"] * 4
    assert f.wait(timeout=0) == "x" and f.wait() == "x"  # done: no gate to pass
    with pytest.raises(RuntimeError):
        f.set_result("y")


def test_then_chains_and_propagates_errors():
    f: Future[int] = Future()
    g = f.then(lambda x: x.value() + 1).then(lambda y: y.value() * 10)
    bad = f.then(lambda x: 1 / 0)
    f.set_result(1)
    assert g.wait() == 20
    with pytest.raises(ZeroDivisionError):
        bad.wait()


def test_callbacks_run_once_in_order_even_when_added_late():
    f: Future[int] = Future()
    seen: list[int] = []
    f.add_done_callback(lambda x: seen.append(1))
    f.add_done_callback(lambda x: seen.append(2))
    f.set_result(0)
    f.add_done_callback(lambda x: seen.append(3))
    assert seen == [1, 2, 3]


def test_awaitable_from_any_event_loop():
    f: Future[int] = Future()

    async def main() -> int:
        threading.Timer(0.01, f.set_result, args=(7,)).start()
        return await f

    assert asyncio.run(main()) == 7


def test_await_failed_future_raises():
    f: Future[int] = Future()
    f.set_exception(ValueError("v"))

    async def main() -> int:
        return await f

    with pytest.raises(ValueError):
        asyncio.run(main())


def test_collect_all_and_wait_all_keep_submission_order():
    fs: list[Future[int]] = [Future() for _ in range(5)]
    done = collect_all(fs)
    for i in reversed(range(5)):
        assert not done.done()
        fs[i].set_result(i)
    assert done.wait() == fs
    assert wait_all(fs) == [0, 1, 2, 3, 4]
    assert collect_all([]).wait() == []


def test_wait_all_raises_first_error_after_all_complete():
    fs: list[Future[int]] = [Future() for _ in range(3)]
    fs[0].set_result(0)
    fs[1].set_exception(IndexError("one"))
    fs[2].set_result(2)
    with pytest.raises(IndexError):
        wait_all(fs)


def test_misuse_and_a_failing_callback_are_contained(caplog):
    fut: Future[int] = Future()
    assert repr(fut) == "<rpcdist.Future pending>"
    with pytest.raises(RuntimeError, match="exception\\(\\) called before the future completed"):
        fut.exception()
    with pytest.raises(TypeError, match="set_exception expects an exception, got str"):
        fut.set_exception("boom")  # type: ignore[arg-type]
    assert not fut.done()
    seen = []

    def bad(_):
        raise ValueError("callback bug")

    fut.add_done_callback(bad)
    fut.add_done_callback(lambda f: seen.append(f.value()))
    with caplog.at_level("ERROR", logger="rpcdist"):
        fut.set_result(5)  # the bad callback is logged; the next one still runs
    assert seen == [5] and fut.exception() is None and repr(fut) == "<rpcdist.Future result=5>"
    logged = [r for r in caplog.records if "Future callback" in r.getMessage()]
    assert len(logged) == 1 and "callback bug" in str(logged[0].exc_info[1])
    with pytest.raises(
        RuntimeError, match="^Future can only be marked completed once.*already complete"
    ):
        fut.set_result(6)
    failed: Future[int] = Future()
    failed.set_exception(KeyError("k"))
    assert repr(failed) == "<rpcdist.Future exception=KeyError('k')>"
