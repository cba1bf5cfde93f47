"""``ngram`` (prompt lookup): the tokens that followed the latest earlier occurrence of a
sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``), in its
prompt and output. Drafted on the host; a sequence with no match runs as a plain decode (and
a step where none matches may run as a decode loop)."""

from __future__ import annotations

from jaxkv.spec.proposer import Proposer


def ngram_drafts(token_ids, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens of
    ``token_ids``, for the largest n in [n_min, n_max] that occurs; [] when none does."""
    ids, size = token_ids, len(token_ids)
    best, best_at = n_min - 1, -1
    for j in range(size - 2, -1, -1):  # candidate ends of an earlier occurrence, latest first
        if ids[j] != ids[-1]:
            continue
        n = 1
        while n < n_max and n <= j and ids[j - n] == ids[size - 1 - n]:
            n += 1
        if n > best:
            best, best_at = n, j + 1
            if n == n_max:
                break
    return list(ids[best_at:best_at + k]) if best_at >= 0 else []


class NgramProposer(Proposer):
    def propose(self, req, most: int) -> tuple[int, ...]:
        c = self.config
        return tuple(ngram_drafts(req.token_ids, most, c.prompt_lookup_min,
                                  c.prompt_lookup_max))
