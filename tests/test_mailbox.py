"""The server's mailbox: events posted from another thread reach their queues in order,
many posts before the loop runs cost it one wake-up, and a closed loop refuses every
post (as call_soon_threadsafe does), never keeping events it cannot deliver."""

import asyncio
import threading

import pytest

from qfuse.serving.mailbox import Mailbox, for_loop


def test_posts_from_a_thread_arrive_in_order_with_one_wake_up_for_a_burst():
    async def main():
        loop = asyncio.get_running_loop()
        box = for_loop(loop)
        assert for_loop(loop) is box  # one per loop
        queues = [asyncio.Queue() for _ in range(3)]
        wakeups = []
        real = loop.call_soon_threadsafe

        def counting(*args):
            wakeups.append(args)
            return real(*args)

        loop.call_soon_threadsafe = counting

        def engine():  # a step's events, posted while the loop waits below
            for i in range(100):
                box.post(queues[i % 3], i)

        t = threading.Thread(target=engine)
        t.start()
        t.join()  # the loop is held here: it runs no delivery while the thread posts
        assert all(q.empty() for q in queues)
        await asyncio.sleep(0)  # the loop runs: one delivery
        got = [[q.get_nowait() for _ in range(q.qsize())] for q in queues]
        assert got == [list(range(r, 100, 3)) for r in range(3)]
        assert len(wakeups) == 1, len(wakeups)  # the loop did not run between the posts

    asyncio.run(main())


def test_a_closed_loop_refuses_every_post():
    loop = asyncio.new_event_loop()
    box = Mailbox(loop)
    loop.close()
    q = asyncio.Queue()
    for _ in range(2):  # the first refusal leaves nothing waiting: the second raises too
        with pytest.raises(RuntimeError):
            box.post(q, "x")
    assert q.empty()
