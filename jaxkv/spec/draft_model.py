"""Speculative decoding's ``draft_model`` method: a second, smaller model (or a quantized copy
of the target) that drafts greedily on device, beside the target in the same engine.

The draft keeps its own KV pool with as many pages as the target's and reads and writes it
under the same page ids: a sequence's page table serves both models, so the draft needs no
allocator, no prefix cache and no page books of its own. What it does need is to know which
positions of each sequence its pool holds: the target writes every step's tokens, the draft
only the ones it ran. `DraftModel.held` keeps that count per sequence; a proposal first writes
the positions the draft has not seen (a prompt, a prefix-cache hit, tokens of the target's
decode loops), then drafts. After a verification the count falls back to the tokens accepted
(`DraftModel.settle`); a preempted sequence (new pages) starts from 0.

Page copies (a partly matched prefix page, copy-on-write after an n > 1 fork) run in the
target's pool only. They need none in the draft's: a copy's destination is a page of a
sequence new to the draft (a prefix hit at admission), or of a fork's samples at their first
decode step, before either could speculate (its copies run before the step's launch).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxkv.attention import check_head_dim, check_page_size
from jaxkv.kv import init_state
from jaxkv.model.pretrained import Model, load_pretrained, quantize
from jaxkv.model.quant import QuantScheme
from jaxkv.runtime.batch import build_batch, fit, padding_batch, pow2
from jaxkv.runtime.draft_steps import draft_loop_inputs, make_draft_steps
from jaxkv.runtime.steps import DecodeLoopBatch
from jaxkv.sharding import commit, shard, shard_state
from jaxkv.spec.proposer import DeviceProposer


@dataclasses.dataclass
class TargetCopy(Model):
    """A draft that is the target's weights quantized (``quantization`` without ``model``):
    `Engine.update_params` quantizes the new weights for it too."""


class DraftModelProposer(DeviceProposer):
    reads_every_position = True  # the draft keeps every position's K/V in its own pool

    def load(self, target: Model, *, on_host: bool = False):
        return load_draft(self.config, target, on_host=on_host)

    def drafter(self, runner, max_model_len: int) -> DraftModel:
        if runner.window is not None:
            raise ValueError("Engine: speculative_config method 'draft_model' needs "
                             "window_kv=False (the draft keeps every position's K/V)")
        draft = load_draft(self.config, runner.model, on_host=runner.mesh is not None).model
        return DraftModel(draft, runner, self.k, max_model_len)


def load_draft(spec, target: Model, *, on_host: bool = False):
    """``spec`` (a SpeculativeConfig of method ``draft_model``) with its model loaded as a
    `Model`: from its path, or the target quantized (``model`` None: a `TargetCopy`); as is
    if loaded already. ValueError naming ``speculative_config.model`` or ``.quantization``
    for a draft that cannot serve."""
    draft, quant = spec.model, spec.quantization
    if draft is None:
        if target.quantization is not None:
            raise ValueError("speculative_config.quantization: the target is already "
                             f"quantized ({target.quantization.name}); name the draft's "
                             "weights in speculative_config.model")
        copy = quantize(target, quant)
        draft = TargetCopy(**{f.name: getattr(copy, f.name) for f in dataclasses.fields(copy)})
    elif isinstance(draft, (str, Path)):
        try:
            draft = load_pretrained(draft, dtype=jnp.dtype(target.dtype).name, on_host=on_host,
                                    quantization=quant)
        except (ValueError, OSError) as e:
            raise ValueError(f"speculative_config.model={str(spec.model)!r}: {e}") from None
    elif not isinstance(draft, Model):
        raise ValueError(f"speculative_config.model must be a checkpoint path or a jaxkv.Model,"
                         f" got {type(draft).__name__}")
    elif quant is not None:
        if draft.quantization is None:
            draft = quantize(draft, quant)
        elif draft.quantization.name != QuantScheme.parse(quant).name:
            raise ValueError(f"speculative_config.quantization={quant!r}, but the draft passed "
                             f"is already quantized as {draft.quantization.name!r}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has "
                         f"{draft.config.vocab_size} tokens, the target's "
                         f"{target.config.vocab_size}: a draft must share the target's")
    return dataclasses.replace(spec, model=draft)


class DraftModel:
    """The draft's weights, KV state and programs for one `ModelRunner`, and which positions
    of each sequence its pool holds."""

    def __init__(self, model: Model, runner, k: int, max_model_len: int):
        impl = runner.config.runtime.attention_impl
        try:
            check_page_size(impl, runner.page_size, runner.kv_dtype)
            check_head_dim(impl, model.config.head_dim)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        if model.config.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model: the draft's context is "
                             f"{model.config.max_position_embeddings} tokens, less than "
                             f"max_model_len={max_model_len}")
        self.k, self.mesh = k, runner.mesh
        self.follows_target = isinstance(model, TargetCopy)
        self.model = self._placed(model)
        self.fill, self.propose_on_device = make_draft_steps(model.graphdef, impl, self.mesh, k)
        self._held: dict = {}  # sequence -> (its preemptions, positions the pool holds)
        self.state = self.new_state(runner)

    def _placed(self, model: Model) -> Model:
        return shard(model, self.mesh) if self.mesh is not None else \
            dataclasses.replace(model, params=commit(model.params))

    def follow(self, target: Model) -> None:
        """Drafts with ``target``'s new weights quantized as before (a `TargetCopy` only);
        the pool keeps what it holds (a restart preempts every sequence, which resets it)."""
        if self.follows_target:
            self.model = self._placed(quantize(target, self.model.quantization))

    def new_state(self, runner):
        """A zeroed pool (every page of the target's, in the draft's shape); forgets what
        it held."""
        self._held = {}
        state = init_state(self.model.config, runner.num_pages, runner.page_size,
                           self.model.dtype, runner.kv_cache_dtype)
        return commit(state) if self.mesh is None else shard_state(state, self.mesh)

    def reset(self, runner) -> None:
        """A zeroed pool (after a failure lost the old one, with the target's)."""
        self.state = self.new_state(runner)

    def held(self, seq) -> int:
        """Positions of ``seq`` whose K/V the draft's pool holds (0 once it was preempted: its
        pages changed)."""
        got = self._held.get(seq)
        return got[1] if got is not None and got[0] == seq.num_preemptions else 0

    def wrote(self, seq, end: int) -> None:
        """Records that the pool holds positions [0, end) of ``seq``."""
        self._held[seq] = (seq.num_preemptions, end)

    def settle(self, seq, computed: int) -> None:
        """After a verification: the pool holds no more of ``seq`` than its ``computed``
        tokens (the rejected drafts' K/V is stale)."""
        if seq in self._held:
            n, held = self._held[seq]
            self._held[seq] = (n, min(held, computed))
            if seq.finish_reason is not None:
                del self._held[seq]

    def propose(self, runner, rows):
        """Drafts for ``rows`` (decode `ScheduledRow`s, pages and tables set by the target's
        batch): i32[K, R] device tokens, row i's first ``num_draft`` meaningful. A row
        without drafts runs only its pending token, and its books stay as they were (its
        output is never read: a row that does not speculate is not filled)."""
        for seq in [s for s in self._held if s.finish_reason is not None]:
            del self._held[seq]
        r = fit(len(rows), runner.row_buckets)
        span = self.k + 1  # unseen tokens (the pending one included) a proposal takes
        chunks, heads = [], []
        for row in rows:
            seq, n = row.request, row.start
            held, lo = self.held(seq), max(0, n + 1 - span)
            if not row.num_draft:
                held = lo = n
            elif held < lo:
                chunks.append((row, held, lo))
            lo = min(max(lo, held), n)
            heads.append(dataclasses.replace(row, tokens=(*seq.token_ids[lo:n], row.tokens[0]),
                                             start=lo, num_draft=0))
            if row.num_draft:
                self.wrote(seq, n + row.num_draft)
        self._fill(runner, chunks)
        batch = build_batch(heads, runner.page_table, tokens_bucket=pow2(r * span))
        last = np.zeros(r, np.int32)
        loop = self.loop_inputs(runner, r)
        for i, row in enumerate(heads):
            last[i] = batch.cu_q_lens[row.slot + 1] - 1
            loop.positions[i] = row.start + len(row.tokens)
            loop.limit[i] = rows[i].num_draft - 1
            loop.live[i] = loop.limit[i] > 0
            loop.page_table[i] = runner.page_table.table[row.slot]
        out, self.state = self.propose_on_device(self.model.params, self.state, batch, last,
                                                 loop)
        return out

    def _fill(self, runner, chunks) -> None:
        """Writes the draft's K/V of (row, lo, hi): positions [lo, hi) of each row's sequence,
        in batches of at most the largest token bucket."""
        most, batch, room = runner.token_buckets[-1], [], runner.token_buckets[-1]
        pending = [(row, lo, hi) for row, lo, hi in chunks]
        while pending:
            row, lo, hi = pending.pop(0)
            take = min(hi - lo, room)
            ids = row.request.token_ids
            batch.append(dataclasses.replace(row, tokens=tuple(ids[lo:lo + take]), start=lo,
                                             num_draft=0))
            room -= take
            if lo + take < hi:
                pending.insert(0, (row, lo + take, hi))
            if room == 0 or not pending:
                total = sum(len(b.tokens) for b in batch)
                self.state = self.fill(self.model.params, self.state, build_batch(
                    batch, runner.page_table, tokens_bucket=fit(total, runner.token_buckets)))
                batch, room = [], most

    def loop_inputs(self, runner, r: int) -> DecodeLoopBatch:
        """The draft loop's inputs for r idle rows."""
        return draft_loop_inputs(r, runner.max_pages_per_seq, max(1, self.k - 1))

    def warm(self, runner, r: int):
        """Compiles the proposal for r rows and every fill bucket (padding: writes nothing);
        returns the proposal's drafts (i32[K, R])."""
        for t in runner.token_buckets if r == runner.row_buckets[0] else ():  # (once)
            self.state = self.fill(self.model.params, self.state,
                                   padding_batch(t, runner.page_table))
        batch = padding_batch(pow2(r * (self.k + 1)), runner.page_table)
        out, self.state = self.propose_on_device(self.model.params, self.state, batch,
                                                 np.zeros(r, np.int32),
                                                 self.loop_inputs(runner, r))
        return out
