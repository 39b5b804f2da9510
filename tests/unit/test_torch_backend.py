"""The torch.distributed backend's parts that need no coordinator: init_method parsing, reduce
ops, dtype conversions, the refusal of tensors on devices it does not move, GradstarWork (on the
CPU, and the CUDA rules it keeps, with torch's CUDA calls stood in for) and its completion
threads, and registration on import.

The backend over real processes and a real coordinator is in tests/parallel/test_torch_backend.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import pickle
import subprocess
import sys
import threading
from datetime import timedelta
from typing import TypeVar

import pytest
import torch
import torch.distributed as dist

from gradstar.client.torch_backend import work as work_module
from gradstar.client.torch_backend.backend import parse_init_method
from gradstar.client.torch_backend.convert import (
    bitwise_reduce,
    for_bitwise,
    for_reduction,
    for_transfer,
    op_label,
    reduce_op_name,
)
from gradstar.client.torch_backend.group import BackendUnsupportedError, ProcessGroupGradstar
from gradstar.client.torch_backend.work import CompletionThreads, GradstarWork
from gradstar.client.work import SettledWork, Work
from gradstar.errors import (
    CollectiveMismatchError,
    ConfigurationError,
    ProcessGroupClosedError,
    RankLostError,
)

# -- init_method -------------------------------------------------------------------------------


def test_init_method_names_coordinator_job_and_settings():
    assert parse_init_method("gradstar://10.0.0.5:29400?job=mnist&timeout=30&rank=2"
                             "&world_size=4") == {
        "coordinator": "10.0.0.5:29400", "job": "mnist", "timeout": "30", "rank": 2,
        "world_size": 4}


def test_an_empty_init_method_leaves_everything_to_the_environment():
    assert parse_init_method("gradstar://") == {}
    # torch writes rank=-1 / world_size=-1 for "not given".
    assert parse_init_method("gradstar://h:1?rank=-1&world_size=-1") == {"coordinator": "h:1"}


def test_an_unknown_query_key_is_a_named_error():
    with pytest.raises(ConfigurationError, match=r"unknown setting 'token' in init_method"):
        parse_init_method("gradstar://h:1?token=secret")


def test_another_scheme_is_refused():
    with pytest.raises(ConfigurationError, match=r"expected a gradstar:// init_method"):
        parse_init_method("tcp://h:1")


# -- reduce ops and dtypes ---------------------------------------------------------------------


@pytest.mark.parametrize(("op", "name"), [
    (dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "mean"), (dist.ReduceOp.MIN, "min"),
    (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.PRODUCT, "prod"), (dist.ReduceOp.BAND, "band"),
    (dist.ReduceOp.BOR, "bor"), (dist.ReduceOp.BXOR, "bxor"), (None, "sum")])
def test_reduce_ops_map_to_gradstar_names(op, name):
    assert reduce_op_name(op) == name
    opts = dist.AllreduceOptions()
    opts.reduceOp = op if op is not None else dist.ReduceOp.SUM
    assert reduce_op_name(opts) == name


def test_premul_sum_is_a_clear_error():
    with pytest.raises(ConfigurationError, match=r"^ReduceOp.PREMUL_SUM is not supported by the "
                                                 r"gradstar backend: torch does not expose"):
        reduce_op_name(dist._make_nccl_premul_sum(2.0))


def test_messages_name_ops_the_way_torch_spells_them():
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.BOR  # torch hands backends a ReduceOp object, not the enum
    assert op_label(opts.reduceOp) == op_label(dist.ReduceOp.BOR) == "ReduceOp.BOR"
    assert op_label(dist._make_nccl_premul_sum(2.0)) == "ReduceOp.PREMUL_SUM"
    with pytest.raises(ConfigurationError, match=r"^ReduceOp.BXOR reduces integer and bool "
                                                 r"tensors, not torch.float32 tensors$"):
        for_bitwise(torch.ones(2), "bxor")


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.int64])
def test_bitwise_ops_reduce_every_rank_s_tensor_exactly(dtype):
    parts = [torch.tensor(v).to(dtype) for v in ([12, 10, 7], [10, 6, 7], [9, 3, 0])]
    want = {"band": [8, 2, 0], "bor": [15, 15, 7], "bxor": [15, 15, 0]}
    for op, values in want.items():
        got = bitwise_reduce(parts, op)
        if dtype == torch.bool:
            bits = [p.tolist() for p in parts]
            values = [{"band": all, "bor": any, "bxor": lambda c: sum(c) % 2 == 1}[op](column)
                      for column in zip(*bits, strict=True)]
        assert got.dtype == dtype and got.tolist() == values, op


def test_sparse_tensors_are_a_clear_error():
    sparse = torch.eye(3).to_sparse()
    for convert in (for_transfer, lambda t: for_reduction(t, "sum"),
                    lambda t: for_bitwise(t, "band")):
        with pytest.raises(ConfigurationError, match=r"sparse layouts such as this tensor's "
                                                     r"torch.sparse_coo are not supported"):
            convert(sparse)


@pytest.mark.parametrize("t", [
    torch.tensor([True, False, True]), torch.arange(7, dtype=torch.uint8),
    torch.arange(-3, 3, dtype=torch.int8).reshape(2, 3), torch.tensor(5, dtype=torch.int16),
    torch.tensor([1 + 2j, 3 - 4j]), torch.arange(3, dtype=torch.bfloat16)])
def test_every_dtype_travels_as_its_bytes_and_comes_back(t):
    wire, restore = for_transfer(t)
    assert wire.dtype in (torch.int32, t.dtype)
    back = restore(wire.clone())
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_small_integers_reduce_widened_and_complex_as_real_pairs():
    wire, restore = for_reduction(torch.tensor([200, 7], dtype=torch.uint8), "sum")
    assert wire.dtype == torch.int32
    assert restore(wire * 2).tolist() == [144, 14]  # wraps around like uint8 arithmetic
    wire, restore = for_reduction(torch.tensor([1 + 2j]), "mean")
    assert wire.tolist() == [[1.0, 2.0]] and restore(wire).tolist() == [1 + 2j]
    with pytest.raises(ConfigurationError, match=r"cannot reduce torch.complex64 tensors with "
                                                 r"ReduceOp.MAX$"):
        for_reduction(torch.tensor([1j]), "max")


# -- devices -----------------------------------------------------------------------------------


class UnreachableGroup:
    """Stands in for the gradstar ProcessGroup under a ProcessGroupGradstar whose calls must be
    refused before they reach it."""

    rank, world_size, job = 0, 2, "unreachable"

    def __getattr__(self, name: str):
        def called(*_args, **_kwargs):
            raise AssertionError(f"gradstar's {name} was called")

        return called


def _band():
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.BAND
    return opts


CPU, META = torch.ones(4), torch.ones(4, device="meta")
# Each of the backend's calls with a meta tensor somewhere among its inputs or its outputs.
META_CALLS = {
    "allreduce": lambda pg: pg.allreduce([META]),
    "allreduce_band": lambda pg: pg.allreduce([META.int()], _band()),
    "allreduce_sparse": lambda pg: pg.allreduce([torch.eye(2).to_sparse().to("meta")]),
    "allreduce_coalesced": lambda pg: pg.allreduce_coalesced([CPU, META]),
    "reduce": lambda pg: pg.reduce([META]),
    "broadcast": lambda pg: pg.broadcast([META]),
    "allgather_input": lambda pg: pg.allgather([[CPU, CPU]], [META]),
    "allgather_output": lambda pg: pg.allgather([[META, META]], [CPU]),
    "allgather_coalesced": lambda pg: pg.allgather_coalesced([[META], [META]], [CPU]),
    "all_gather_into_tensor": lambda pg: pg._allgather_base(torch.ones(8, device="meta"), CPU),
    "gather": lambda pg: pg.gather([[CPU, CPU]], [META]),
    "scatter": lambda pg: pg.scatter([META], [[CPU, CPU]]),
    "reduce_scatter_input": lambda pg: pg.reduce_scatter([CPU], [[CPU, META]]),
    "reduce_scatter_output": lambda pg: pg.reduce_scatter([META], [[CPU, CPU]]),
    "reduce_scatter_tensor": lambda pg: pg._reduce_scatter_base(
        torch.ones(2, device="meta"), CPU),
    "all_to_all_single": lambda pg: pg.alltoall_base(META, CPU, [], []),
    "all_to_all": lambda pg: pg.alltoall([META, META], [CPU, CPU]),
    "send": lambda pg: pg.send([META], 1),
    "recv": lambda pg: pg.recv([META], 1),
    "recv_anysource": lambda pg: pg.recv_anysource([META]),
}


@pytest.mark.parametrize("call", list(META_CALLS))
def test_a_tensor_on_another_device_than_cpu_or_cuda_is_refused_by_name(call, completions):
    group = ProcessGroupGradstar(UnreachableGroup(), completions)
    with pytest.raises(ConfigurationError, match=r"CPU and CUDA tensors; this tensor is on "
                                                 r"meta"):
        META_CALLS[call](group)


class CollectivesOnlyGroup:
    """A gradstar group with collectives but no point-to-point calls (no peer streams)."""

    rank, world_size, job = 0, 2, "collectives-only"

    def all_reduce(self, *_args, **_kwargs):
        raise AssertionError("gradstar's all_reduce was called")


@pytest.mark.parametrize(("call", "named"), [
    (lambda pg: pg.send([CPU], 1), "send"),
    (lambda pg: pg.recv([CPU], 1), "recv"),
    (lambda pg: pg.recv_anysource([CPU]), "recv"),
])
def test_send_and_recv_over_a_group_without_peer_streams_are_refused_by_name(call, named,
                                                                             completions):
    group = ProcessGroupGradstar(CollectivesOnlyGroup(), completions)
    with pytest.raises(BackendUnsupportedError, match=(
            rf"^torch.distributed {named} over the gradstar backend rides gradstar's peer "
            r"streams \(ProcessGroup.send/recv\)")) as raised:
        call(group)
    assert isinstance(raised.value, NotImplementedError)


# -- GradstarWork ------------------------------------------------------------------------------


class FakeLoop:
    """Completes gradstar Work futures from a thread of its own, as gradstar's loop thread."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def work(self) -> tuple[Work, concurrent.futures.Future]:
        future: concurrent.futures.Future = concurrent.futures.Future()
        return Work(future), future

    def complete(self, future, result=None, error=None) -> None:
        def run():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        thread = threading.Thread(target=run, name="fake-gradstar-loop")
        self.threads.append(thread)
        thread.start()
        thread.join(5)


@pytest.fixture
def completions():
    threads = CompletionThreads()
    yield threads
    threads.close()


def test_results_land_in_place_and_the_future_completes_off_the_loop_thread(completions):
    loop, out = FakeLoop(), torch.zeros(3)
    work_of_gradstar, future = loop.work()
    work = GradstarWork([work_of_gradstar], lambda results: [out.copy_(results[0])], completions)
    ran_on = []
    chained = work.get_future().then(lambda f: ran_on.append(threading.current_thread().name))
    loop.complete(future, torch.ones(3))
    chained.wait()
    assert work.wait() is True and work.is_completed() and work.is_success()
    assert out.tolist() == [1.0, 1.0, 1.0]
    assert [t.tolist() for t in work.get_future().wait()] == [[1.0, 1.0, 1.0]]
    assert ran_on[0].startswith("gradstar-torch-completion")


def test_a_failure_raises_from_wait_and_from_the_future(completions):
    loop = FakeLoop()
    work_of_gradstar, future = loop.work()
    work = GradstarWork([work_of_gradstar], lambda results: results, completions)
    error = CollectiveMismatchError("rank 1 called all_reduce(float32) but rank 0 called "
                                    "all_reduce(float64)", rank=1, field="dtype")
    loop.complete(future, error=error)
    with pytest.raises(CollectiveMismatchError) as raised:
        work.wait()
    assert raised.value is error
    # torch wraps an error raised by a .then() callback; the future is failed, not a value.
    with pytest.raises(RuntimeError, match=r"CollectiveMismatchError: rank 1 called"):
        work.get_future().wait()
    assert not work.is_success() and work.exception() is error


def test_a_callback_that_waits_for_another_collective_does_not_deadlock(completions):
    # What PowerSGD does: inside the callback of one collective, start another and wait for it.
    loop = FakeLoop()
    first_gradstar, first_future = loop.work()
    second_gradstar, second_future = loop.work()
    second = GradstarWork([second_gradstar], lambda results: results[0], completions)
    first = GradstarWork([first_gradstar], lambda results: results[0], completions)

    def callback(fut):
        loop.complete(second_future, "second")  # the "loop" delivers it meanwhile
        second.wait()
        return [fut.value(), second.get_future().wait()]

    chained = first.get_future().then(callback)
    loop.complete(first_future, "first")
    done = threading.Event()
    chained.add_done_callback(lambda _f: done.set())
    assert done.wait(10), "the chained callback never finished"
    assert chained.wait() == ["first", "second"]


def test_results_are_written_exactly_once_when_wait_and_completion_race(completions):
    loop, calls = FakeLoop(), []
    for _ in range(50):
        work_of_gradstar, future = loop.work()
        work = GradstarWork([work_of_gradstar], lambda results: calls.append(1), completions)
        waiter = threading.Thread(target=work.wait)
        waiter.start()
        loop.complete(future, None)
        waiter.join(5)
        work.get_future().wait()
    assert len(calls) == 50


def test_wait_with_a_timeout_leaves_the_collective_running(completions):
    loop = FakeLoop()
    work_of_gradstar, future = loop.work()
    work = GradstarWork([work_of_gradstar], lambda results: "done", completions)
    with pytest.raises(TimeoutError):
        work.wait(timedelta(milliseconds=20))
    assert not work.is_completed()
    loop.complete(future, None)
    assert work.wait() is True and work.result() == "done"


def test_the_future_is_handed_out_at_once_while_another_thread_waits(completions):
    loop = FakeLoop()
    work_of_gradstar, future = loop.work()
    work = GradstarWork([work_of_gradstar], lambda results: "done", completions)
    waiter = threading.Thread(target=work.wait, name="waits")
    waiter.start()
    try:
        for _ in range(5000):  # until the waiter holds the settle lock (blocked in its wait)
            if work._lock.locked():
                break
            threading.Event().wait(0.001)
        assert work._lock.locked()
        handed = []
        asker = threading.Thread(target=lambda: handed.append(work.get_future()))
        asker.start()
        asker.join(2)
        assert handed and not handed[0].done(), "get_future() waited for the collective"
    finally:
        loop.complete(future, None)
        waiter.join(5)
    assert handed[0].wait() == "done"


def test_a_work_settled_here_makes_its_future_only_when_asked(completions):
    out = torch.zeros(3)
    work = GradstarWork([SettledWork(torch.ones(3))],
                        lambda results: [out.copy_(results[0])], completions, settled=True)
    assert work.is_completed() and out.tolist() == [1.0, 1.0, 1.0]  # written at construction
    assert work._future is None
    future = work.get_future()
    assert future.done() and future is work.get_future()
    assert [t.tolist() for t in future.wait()] == [[1.0, 1.0, 1.0]]
    error = CollectiveMismatchError("ranks disagree", rank=1, field="dtype")
    failed = GradstarWork([SettledWork(error=error)], lambda results: results, completions,
                          settled=True, label="[Rank 0] ")
    with pytest.raises(CollectiveMismatchError, match=r"^\[Rank 0\] ranks disagree"):
        failed.wait()
    with pytest.raises(RuntimeError, match=r"\[Rank 0\] ranks disagree"):
        failed.get_future().wait()
    assert not failed.is_success() and completions._threads == []  # no completion thread


def test_a_settled_work_carries_its_value_or_its_collective_s_error(completions):
    out = torch.ones(3)
    work = GradstarWork.from_settled(SettledWork(out.numpy()), [out], completions,
                                     label="[Rank 1] ")
    assert work.is_completed() and work.is_success() and work.wait() is True
    assert work.result() == [out] and work.exception() is None and work._future is None
    future = work.get_future()
    assert future.done() and future is work.get_future() and future.wait()[0] is out
    assert repr(work) == "GradstarWork(done, 1 gradstar collective(s))"
    error = CollectiveMismatchError("ranks disagree", rank=0, field="shape")
    failed = GradstarWork.from_settled(SettledWork(error=error), [out], completions,
                                label="[Rank 1] ")
    assert failed.is_completed() and not failed.is_success()
    with pytest.raises(CollectiveMismatchError, match=r"^\[Rank 1\] ranks disagree"):
        failed.wait()
    with pytest.raises(RuntimeError, match=r"\[Rank 1\] ranks disagree"):
        failed.get_future().wait()
    assert str(error) == "ranks disagree"  # the caller's error object is not relabelled
    assert completions._threads == []  # settled on this thread: no completion thread


def test_a_work_of_several_collectives_completes_after_the_last(completions):
    loop = FakeLoop()
    pairs = [loop.work() for _ in range(3)]
    work = GradstarWork([w for w, _ in pairs], lambda results: results, completions)
    for _, future in pairs[:2]:
        loop.complete(future, 1)
    assert not work.get_future().done()
    loop.complete(pairs[2][1], 2)
    assert work.get_future().wait() == [1, 1, 2]


def test_abandoning_a_work_whose_loop_is_gone_fails_it_instead_of_hanging(completions):
    work_of_gradstar, _future = FakeLoop().work()  # never completed by anybody
    work = GradstarWork([work_of_gradstar], lambda results: results, completions)
    work.abandon(ProcessGroupClosedError("the group was shut down"))
    with pytest.raises(ProcessGroupClosedError, match=r"^the group was shut down$"):
        work.wait(timedelta(seconds=10))
    with pytest.raises(RuntimeError, match=r"ProcessGroupClosedError"):
        work.get_future().wait()


T = TypeVar("T")


class CudaStandIns:
    """What a Work over CUDA tensors asks of torch, on a machine without CUDA: the future bound
    to devices (a plain future that notes them and, as torch's does, pickles its value to find
    the tensors in it), the device made current and the synchronization of each device, all
    noted in ``events``."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple] = []
        events = self.events

        # Generic like torch's own: torch.futures reads the (patched) name Future[S] in then().
        class DeviceFuture(torch.futures.Future[T]):
            def __init__(self, *, devices=None) -> None:
                events.append(("future", list(devices or [])))
                super().__init__()

            def set_result(self, result) -> None:
                events.append(("complete", torch._jit_internal._extract_tensors(result)))
                super().set_result(result)

        @contextlib.contextmanager
        def device(index):
            events.append(("current", index))
            yield
            events.append(("restored",))

        monkeypatch.setattr(torch.futures, "Future", DeviceFuture)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(work_module, "synchronize", lambda d: events.append(
            ("synchronize", d, threading.current_thread().name)))


CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def done_within(future: torch.futures.Future, seconds: float) -> bool:
    done = threading.Event()
    future.add_done_callback(lambda _f: done.set())
    return done.wait(seconds)


def test_a_work_over_cuda_tensors_synchronizes_them_before_its_future_completes(
        completions, monkeypatch):
    torch_cuda = CudaStandIns(monkeypatch)
    loop, out = FakeLoop(), torch.zeros(3)
    work_of_gradstar, future = loop.work()
    work = GradstarWork([work_of_gradstar], lambda results: [out.copy_(results[0])],
                        completions, devices=[CUDA0, CUDA1])
    loop.complete(future, torch.ones(3))
    assert done_within(work.get_future(), 10)
    assert work.wait() is True and out.tolist() == [1.0] * 3
    made, current, first, second, complete = torch_cuda.events[:5]
    assert made == ("future", [CUDA0, CUDA1]) and current == ("current", CUDA0)
    # Each device's writes are finished, on the completing thread, before the future completes
    # with the output tensors.
    assert [first[:2], second[:2]] == [("synchronize", CUDA0), ("synchronize", CUDA1)]
    assert first[2].startswith("gradstar-torch-completion")
    assert complete[0] == "complete" and complete[1][0] is out


def test_wait_synchronizes_the_devices_itself_when_it_writes_the_results(completions,
                                                                         monkeypatch):
    torch_cuda = CudaStandIns(monkeypatch)
    loop = FakeLoop()
    work_of_gradstar, future = loop.work()
    work = GradstarWork([work_of_gradstar], lambda results: results, completions,
                        devices=[CUDA0])
    threading.Timer(0.2, loop.complete, (future, "result")).start()
    assert work.wait() is True  # settles here, before any completion thread can
    assert ("synchronize", CUDA0, threading.current_thread().name) in torch_cuda.events
    assert done_within(work.get_future(), 10)


def test_a_work_whose_results_fail_to_land_still_finishes_what_it_wrote(completions,
                                                                        monkeypatch):
    torch_cuda = CudaStandIns(monkeypatch)
    loop = FakeLoop()
    work_of_gradstar, future = loop.work()

    def finish(_results):
        raise ConfigurationError("the output has 3 elements, expected 4")

    work = GradstarWork([work_of_gradstar], finish, completions, devices=[CUDA0])
    loop.complete(future, "result")
    with pytest.raises(ConfigurationError, match=r"expected 4$"):
        work.wait()
    assert ("synchronize", CUDA0) in [event[:2] for event in torch_cuda.events]


def test_a_failed_work_over_cuda_tensors_fails_its_future_with_the_collective_s_error(
        completions, monkeypatch):
    CudaStandIns(monkeypatch)
    loop = FakeLoop()
    work_of_gradstar, future = loop.work()
    work = GradstarWork([work_of_gradstar], lambda results: results, completions,
                        devices=[CUDA0])
    error = RankLostError("rank 1 was lost", rank=1)
    error.on_retry = lambda: None  # a field that does not pickle: torch's extraction would fail
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(error)
    loop.complete(future, error=error)
    assert done_within(work.get_future(), 10)
    with pytest.raises(RuntimeError, match=r"RankLostError: rank 1 was lost"):
        work.get_future().wait()
    with pytest.raises(RankLostError):
        work.wait()


def test_completion_threads_grow_while_one_is_blocked_and_stop_on_close():
    threads = CompletionThreads()
    release, second_ran = threading.Event(), threading.Event()
    threads.submit(lambda: release.wait(10))
    threads.submit(second_ran.set)
    assert second_ran.wait(5), "a blocked completion held up the next one"
    release.set()
    threads.close()
    assert all(not t.is_alive() for t in threads._threads)
    ran = []
    threads.submit(lambda: ran.append(1))  # after close: inline, never lost
    assert ran == [1]


# -- registration ------------------------------------------------------------------------------


IMPORT_GRADSTAR_FIRST = """
import sys
import gradstar
assert "torch" not in sys.modules, "import gradstar imported torch"
import torch.distributed as dist
"""
IMPORT_TORCH_FIRST = """
import torch.distributed as dist
import gradstar
"""
REGISTERED = """
from torch.distributed.rendezvous import _rendezvous_handlers
assert "gradstar" in dist.Backend.backend_list
assert "gradstar" in _rendezvous_handlers
assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # took no device from gloo
assert dist.Backend.default_device_backend_map["cuda"] == "nccl"  # nor from NCCL
assert dist.Backend.backend_capability["gradstar"] == ["cpu", "cuda"]
print("ok")
"""


@pytest.mark.parametrize("imports", [IMPORT_GRADSTAR_FIRST, IMPORT_TORCH_FIRST],
                         ids=["gradstar-first", "torch-first"])
def test_import_gradstar_registers_the_backend_in_either_order(imports):
    done = subprocess.run([sys.executable, "-c", imports + REGISTERED], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


class OneReduceGroup(UnreachableGroup):
    """A stand-in gradstar group whose all_reduce hands back a Work the test completes."""

    def __init__(self, loop: FakeLoop) -> None:
        self.loop, self.futures = loop, []

    def all_reduce(self, x, op, *, async_op, timeout, out=None, wire=None):
        work, future = self.loop.work()
        self.futures.append(future)
        return work


def test_an_inference_tensor_is_written_in_place_by_a_completion_thread(completions):
    """Lightning reduces validation metrics made under torch.inference_mode(): the thread that
    settles the Work (not the caller's) writes them in place, which torch allows only in
    inference mode."""
    loop = FakeLoop()
    group = ProcessGroupGradstar(OneReduceGroup(loop), completions)
    with torch.inference_mode():
        metric = torch.ones(3)
        work = group.allreduce([metric])
    settled = work.get_future().then(lambda f: None)
    loop.complete(group.gradstar_group.futures[0], torch.full((3,), 2.0))
    settled.wait()  # the completion thread settled it, before wait() below
    assert work.wait() is True
    assert metric.tolist() == [2.0, 2.0, 2.0]
