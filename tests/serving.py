"""Test helper: run an engine to completion, checking the page books after every step."""


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
