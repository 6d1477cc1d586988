"""Processors that ban tokens outright, from the request's own history (prompt + output):
`no_repeat_ngram_size` (HF's NoRepeatNGramLogitsProcessor) and `bad_words` (vLLM's words, HF's
NoBadWordsLogitsProcessor's rule). Each finds (row, token) pairs; the processors ban them in place."""

from __future__ import annotations

from collections.abc import Callable

import torch


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each word's token sequences: the word as given (stripped of leading space), and with one
    leading space where that tokenizes differently, so the word is banned at the start of the
    text and after a space. (vLLM keeps the spaced form only when it has as many tokens, which
    lets " favorite", one token where "favorite" is two, through.) A word spelled by other
    tokens still gets through: the ban is on these token sequences, as in HF and vLLM."""
    sequences: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        sequences.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced != plain:
            sequences.append(spaced)
    return [s for s in sequences if s]


def bad_word_bans(histories: list[list[int]], sequences: list[list[list[int]]]) -> tuple[list[int], list[int]]:
    """(rows, tokens) to ban: the last token of every sequence whose other tokens end the row's
    history (a one-token sequence: always)."""
    rows, tokens = [], []
    for row, (history, seqs) in enumerate(zip(histories, sequences)):
        for seq in seqs:
            prefix = seq[:-1]
            if not prefix or (len(history) >= len(prefix) and history[-len(prefix) :] == prefix):
                rows.append(row)
                tokens.append(seq[-1])
    return rows, tokens


def ngram_bans(ids: torch.Tensor, lengths: list[int], n: int) -> tuple[list[int], list[int]]:
    """ids (R, L): each row's history right-aligned after -1 padding, `lengths` its tokens -> (rows,
    tokens) to ban: the tokens that would complete an n-gram already in the row's history (the
    last n - 1 tokens, followed by the token, occurred before). Rows shorter than n - 1: none."""
    L = ids.shape[1]
    if max(n - 1, 1) > L:
        return [], []
    followers = ids[:, n - 1 :]  # (R, L - n + 1) each n-gram's last
    if n == 1:
        match = followers >= 0
    else:
        prefixes = ids.unfold(1, n - 1, 1)[:, : L - n + 1]  # (R, L - n + 1, n - 1)
        tail = ids[:, L - n + 1 :]  # (R, n - 1) the last n - 1 tokens
        long_enough = torch.tensor([length >= n - 1 for length in lengths], device=ids.device)[:, None]
        match = (prefixes == tail[:, None, :]).all(-1) & long_enough
    rows, at = match.nonzero(as_tuple=True)
    return rows.tolist(), followers[rows, at].tolist()
