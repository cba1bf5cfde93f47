"""Test helpers: run an engine to completion, checking the page books after every step; greedy
references and the near-tie rule for comparing greedy tokens across step shapes."""

# Logits differ in their last bits across step shapes (chunking, batch, tensor parallelism);
# fp32 gaps above this are decided the same way whatever the shape.
NEAR_TIE = 1e-4


def drive(engine, limit: int = 5000) -> dict:
    """Steps until no request is unfinished, asserting `Engine.check()` after every step;
    returns the final output of each request that finished (by request id)."""
    final = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check()
    raise AssertionError(f"engine did not finish in {limit} steps")


def greedy_reference(model, prompt, max_tokens: int, n: int = 1, **engine_kw) -> list:
    """(tokens, top-2 logprobs per step) of each sample of one greedy request served alone by
    an Engine(model, **engine_kw): the reference for `assert_same_up_to_near_ties`."""
    from jaxkv import Engine, SamplingParams

    engine = Engine(model, **engine_kw)
    engine.add_request("ref", prompt_token_ids=list(prompt), sampling_params=SamplingParams(
        temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True, logprobs=2))
    return [(c.token_ids, c.logprobs) for c in drive(engine)["ref"].outputs]


def assert_same_up_to_near_ties(tokens, ref, near_tie: float = NEAR_TIE) -> None:
    """Greedy tokens equal the reference's (tokens, logprobs), unless they part at a near-tie
    of its logits (after which they may differ)."""
    ref_tokens, ref_logprobs = ref
    assert len(tokens) == len(ref_tokens), (tokens, ref_tokens)
    for j, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)):
        if a != b:
            second, first = sorted(v.logprob for v in ref_logprobs[j].values())[-2:]
            assert first - second < near_tie, (j, tokens, ref_tokens)
            return
