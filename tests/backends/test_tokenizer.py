"""The character tokenizer: fixed ids, exact round trips, save and reload."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from flowrl.backends.tokenizer import CHARACTERS, build_char_tokenizer, char_vocab


def test_special_and_character_ids() -> None:
    tokenizer = build_char_tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id) == (0, 1)
    assert (tokenizer.eos_token_id, tokenizer.unk_token_id) == (2, 3)
    # 4 specials + 26 lowercase + 26 uppercase + 10 digits + space + 16 punctuation = 83
    assert len(tokenizer) == 83 == len(char_vocab())
    tokens = ["a", "z", "A", "0", " ", "#"]
    assert tokenizer.convert_tokens_to_ids(tokens) == [4, 29, 30, 56, 66, 82]
    assert len(set(CHARACTERS)) == len(CHARACTERS)


def test_one_token_per_character_and_exact_decode() -> None:
    tokenizer = build_char_tokenizer()
    ids = tokenizer("abc=12")["input_ids"]
    # a b c = 1 2 -> 4 5 6 67 57 58; no <bos>/<eos> added
    assert ids == [4, 5, 6, 67, 57, 58]
    assert tokenizer.decode(ids) == "abc=12"
    assert tokenizer.decode(tokenizer("a b  c")["input_ids"]) == "a b  c"


def test_unknown_characters_become_unk() -> None:
    tokenizer = build_char_tokenizer()
    ids = tokenizer("a\né")["input_ids"]
    assert ids == [4, 3, 3]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a"


def test_special_tokens_are_skipped_on_request() -> None:
    tokenizer = build_char_tokenizer()
    ids = [1, 4, 5, 2, 0, 0]
    assert tokenizer.decode(ids) == "<bos>ab<eos><pad><pad>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_pads_on_the_left() -> None:
    tokenizer = build_char_tokenizer()
    batch = tokenizer(["ab", "abcd"], padding=True)
    assert batch["input_ids"] == [[0, 0, 4, 5], [4, 5, 6, 7]]
    assert batch["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_save_and_reload_give_the_same_ids(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello, World! x=(3*4)/2; 'ok' #9 é"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.padding_side == "left"
    assert reloaded.pad_token_id == 0 and reloaded.eos_token_id == 2
    assert reloaded.decode(reloaded("abc=12")["input_ids"]) == "abc=12"


def test_a_padded_vocabulary_keeps_the_character_ids_and_decodes_fillers_without_digits() -> None:
    from flowrl.backends.tokenizer import build_char_tokenizer, filler_token

    padded = build_char_tokenizer(vocab_size=1000)
    plain = build_char_tokenizer()
    assert len(padded) == 1000
    assert padded("ab=12")["input_ids"] == plain("ab=12")["input_ids"]
    assert [filler_token(i) for i in (0, 25, 26, 27)] == ["<a>", "<z>", "<ba>", "<bb>"]
    assert padded.decode([len(plain), 56]) == "<a>0"  # 56 is the digit 0
    assert not any(ch.isdigit() for ch in padded.decode(list(range(len(plain), 1000))))
