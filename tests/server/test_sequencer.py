from __future__ import annotations

import asyncio

from sidecar.server.sequencer import StepSequencer


def test_a_step_one_ahead_waits_for_its_predecessor_and_nothing_else_waits() -> None:
    async def main() -> list[int]:
        seq = StepSequencer(wait=5.0)
        seq.handed(1)
        order: list[int] = []

        async def step(i: int, delay: float) -> None:
            await asyncio.sleep(delay)
            await seq.turn(i)
            seq.handed(i)
            order.append(i)

        await asyncio.gather(step(3, 0.0), step(2, 0.05))  # 3 is read first, 2 arrives later
        t = asyncio.get_running_loop().time()
        await seq.turn(9)  # not exactly one ahead (a stale or new numbering): no wait
        await seq.turn(None)
        assert asyncio.get_running_loop().time() - t < 0.5
        return order

    assert asyncio.run(main()) == [2, 3]


def test_the_wait_is_bounded() -> None:
    async def main() -> float:
        seq = StepSequencer(wait=0.1)
        seq.handed(1)
        loop = asyncio.get_running_loop()
        t = loop.time()
        await seq.turn(3)  # step 2 never comes: go on after the bound (the ledger answers 409)
        return loop.time() - t

    assert 0.09 <= asyncio.run(main()) < 1.0
