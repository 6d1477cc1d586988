"""Engines sharing one step thread get equal time on it, whatever their steps take; one that
arrives late is owed nothing for the time before; a cancelled wait hands the turn on."""

from __future__ import annotations

import asyncio
import time

from tokenloom.engine.step_thread import StepThread


def _busy(seconds: float) -> None:
    time.sleep(seconds)  # a step: the thread is taken for this long


def test_a_slow_and_a_fast_engine_share_the_thread_by_time_not_by_steps():
    thread = StepThread()
    steps: dict[str, int] = {}

    async def main() -> None:
        until = time.perf_counter() + 1.2

        async def engine(key: str, step_s: float) -> None:
            while time.perf_counter() < until:
                await thread.run(key, _busy, step_s, more=lambda: time.perf_counter() < until)
                steps[key] = steps.get(key, 0) + 1
            thread.idle(key)

        await asyncio.gather(engine("fast", 0.005), engine("slow", 0.04))

    asyncio.run(main())
    thread.shutdown()
    fast_s, slow_s = steps["fast"] * 0.005, steps["slow"] * 0.04
    assert 0.7 < fast_s / slow_s < 1.4, steps  # a step each in turn would give 0.125
    assert steps["fast"] > 5 * steps["slow"]


def test_an_engine_that_arrives_late_is_owed_nothing_for_the_time_before():
    thread = StepThread()
    steps: dict[str, int] = {}

    async def main() -> None:
        async def engine(key: str, until: float) -> None:
            while time.perf_counter() < until:
                await thread.run(key, _busy, 0.01, more=lambda: time.perf_counter() < until)
                steps[key] = steps.get(key, 0) + 1
            thread.idle(key)

        first = asyncio.ensure_future(engine("early", time.perf_counter() + 1.0))
        await asyncio.sleep(0.5)
        early_before = steps["early"]
        await engine("late", time.perf_counter() + 0.45)
        steps["early_while_late"] = steps["early"] - early_before
        await first

    asyncio.run(main())
    thread.shutdown()
    assert steps["early_while_late"] > 0.6 * steps["late"], steps  # not starved while the late one catches up


def test_a_cancelled_wait_hands_the_turn_on():
    thread = StepThread()

    async def main() -> list[str]:
        done: list[str] = []

        async def step(key: str, seconds: float) -> None:
            await thread.run(key, _busy, seconds)
            done.append(key)

        holder = asyncio.ensure_future(step("a", 0.2))
        await asyncio.sleep(0.05)
        waiter = asyncio.ensure_future(step("b", 0.01))
        other = asyncio.ensure_future(step("c", 0.01))
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.wait_for(asyncio.gather(holder, other), timeout=5)
        return done

    assert asyncio.run(main()) == ["a", "c"]
    assert thread.running is None and not thread.waiting
    thread.shutdown()


def test_a_thread_kept_for_a_next_step_goes_on_when_that_step_does_not_come():
    thread = StepThread()

    async def main() -> list[str]:
        done: list[str] = []
        await thread.run("b", _busy, 0.1)  # "b" has had the thread for 0.1 s, "a" not yet
        first = asyncio.ensure_future(thread.run("a", _busy, 0.05, more=lambda: True))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(thread.run("b", _busy, 0.0))
        second.add_done_callback(lambda _: done.append("b"))
        await first
        assert thread.held and thread.running == "a"  # 0.05 s < b's 0.1 s: "a" keeps it
        await asyncio.sleep(0.05)
        assert not done  # "b" still waits for "a"'s next step
        thread.idle("a")  # which does not come
        await asyncio.wait_for(second, timeout=5)
        return done

    assert asyncio.run(main()) == ["b"]
    thread.shutdown()
