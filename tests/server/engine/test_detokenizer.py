"""Incremental detokenization: stop strings are cut, partial matches and half characters
are held back, and the streamed pieces always add up to the final text."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from llmfleet.server.engine.detokenizer import IncrementalDetokenizer

HALF = 26  # decodes to the first byte of a two-byte character


class LetterDecoder:
    """Token t < 26 is one letter; token 26 is half a character: U+FFFD at the end of the
    text, and it merges into the next token (rendered as nothing) otherwise."""

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(chr(ord("a") + t) for t in ids if t != HALF)
        return text + ("\ufffd" if ids and ids[-1] == HALF else "")


def stream(tokens: list[int], stop: list[str]) -> tuple[list[str], bool]:
    detok = IncrementalDetokenizer(LetterDecoder(), stop)
    pieces = []
    for t in tokens:
        piece, hit = detok.add(t)
        pieces.append(piece)
        if hit:
            return pieces, True
    piece, hit = detok.flush()  # a stop string can end in the text held back (a half character)
    pieces.append(piece)
    return pieces, hit


def test_half_characters_wait_for_the_rest():
    detok = IncrementalDetokenizer(LetterDecoder(), [])
    assert detok.add(0) == ("a", False)
    assert detok.add(HALF) == ("", False)
    assert detok.add(1) == ("b", False)
    assert detok.add(HALF) == ("", False)
    assert detok.flush() == ("\ufffd", False)  # finished mid-character: the client still sees it


def test_a_stop_string_in_the_text_held_back_at_the_end_is_a_hit():
    detok = IncrementalDetokenizer(LetterDecoder(), ["b\ufffd"])
    assert detok.add(0) == ("a", False)
    assert detok.add(1) == ("", False)  # "b" could start the stop string
    assert detok.add(HALF) == ("", False)  # half a character: held
    assert detok.flush() == ("", True) and detok.stopped_by == "b\ufffd" and detok.text == "a"


def test_partial_stop_prefix_is_held_then_released():
    detok = IncrementalDetokenizer(LetterDecoder(), ["cd"])
    assert detok.add(0) == ("a", False)
    assert detok.add(2) == ("", False)  # "c" could start "cd"
    assert detok.add(4) == ("ce", False)  # it did not
    assert detok.add(2) == ("", False)
    assert detok.add(3) == ("", True)  # "cd": cut, excluded
    assert detok.text == "ace"


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, HALF).map(lambda t: t if t == HALF else t % 4), max_size=30),
    stop=st.lists(st.text(alphabet="abcd\ufffd", min_size=1, max_size=4), max_size=3),
)
def test_streamed_text_is_the_full_text_cut_at_the_first_stop(tokens, stop):
    full = LetterDecoder().decode(tokens)
    pieces, hit = stream(tokens, stop)
    streamed = "".join(pieces)
    # the stream stops at the first stop string to complete (not the first to start)
    for end in range(len(full) + 1):
        starts = [i for i in (full[:end].find(s) for s in stop) if i >= 0]
        if starts:
            assert hit and streamed == full[: min(starts)]
            break
    else:
        assert not hit and streamed == full
    # released text never retracted: every prefix of the stream is a prefix of the answer
    assert all("".join(pieces[: k + 1]) == streamed[: len("".join(pieces[: k + 1]))] for k in range(len(pieces)))


def test_text_added_without_stops_is_released_whole_and_never_matched():
    """Before min_tokens: a stop string in that text (even a partial one) does not count later."""
    detok = IncrementalDetokenizer(LetterDecoder(), ["ab", "bc"])
    assert detok.add(0, stops=False) == ("a", False)  # "a" could begin "ab": released anyway
    assert detok.add(1, stops=False) == ("b", False)  # "ab" is there, and does not count
    assert detok.add(2) == ("c", False)  # "bc" began before the stops counted: no match
    assert detok.add(1) == ("", False)  # "b" held back: it may begin "bc"
    assert detok.add(2) == ("", True) and detok.text == "abc"  # and it did


def test_include_stop_keeps_the_stop_string_that_ended_the_text():
    detok = IncrementalDetokenizer(LetterDecoder(), ["cd", "cde"], include_stop=True)
    pieces = [detok.add(t) for t in (0, 1, 2, 3)]  # a b c d
    assert pieces[-1][1] and detok.text == "abcd"
    assert "".join(p for p, _ in pieces) == "abcd"


def test_it_tells_which_stop_string_cut_the_text():  # vLLM's stop_reason
    for include in (False, True):
        detok = IncrementalDetokenizer(LetterDecoder(), ["x", "bc", "d"], include_stop=include)
        hits = [detok.add(t)[1] for t in (0, 1, 2)]  # a b c
        assert hits == [False, False, True] and detok.stopped_by == "bc"
    assert IncrementalDetokenizer(LetterDecoder(), ["x"]).stopped_by is None


class SentencePieceDecoder:
    """A sentencepiece tokenizer's decoding (Llama 2, Mistral): each token is a word with a leading
    "▁" read as a space, and the text's first space is stripped."""

    WORDS = ["▁The", "▁capital", "▁is", "▁Paris", "."]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.WORDS[t] for t in ids).replace("▁", " ").removeprefix(" ")


def test_the_first_word_keeps_its_space_after_the_prompt():
    # vLLM primes its detokenizer with the prompt: " Paris", as in the prompt's text plus the answer's
    decoder = SentencePieceDecoder()
    prompt, answer = [0, 1, 2], [3, 4]
    detok = IncrementalDetokenizer(decoder, [], context=prompt)
    text = "".join(detok.add(t)[0] for t in answer) + detok.flush()[0]
    assert text == " Paris."
    assert decoder.decode(prompt) + text == decoder.decode(prompt + answer)
    alone = IncrementalDetokenizer(decoder, [])  # no prompt (a bare token list): nothing to keep a space after
    assert "".join(alone.add(t)[0] for t in answer) == "Paris."


def _longest_partial(text: str, stop: list[str]) -> int:
    """The held-back tail by definition: the longest end of the text that begins a stop string."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2), max_size=30),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=6), min_size=1, max_size=3),
    unstopped=st.integers(0, 5),
)
def test_exactly_the_tail_that_may_begin_a_stop_string_is_held_back(tokens, stop, unstopped):
    detok = IncrementalDetokenizer(LetterDecoder(), stop)
    released, unheld = "", 0  # text added before min_tokens is released whole
    for i, t in enumerate(tokens):
        piece, hit = detok.add(t, stops=i >= unstopped)
        released += piece
        if hit:
            return
        if i < unstopped:
            unheld = len(detok.text)
        assert released == detok.text[: max(unheld, len(detok.text) - _longest_partial(detok.text, stop))]


class BlockDecoder:
    """Each token is 500 copies of one letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t) * 500 for t in ids)


def test_long_stop_strings_cost_time_linear_in_the_text():
    # 16 stop strings of 15,000 chars held the engine thread for minutes: each token tried every
    # prefix of each (quadratic in their length)
    stop = [chr(ord("b") + i % 8) * 15_000 for i in range(16)]
    detok = IncrementalDetokenizer(BlockDecoder(), stop)
    start = time.perf_counter()
    for _ in range(60):  # 30,000 chars: twice the stop strings' length
        assert detok.add(0) == ("a" * 500, False)
        assert time.perf_counter() - start < 2.0  # about 0.05 s in all; minutes before
