"""A character-level tokenizer built locally, for the builtin models.

Every character is one token, so rewards that count characters (digits, first letters)
line up exactly with generated tokens, and nothing has to be downloaded.

Vocabulary (ids are fixed; checkpoints depend on them)::

    0 <pad>   1 <bos>   2 <eos>   3 <unk>
    4..29   a-z
    30..55  A-Z
    56..65  0-9
    66      space
    67..82  = + - * / . , : ; ! ? ( ) ' " #

Any other character (a newline, an accented letter) becomes ``<unk>``. No special token is
added when encoding: callers add ``<bos>`` themselves if they want it. Padding goes on the
left, as generation prompts need.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PUNCTUATION = "=+-*/.,:;!?()'\"#"
CHARACTERS: str = (
    string.ascii_lowercase + string.ascii_uppercase + string.digits + " " + PUNCTUATION
)


def char_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids of ``text``'s characters, one token each (a character tokenizer's ids)."""
    ids = tokenizer.convert_tokens_to_ids(list(text))
    return [ids] if isinstance(ids, int) else list(ids)


def char_vocab() -> dict[str, int]:
    """Token string -> id: the special tokens first, then one entry per character."""
    return {token: index for index, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}


def filler_token(index: int) -> str:
    """The name of filler token ``index``: ``<`` + base-26 letters + ``>``, with no digit, so
    that a reward counting digits never counts a filler."""
    letters = ""
    while True:
        index, rest = divmod(index, 26)
        letters = string.ascii_lowercase[rest] + letters
        if index == 0:
            return f"<{letters}>"


def build_char_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """Build the character tokenizer (83 tokens) as a transformers fast tokenizer.

    ``vocab_size`` pads the vocabulary with filler tokens up to that size, so a model with a
    production-sized embedding (32k rows, say) has a tokenizer for every id it can sample.
    Text never encodes to a filler (every character is its own token); a filler decodes to
    its name. The result saves with ``save_pretrained`` and reloads with
    ``AutoTokenizer.from_pretrained`` to the same ids.
    """
    vocab = char_vocab()
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(f"vocab_size {vocab_size} is below the {len(vocab)} character tokens")
        base = len(vocab)
        vocab.update({filler_token(i): base + i for i in range(vocab_size - base)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # "[\s\S]" rather than "." because "." skips newlines; each match is its own piece,
    # so every character (spaces included) becomes one token.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Without a decoder, tokenizers joins tokens with spaces; Fuse concatenates them so
    # "abc=12" decodes back to "abc=12".
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
    )
