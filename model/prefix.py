"""The prefix-token table of record #360's auxiliary loss, built from GPT-2's BPE vocabulary.

prefix[t] = the token whose bytes are the longest proper prefix of token t's bytes, or −1 (the 256
single bytes, <|endoftext|> 50256 and the padding ids). Sorting the byte strings puts a prefix
before everything that extends it, so one pass with a stack of open prefixes finds every answer.
The loss reads prefix[target] (the prefix of the next token).

    python -m model.prefix     # prints a few entries (needs tiktoken's cached GPT-2 BPE)
"""
from __future__ import annotations

import torch
from torch import Tensor


def gpt2_token_bytes() -> dict[bytes, int]:
    """GPT-2's mergeable ranks, bytes → token id (ids 0..50255; EOT is not a byte string)."""
    import tiktoken

    return tiktoken.get_encoding("gpt2")._mergeable_ranks


def build_prefix_table(vocab_size: int, token_bytes: dict[bytes, int] | None = None) -> Tensor:
    """int64 [vocab_size]: the longest proper byte-prefix token of each id, −1 where none."""
    token_bytes = gpt2_token_bytes() if token_bytes is None else token_bytes
    table = torch.full((vocab_size,), -1, dtype=torch.long)
    open_prefixes: list[bytes] = []
    for s in sorted(token_bytes):
        while open_prefixes and not s.startswith(open_prefixes[-1]):
            open_prefixes.pop()
        token = token_bytes[s]
        if open_prefixes and token < vocab_size:
            prefix = token_bytes[open_prefixes[-1]]
            table[token] = prefix if prefix < vocab_size else -1
        open_prefixes.append(s)
    return table


if __name__ == "__main__":
    table = build_prefix_table(50304)
    enc = gpt2_token_bytes()
    by_id = {i: b for b, i in enc.items()}
    for token in (1000, 20000, 40000):
        print(token, by_id[token], "->", int(table[token]), by_id.get(int(table[token])))
    print("tokens with a prefix:", int((table >= 0).sum()))
