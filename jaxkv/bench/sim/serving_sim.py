"""The discrete-event core of `jaxkv bench sim-disagg`: request traces, chips, links, TTFT/TPOT.

Each chip runs steps back to back. A colocated chip is a jaxkv-style continuous-batching engine:
a step takes every running decode (one token each), then prompt chunks under a token budget,
oldest first. Disaggregated, x prefill chips run prompt chunks only and y decode chips decode
only; a finished prompt's KV crosses its prefill chip's link (FIFO: bytes / bandwidth +
latency) before it joins a decode chip. The first token is sent when the prompt finishes
(TTFT); the transfer is part of the gap before the second token (TPOT), as in both papers.
A step's duration comes from a step-time model (`step_models`).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
from collections import deque

import numpy as np

from jaxkv.bench.sim.step_models import StepModel, chunk_pairs

# Workloads: lognormal lengths with the quoted mean (sharegpt) or median (long), sigma assumed.
# sharegpt: mean prompt 161 / output 338 tokens, the vLLM paper's ShareGPT numbers (Kwon et al.,
# SOSP 2023, sec. 6.1). long: median prompt 1020 / output 129, Splitwise's conversation trace
# (Patel et al., ISCA 2024, sec. III).
WORKLOADS = {
    "sharegpt": dict(prompt_mean=161, prompt_sigma=1.0, output_mean=338, output_sigma=1.0),
    "long": dict(prompt_mean=1020 * math.exp(0.5**2 / 2), prompt_sigma=0.5,
                 output_mean=129 * math.exp(0.8**2 / 2), output_sigma=0.8),
}
MAX_PROMPT, MAX_OUTPUT = 4096, 2048

# ---- trace -----------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)  # identity: two requests alike are still two
class Request:
    id: int
    arrival: float
    prompt: int
    output: int
    prefilled: int = 0  # prompt tokens computed
    generated: int = 0  # output tokens sampled
    first_token: float = math.nan
    finish: float = math.nan
    finish_step: int = 0  # decode chip step count at which it has all its tokens


def base_trace(workload: str, n: int, seed: int):
    """(unit-rate arrival times, prompt lengths, output lengths): one draw, scaled per rate, so
    every rate sees the same requests (common random numbers)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    w, rng = WORKLOADS[workload], np.random.default_rng(seed)

    def lengths(mean, sigma, hi):
        mu = math.log(mean) - sigma**2 / 2
        return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 2, hi).astype(int)

    times = np.cumsum(rng.exponential(1.0, n))
    return (times, lengths(w["prompt_mean"], w["prompt_sigma"], MAX_PROMPT),
            lengths(w["output_mean"], w["output_sigma"], MAX_OUTPUT))


def requests_at(base, rate: float) -> list[Request]:
    times, prompts, outputs = base
    return [Request(i, float(t) / rate, int(p), int(o))
            for i, (t, p, o) in enumerate(zip(times, prompts, outputs, strict=True))]


# ---- the simulator ---------------------------------------------------------------------------


class Chip:
    """One chip: ``role`` "colo" (decodes + prompt chunks), "prefill" or "decode"."""

    def __init__(self, sim: Sim, role: str):
        self.sim, self.role = sim, role
        self.waiting: deque[Request] = deque()  # not admitted yet
        self.prefilling: list[Request] = []  # admitted, prompt not done (oldest first)
        self.decoding: set[Request] = set()
        self.finishing: list[tuple[int, int, Request]] = []  # heap by finish_step
        self.ctx = 0  # sum of kv_len over decoding rows at their next step
        self.reserved = 0  # KV tokens held (whole prompt + output, reserved at admission)
        self.steps = 0
        self.busy = False

    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    def _need(self, r: Request) -> int:
        return r.prompt if self.role == "prefill" else r.prompt + r.output

    def _admit(self) -> None:
        sim = self.sim
        while self.waiting:
            r = self.waiting[0]
            rows = len(self.prefilling) + len(self.decoding)
            if rows >= sim.max_seqs or self.reserved + self._need(r) > sim.model.kv_capacity_tokens:
                break
            self.waiting.popleft()
            self.reserved += self._need(r)
            if self.role == "decode":  # its KV arrived: it decodes from the next step
                self._join_decode(r)
            else:
                self.prefilling.append(r)

    def _join_decode(self, r: Request) -> None:
        self.decoding.add(r)
        self.ctx += r.prompt + r.generated
        r.finish_step = self.steps + r.output - r.generated
        heapq.heappush(self.finishing, (r.finish_step, r.id, r))

    def kick(self, now: float) -> None:
        """Starts a step at ``now`` if idle and there is work."""
        if self.busy:
            return
        self._admit()
        n_dec = len(self.decoding)
        budget = self.sim.budget - n_dec
        chunks = []
        for r in self.prefilling:
            if budget <= 0:
                break
            n = min(r.prompt - r.prefilled, budget)
            chunks.append((r, n))
            budget -= n
        if not n_dec and not chunks:
            return
        tokens = n_dec + sum(n for _, n in chunks)
        ctx = self.ctx + sum(r.prefilled + n for r, n in chunks)
        pairs = self.ctx + sum(chunk_pairs(r.prefilled, n) for r, n in chunks)
        dt = self.sim.model.step_time(tokens, n_dec + len(chunks), ctx, pairs)
        self.busy = True
        self.sim.at(now + dt, self._step_done, chunks, n_dec)

    def _step_done(self, now: float, chunks, n_dec: int) -> None:
        self.busy = False
        if n_dec:
            self.steps += 1
            self.ctx += n_dec
            while self.finishing and self.finishing[0][0] <= self.steps:
                _, _, r = heapq.heappop(self.finishing)
                r.generated, r.finish = r.output, now
                self.decoding.remove(r)
                self.ctx -= r.prompt + r.output
                self.reserved -= r.prompt + r.output
        for r, n in chunks:
            r.prefilled += n
            if r.prefilled < r.prompt:
                continue
            self.prefilling.remove(r)
            r.first_token, r.generated = now, 1
            if self.role == "prefill":
                self.reserved -= r.prompt  # freed once sent (the link copies from it: simplified)
                if r.output == 1:
                    r.finish = now
                else:
                    self.sim.send(now, self, r)
            elif r.output == 1:
                r.finish = now
                self.reserved -= r.prompt + r.output
            else:
                self._join_decode(r)
        self.kick(now)


class Sim:
    """One run: requests through ``n_prefill`` + ``n_decode`` chips (or ``n_colo`` colocated)."""

    def __init__(self, model: StepModel, *, n_colo=0, n_prefill=0, n_decode=0, budget=512,
                 max_seqs=256, link_gbs=None):
        if n_colo < 0 or n_prefill < 0 or n_decode < 0 or bool(n_colo) == bool(n_prefill):
            raise ValueError("a config is n_colo > 0 chips, or n_prefill > 0 and n_decode > 0")
        if bool(n_prefill) != bool(n_decode):
            raise ValueError("a disaggregated config needs prefill and decode chips")
        if budget < 1 or max_seqs < 1:
            raise ValueError(f"budget and max_seqs must be >= 1, got {budget}, {max_seqs}")
        self.model, self.budget, self.max_seqs = model, budget, max_seqs
        self.link_bw = (link_gbs or model.link_gbs) * 1e9
        self.colo = [Chip(self, "colo") for _ in range(n_colo)]
        self.prefill = [Chip(self, "prefill") for _ in range(n_prefill)]
        self.decode = [Chip(self, "decode") for _ in range(n_decode)]
        self.link_free = {id(c): 0.0 for c in self.prefill}
        self._events: list = []
        self._seq = 0

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, self._seq, fn, args))
        self._seq += 1

    def transfer_time(self, r: Request) -> float:
        return self.model.kv_bytes_per_token * r.prompt / self.link_bw + self.model.link_latency_s

    def send(self, now: float, chip: Chip, r: Request) -> None:
        """KV of r's prompt over ``chip``'s link (one transfer at a time), then to a decode chip."""
        start = max(now, self.link_free[id(chip)])
        done = start + self.transfer_time(r)
        self.link_free[id(chip)] = done
        self.at(done, self._arrive, min(self.decode, key=Chip.load), r)

    def _arrive(self, now: float, chip: Chip, r: Request) -> None:
        chip.waiting.append(r)
        chip.kick(now)

    def run(self, requests: list[Request]) -> list[Request]:
        front = self.colo or self.prefill
        for r in requests:
            self.at(r.arrival, lambda now, r=r: self._arrive(now, min(front, key=Chip.load), r))
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            fn(t, *args)
        return requests


# ---- metrics ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Result:
    ttft: np.ndarray  # seconds, per request
    tpot: np.ndarray  # seconds per output token after the first (0 for 1-token outputs)

    def attainment(self, ttft_slo: float, tpot_slo: float) -> float:
        return float(np.mean((self.ttft <= ttft_slo) & (self.tpot <= tpot_slo)))


def simulate(model: StepModel, config: str, requests: list[Request], **kw) -> Result:
    n_colo, n_prefill, n_decode = parse_config(config)
    done = Sim(model, n_colo=n_colo, n_prefill=n_prefill, n_decode=n_decode, **kw).run(requests)
    ttft = np.array([r.first_token - r.arrival for r in done])
    tpot = np.array([(r.finish - r.first_token) / max(r.output - 1, 1) for r in done])
    if np.isnan(ttft).any() or np.isnan(tpot).any():
        raise RuntimeError("a request never finished (does one exceed the KV capacity?)")
    return Result(ttft, tpot)


def parse_config(text: str) -> tuple[int, int, int]:
    """"colo4" -> (4, 0, 0); "1p3d" -> (0, 1, 3)."""
    if m := re.fullmatch(r"colo(\d+)", text):
        n = int(m.group(1))
        if n > 0:
            return n, 0, 0
    if m := re.fullmatch(r"(\d+)p(\d+)d", text):
        p, d = int(m.group(1)), int(m.group(2))
        if p > 0 and d > 0:
            return 0, p, d
    raise ValueError(f"config {text!r}: expected colo<N> or <x>p<y>d with N, x, y >= 1")

