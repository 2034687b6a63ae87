"""Completion texts of a rollout: decoded at once, or on a thread beside the compute thread.

On a GPU worker the node after generation (the reference pass, an update) needs the token ids
only; the texts are for score nodes, which mostly run on a CPU slot of their own. Decoding
every completion (256 rows of 256 tokens: about 10 ms of host time) would hold back that next
node. There the generate node hands over :class:`LaterTexts`: the texts decode on the
``flowrl-texts`` thread while the compute thread goes on, and reading them waits for them. A
peer's fetch of the rollout waits for them without blocking the worker's event loop
(``runtime.host``), and a pickled rollout carries a plain list. On CPU slots the texts are
decoded at once: a second thread there would take a core from the next node.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, overload

import torch

_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-texts")


def token_rows(completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[list[int]]:
    """Each completion's kept token ids (host tensors in, plain lists out)."""
    lengths = completion_mask.sum(dim=1)
    width = completion_mask.shape[1]
    if bool((completion_mask.bool() == (torch.arange(width) < lengths[:, None])).all()):
        # right padding only (what generation gives): a row's tokens are its first `length`
        return [ids[:length] for ids, length in zip(completion_ids.tolist(), lengths.tolist())]
    return [[token for token, keep in zip(ids, mask) if keep]
            for ids, mask in zip(completion_ids.tolist(), completion_mask.tolist())]


def decode_rows(tokenizer: Any, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
    """Each completion's text (its kept tokens, special tokens skipped)."""
    return decode_texts(tokenizer, token_rows(completion_ids, completion_mask))


def decode_texts(tokenizer: Any, rows: list[list[int]]) -> list[str]:
    """``tokenizer.batch_decode(rows, skip_special_tokens=True)``; a fast tokenizer's batch goes
    to its Rust backend in one call (``batch_decode`` converts and checks every id in Python
    first: most of its time for 256 rows of 256 tokens). The first row decoded both ways must
    agree, else the tokenizer decodes its own way and ``batch_decode`` is used."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not rows:
        return list(tokenizer.batch_decode(rows, skip_special_tokens=True))
    texts = list(backend.decode_batch(rows, skip_special_tokens=True))
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        texts = [tokenizer.clean_up_tokenization(text) for text in texts]
    if texts[0] != tokenizer.decode(rows[0], skip_special_tokens=True):
        return list(tokenizer.batch_decode(rows, skip_special_tokens=True))
    return texts


class LaterTexts(Sequence[str]):
    """The texts of ``count`` rows, decoded on the texts thread; reading one waits for all.

    ``pick`` takes rows without waiting (a micro-batch, a shard), and the picked texts wait
    on the same decode."""

    def __init__(self, future: Future[list[str]], count: int, index: list[int] | None = None) -> None:
        self.future = future
        self._count = count
        self._index = index
        self._texts: list[str] | None = None

    @classmethod
    def start(cls, tokenizer: Any, rows: list[list[int]]) -> LaterTexts:
        """Decode ``rows`` on the texts thread."""
        return cls(_POOL.submit(decode_texts, tokenizer, rows), len(rows))

    def done(self) -> bool:
        return self.future.done()

    def texts(self) -> list[str]:
        """Every text, in row order (waits for the decode)."""
        if self._texts is None:
            decoded = self.future.result()
            self._texts = decoded if self._index is None else [decoded[i] for i in self._index]
        return self._texts

    def pick(self, index: list[int]) -> LaterTexts:
        if self._texts is not None:
            picked = LaterTexts(self.future, len(index))
            picked._texts = [self._texts[i] for i in index]
            return picked
        inner = index if self._index is None else [self._index[i] for i in index]
        return LaterTexts(self.future, len(index), inner)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, item: int) -> str: ...

    @overload
    def __getitem__(self, item: slice) -> list[str]: ...

    def __getitem__(self, item: int | slice) -> str | list[str]:
        return self.texts()[item]

    def __iter__(self) -> Iterator[str]:
        return iter(self.texts())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (LaterTexts, list, tuple)):
            return self.texts() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, so unhashable like one

    def __repr__(self) -> str:
        return repr(self.texts()) if self.done() else f"LaterTexts({self._count} rows, decoding)"

    def __reduce__(self) -> tuple[Any, ...]:
        # a rollout leaving this process carries plain texts
        return (list, (self.texts(),))


def joined(parts: list[Sequence[str]]) -> Sequence[str]:
    """The texts of ``parts`` one after another; still decoding if any part is. The join
    runs on the texts thread after the decodes queued before it, so it never waits on itself."""
    if not any(isinstance(part, LaterTexts) for part in parts):
        return [text for part in parts for text in part]
    return LaterTexts(_POOL.submit(lambda: [text for part in parts for text in part]), sum(len(part) for part in parts))


def pick(texts: Sequence[str], index: list[int]) -> Sequence[str]:
    """Rows ``index`` of ``texts``; texts still decoding stay so."""
    if isinstance(texts, LaterTexts):
        return texts.pick(index)
    return [texts[i] for i in index]


def pending(texts: Sequence[str]) -> Future[list[str]] | None:
    """The decode ``texts`` still wait for, or that failed; None when they are there."""
    if isinstance(texts, LaterTexts) and (not texts.done() or texts.future.exception() is not None):
        return texts.future
    return None
