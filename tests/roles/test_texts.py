"""Completion texts decoded on the texts thread: rows picked before the decode ends wait on it,
and a rollout leaves its process with plain texts."""

from __future__ import annotations

import pickle
from concurrent.futures import Future

import torch

from flowrl.backends.tokenizer import build_char_tokenizer
from flowrl.roles.batch import Rollout
from flowrl.roles.texts import LaterTexts, decode_rows, token_rows
from tests.tiny_models import text_rollout


def test_picked_rows_wait_for_the_decode_and_then_read_their_own_texts() -> None:
    future: Future[list[str]] = Future()
    texts = LaterTexts(future, 5)
    assert len(texts) == 5 and not texts.done()
    picked = texts.pick([4, 1, 3])
    again = picked.pick([2, 0])  # rows 3 and 4 of the whole
    assert len(again) == 2
    rollout_texts = Rollout(
        prompt_ids=torch.zeros(5, 1, dtype=torch.long), prompt_mask=torch.ones(5, 1, dtype=torch.long),
        completion_ids=torch.zeros(5, 1, dtype=torch.long), completion_mask=torch.ones(5, 1, dtype=torch.long),
        group_size=5, prompts=["p"] * 5, completions=texts, answers=[None] * 5, max_new_tokens=1, temperature=1.0,
    )
    assert rollout_texts.texts_pending() is future
    selected = rollout_texts.select(torch.tensor([0, 2]))
    assert isinstance(selected.completions, LaterTexts) and selected.texts_pending() is future
    future.set_result(["a", "b", "c", "d", "e"])
    assert list(picked) == ["e", "b", "d"]
    assert list(again) == ["d", "e"]
    assert selected.completions == ["a", "c"] and selected.completions[1] == "c"
    assert rollout_texts.texts_pending() is None
    # picked after the decode: from the texts already read
    assert texts.pick([1]) == ["b"]
    assert repr(texts) == repr(["a", "b", "c", "d", "e"])


def test_a_rollout_leaving_its_process_carries_plain_texts() -> None:
    tokenizer = build_char_tokenizer()
    rollout = text_rollout(tokenizer, ["a=", "bb="], ["xy", "z"], 2, 4)
    rows = token_rows(rollout.completion_ids, rollout.completion_mask)
    rollout.completions = LaterTexts.start(tokenizer, rows)
    travelled = pickle.loads(pickle.dumps(rollout))
    assert type(travelled.completions) is list
    assert travelled.completions == ["xy", "z"] == decode_rows(tokenizer, rollout.completion_ids, rollout.completion_mask)



def test_joined_parts_stay_pending_until_every_part_is_decoded() -> None:
    from flowrl.roles.texts import joined

    assert joined([["a"], ["b", "c"]]) == ["a", "b", "c"]
    first: Future[list[str]] = Future()
    together = joined([LaterTexts(first, 2), ["c"]])
    assert isinstance(together, LaterTexts) and len(together) == 3
    first.set_result(["a", "b"])
    assert list(together) == ["a", "b", "c"]


def test_a_decode_that_fails_is_the_producer_s_failure_for_a_peer() -> None:
    import asyncio

    from flowrl.runtime.calls import store_key
    from flowrl.runtime.host import RoleHost, UpstreamFailed

    host = RoleHost("cpu-0", "cpu", torch.get_num_threads(), 0, None, sample_interval_s=60.0)
    tokenizer = build_char_tokenizer()
    rollout = text_rollout(tokenizer, ["a="], ["x"], 1, 2)
    failed: Future[list[str]] = Future()
    failed.set_exception(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"))
    rollout.completions = LaterTexts(failed, 1)
    key = store_key(0, "gen", 0)
    host.store[key] = rollout
    host._event(key).set()
    try:
        asyncio.run(host.fetch(key))
    except UpstreamFailed as error:
        assert str(error).startswith("the completion texts of node 'gen' at step 0 could not be decoded: UnicodeDecodeError")
    else:
        raise AssertionError("the fetch passed a rollout whose texts failed")
