"""A host hands a rollout to a peer only once its completion texts are decoded; its own next
node takes the rollout at once."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import torch

from flowrl.roles.batch import Rollout
from flowrl.roles.texts import LaterTexts
from flowrl.runtime.calls import store_key
from flowrl.runtime.host import RoleHost


def test_a_peer_waits_for_the_texts_and_the_host_itself_does_not() -> None:
    host = RoleHost("cpu-0", "cpu", torch.get_num_threads(), 0, None, sample_interval_s=60.0)
    future: Future[list[str]] = Future()
    rows = 2
    rollout = Rollout(
        prompt_ids=torch.ones(rows, 1, dtype=torch.long), prompt_mask=torch.ones(rows, 1, dtype=torch.long),
        completion_ids=torch.ones(rows, 1, dtype=torch.long), completion_mask=torch.ones(rows, 1, dtype=torch.long),
        group_size=rows, prompts=["p"] * rows, completions=LaterTexts(future, rows), answers=[None] * rows,
        max_new_tokens=1, temperature=1.0,
    )
    key = store_key(0, "gen", 0)

    async def scenario() -> None:
        host.store[key] = rollout
        host._event(key).set()
        assert await host._stored(key) is rollout  # the host's own consumer: no wait
        peer = asyncio.ensure_future(host.fetch(key))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not peer.done()
        future.set_result(["x", "y"])
        value = await asyncio.wait_for(peer, timeout=10)
        assert value.texts_pending() is None and value.completions == ["x", "y"]

    asyncio.run(scenario())
