"""The batches that flow between role nodes within one step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.roles.texts import pending, pick


@dataclass
class Rollout:
    """Completions sampled for one step's prompts.

    Rows are grouped by prompt: the ``group_size`` samples of prompt 0 come first, then
    those of prompt 1, and so on; the GRPO advantage relies on this layout.
    Prompts are left-padded and completions right-padded, so every completion starts at
    column ``prompt_ids.shape[1]`` of the joined sequence.
    """

    prompt_ids: torch.Tensor
    """[N, P] token ids, left-padded."""
    prompt_mask: torch.Tensor
    """[N, P] 1 for real prompt tokens."""
    completion_ids: torch.Tensor
    """[N, T] sampled token ids, right-padded after the end-of-sequence token."""
    completion_mask: torch.Tensor
    """[N, T] 1 for generated tokens (end-of-sequence included), 0 for padding."""
    group_size: int
    prompts: list[str]
    completions: Sequence[str]
    """One text per row; on a GPU worker possibly still decoding (``roles.texts``)."""
    answers: list[str | None]
    max_new_tokens: int
    temperature: float
    sampled_logprobs: torch.Tensor | None = None
    """[N, T] log-probabilities of the sampled tokens under the sampling policy."""
    meta: dict[str, Any] = field(default_factory=dict)
    pad_token_id: int = 0
    """The id on padded positions (masked out everywhere; used to pad when joining parts)."""
    data_prompts: list[Any] = field(default_factory=list)
    """Each row's prompt as the data holds it (a chat: its messages); empty: ``prompts``."""
    columns: dict[str, list[Any]] = field(default_factory=dict)
    """Dataset column -> one value per row (what reward functions receive by name)."""
    chat: bool = False
    """The prompts are chats: reward functions see completions as assistant messages."""
    truncated: torch.Tensor | None = None
    """[N] bool: the row ran to ``max_new_tokens`` without a stop token (cut, not finished);
    None: not known."""

    @property
    def num_sequences(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_mask.sum())

    def joined(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input ids, attention mask and position ids of prompt + completion."""
        input_ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1)
        attention_mask = torch.cat([self.prompt_mask, self.completion_mask], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        return input_ids, attention_mask, position_ids

    def select(self, rows: torch.Tensor) -> "Rollout":
        """The sub-batch of the given row indices (for mini-batches)."""
        index = rows.tolist()
        return Rollout(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            group_size=self.group_size,
            prompts=[self.prompts[i] for i in index],
            completions=pick(self.completions, index),
            answers=[self.answers[i] for i in index],
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            sampled_logprobs=None if self.sampled_logprobs is None else self.sampled_logprobs[rows],
            meta=dict(self.meta),
            pad_token_id=self.pad_token_id,
            data_prompts=[self.data_prompts[i] for i in index] if self.data_prompts else [],
            columns={name: [values[i] for i in index] for name, values in self.columns.items()},
            chat=self.chat,
            truncated=None if self.truncated is None else self.truncated[rows],
        )

    def without_rows(self, rows: torch.Tensor) -> "Rollout":
        """The rollout with the completions of rows ``rows`` ([N] bool) masked out: a loss
        and its normaliser leave them out (their forward passes still run, on the prompt)."""
        kept = (~rows.bool()).to(self.completion_mask.dtype)[:, None]
        return dataclasses.replace(self, completion_mask=self.completion_mask * kept)

    def texts_pending(self) -> Future[list[str]] | None:
        """The decode of the completion texts while it still runs (or when it failed)."""
        return pending(self.completions)

    def completion_token_lists(self) -> list[list[int]]:
        """Each row's generated token ids, padding dropped."""
        return [
            [token for token, keep in zip(ids, mask) if keep]
            for ids, mask in zip(self.completion_ids.tolist(), self.completion_mask.tolist())
        ]


@dataclass
class Scores:
    """One scalar reward per rollout row."""

    values: torch.Tensor
    """[N] float32."""
    num_failed: int = 0
    """Rows whose reward function raised or returned no number (scored 0)."""
    num_none: int = 0
    """Rows the reward function returned None for (not applicable; scored 0)."""
    first_error: str | None = None
    """What went wrong with the first failed row, for the run's log."""
    batch_error: str | None = None
    """What the reward function's call on the whole batch raised before each row was scored
    alone (None: it did not)."""

    def messages(self) -> tuple[str, ...]:
        """The run log's lines about this batch: the first failed row's error first."""
        return tuple(message for message in (self.first_error, self.batch_error) if message)


@dataclass
class Advantages:
    """What an advantage node leaves for the update nodes.

    A policy update reads ``advantages`` (``[N]`` or ``[N, T]``); a critic update reads
    ``returns`` as its targets.
    """

    advantages: torch.Tensor
    """``[N]`` (grpo, rloo) or ``[N, T]`` (gae, reinforce_pp) float32, 0 on padding."""
    returns: torch.Tensor | None
    """``[N, T]`` float32 value targets (gae), else None."""
    scores: torch.Tensor
    """``[N]`` summed score of every completion, before any KL penalty."""
    kl: torch.Tensor | None = None
    """``[N, T]`` per-token ``log p_policy - log p_ref`` used for the reward penalty, else None."""
    kl_coef: float = 0.0
    """Coefficient the KL reward penalty had this step (0 = off)."""

    @property
    def token_level(self) -> bool:
        return self.advantages.dim() == 2


@dataclass
class NodeOutput:
    """What a node leaves in its worker's store, plus what the driver is told."""

    value: Any
    metrics: dict[str, float] = field(default_factory=dict)
    tokens_in: int = 0
    """Tokens read: the prompt for generate, completions for a rule-based score, prompt +
    completion for the others."""
    tokens_out: int = 0
    """Tokens produced: completions for generate, one number per completion token for
    reference_logprob and value, 0 for the rest."""
    blocked_s: float = 0.0
    """Time of the call spent blocked on peers (a data-parallel update's collectives)."""
    peak_memory_gb: float = 0.0
    """Most GPU memory allocated by tensors during the call (0 off a GPU)."""
    device_memory_gb: float = 0.0
    """The GPU's whole memory (0 off a GPU)."""
    messages: tuple[str, ...] = ()
    """Things the run's log should say about this call (a reward function's first error)."""
