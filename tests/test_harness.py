"""The multi-process harness itself: results, failures, deadlines and isolation."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankError, RankTimeout, current_pool_pids, run_on_ranks


def _all_reduce_rank(scale: float) -> float:
    t = torch.tensor([float(dist.get_rank()) * scale])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_sums_over_ranks(world_size: int) -> None:
    expected = float(sum(range(world_size))) * 3.0
    assert run_on_ranks(world_size, _all_reduce_rank, 3.0) == [expected] * world_size


def _identity() -> tuple[int, int, int]:
    return dist.get_rank(), dist.get_world_size(), os.getpid()


def test_results_are_indexed_by_rank_and_workers_are_reused() -> None:
    first = run_on_ranks(4, _identity)
    second = run_on_ranks(4, _identity)
    assert [r[:2] for r in first] == [(rank, 4) for rank in range(4)]
    assert [r[2] for r in first] == [r[2] for r in second]  # same processes, reused


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank one")
    # rank 0 then blocks in a collective that rank 1 never joins
    dist.all_reduce(torch.ones(1))


def test_failing_rank_traceback_reaches_the_test() -> None:
    with pytest.raises(RankError) as info:
        run_on_ranks(2, _raise_on_rank_one, timeout=30)
    message = str(info.value)
    assert "rank(s) [1]" in message
    assert "--- rank 1 traceback ---" in message
    assert "ValueError: deliberate failure on rank one" in message
    assert "_raise_on_rank_one" in message  # the frame, not just the exception text
    assert "Rank(s) [0] had not finished" in message


def _deadlock() -> None:
    # Every rank waits for a message nobody sends.
    peer = (dist.get_rank() + 1) % dist.get_world_size()
    dist.recv(torch.zeros(1), src=peer)


def test_deadlock_times_out_and_next_test_runs_on_healthy_workers() -> None:
    run_on_ranks(2, _identity)  # make sure a warm pool exists
    old_pids = current_pool_pids(2)
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(2, _deadlock, timeout=3)
    elapsed = time.monotonic() - start
    # a 3 s deadline reports, however slow the machine, long before a hang would end
    assert elapsed < 45, f"timeout took {elapsed:.1f}s to report"
    message = str(info.value)
    assert "within its 3 s deadline" in message
    assert "_deadlock" in message  # the stuck rank's stack names the function
    assert run_on_ranks(2, _all_reduce_rank, 1.0) == [1.0, 1.0]
    assert set(current_pool_pids(2)).isdisjoint(old_pids)


def _print_and_fail() -> None:
    print(f"diagnostic line from rank {dist.get_rank()}")
    raise RuntimeError("boom")


def test_rank_output_is_attached_to_failures() -> None:
    with pytest.raises(RankError) as info:
        run_on_ranks(2, _print_and_fail, timeout=30)
    assert "diagnostic line from rank 0" in str(info.value)
    assert "diagnostic line from rank 1" in str(info.value)


def _dirty_state() -> None:
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    dist.new_group(list(range(dist.get_world_size())))


def _observe_state() -> tuple[float, str, int]:
    from torch.distributed import distributed_c10d as c10d

    return torch.rand(1).item(), str(torch.get_default_dtype()), len(c10d._world.pg_map)


def test_no_state_leaks_between_tests() -> None:
    clean = run_on_ranks(2, _observe_state)
    run_on_ranks(2, _dirty_state)
    assert run_on_ranks(2, _observe_state) == clean
    assert clean[0][1] == "torch.float32"


def _unpicklable_result() -> object:
    return lambda: None


def test_unpicklable_result_is_a_clear_error() -> None:
    with pytest.raises(RankError, match="pickle"):
        run_on_ranks(1, _unpicklable_result, timeout=30)


def _die() -> None:
    if dist.get_rank() == 0:
        os._exit(3)
    time.sleep(30)


def test_dead_rank_is_reported() -> None:
    with pytest.raises(RankError, match="rank 0 process died"):
        run_on_ranks(2, _die, timeout=20)
