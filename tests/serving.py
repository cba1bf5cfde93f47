"""Test helpers: run an engine to completion, checking the page books after every step; greedy
references and the near-tie rule for comparing greedy tokens across step shapes; a real
`jaxkv serve` server (uvicorn on 127.0.0.1) in a thread."""

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


MODEL = "tiny-llama"  # the served model name of `Server`


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`build_app(llm, **app_kw)` served by uvicorn on a free port, in a daemon thread, with
    an `openai` client (``api_key`` is what that client sends)."""

    def __init__(self, llm, max_pending=256, api_key="none", **app_kw):
        import threading
        import time

        import openai
        import uvicorn

        from jaxkv.server import build_app

        self.llm = llm
        self.app = build_app(llm, model_name=MODEL, max_pending=max_pending, **app_kw)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        # log_config=None: uvicorn's dictConfig would close pytest's logging handlers
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port,
                                                    log_level="warning", log_config=None))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                                    timeout=120)

    def metrics(self) -> dict[str, float]:
        import re

        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=60).text
        out = {}
        for line in text.splitlines():
            m = re.match(r'^(jaxkv:[a-z_]+)\{model_name="[^"]*"\} ([0-9.e+-]+)$', line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
