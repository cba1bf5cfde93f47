"""Logprobs in OpenAI's and vLLM's reply shapes: a completion's (tokens, token_logprobs,
top_logprobs, text_offset), with ``echo`` the prompt's first; a chat reply's content entries;
vLLM's prompt_logprobs."""

from __future__ import annotations

import itertools


class LogprobFormat:
    """The shapes for one tokenizer (None: token ids stand for their text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None \
            else str(token_id)

    def completion(self, choice, prompt: tuple | None = None) -> dict | None:
        """A completion choice's logprobs; ``prompt`` (ids, per-token entries, whether the
        completion's own tokens follow) puts the prompt's first, as ``echo`` does: its first
        token has none."""
        entries = []
        if prompt is not None:
            ids, prompt_entries, generated = prompt
            entries += [(t, e) for t, e in zip(ids, prompt_entries, strict=True)]
            if not generated:
                choice = None
        if choice is not None:
            if choice.logprobs is None and prompt is None:
                return None
            entries += list(zip(choice.token_ids, choice.logprobs or (), strict=False))
        tokens, lps, tops = [], [], []
        for token_id, entry in entries:
            tokens.append(self.text(token_id))
            lps.append(None if entry is None else entry[token_id].logprob)
            tops.append(None if entry is None else
                        {self.text(t): lp.logprob for t, lp in entry.items()})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": list(itertools.accumulate([0] + [len(t) for t in tokens[:-1]]))}

    def chat(self, choice, top: int) -> dict | None:
        if choice.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(choice.token_ids, choice.logprobs, strict=False):
            text = self.text(token_id)
            others = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]
            content.append({"token": text, "logprob": entry[token_id].logprob,
                            "bytes": list(text.encode()),
                            "top_logprobs": [{"token": self.text(t), "logprob": lp.logprob,
                                              "bytes": list(self.text(t).encode())}
                                             for t, lp in others]})
        return {"content": content}

    def prompt(self, out) -> list | None:
        """vLLM's shape: per prompt token, None for the first, then {id: {logprob, rank,
        decoded_token}} for the token and the k most likely."""
        if out.prompt_logprobs is None:
            return None
        return [None if entry is None else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.text(t)}
            for t, lp in entry.items()} for entry in out.prompt_logprobs]
