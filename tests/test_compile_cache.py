"""The persistent compilation cache (`jaxkv.runtime.compile_cache`) and the program store beside
it (`jaxkv.runtime.stored_jit`): a second start of the same model and settings loads every
program from disk (jaxkv's own whole, without tracing them) and compiles none, and generates
the same tokens; a changed model misses; a torn file compiles again; "none" turns both off; a
folder the user gave jax wins over "auto"."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from jaxkv.config import RuntimeConfig
from jaxkv.runtime.compile_cache import default_dir, use_compile_cache
from jaxkv.runtime.stored_jit import program_store, use_program_store


@pytest.fixture
def restore_cache_dir():
    """The process's cache folder as it was before the test."""
    before, store = jax.config.jax_compilation_cache_dir, program_store()
    yield
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()
    use_program_store(store)


_START = """
import json, sys
import jaxkv
from jaxkv.runtime.compiles import count_compiles
cfg = jaxkv.ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
model = jaxkv.random_model(cfg, seed=0)  # (compiled before the LLM turns the cache on)
with count_compiles() as c:
    llm = jaxkv.LLM(model, page_size=4, num_pages=23, max_num_seqs=2, max_model_len=32,
                    max_num_batched_tokens=16, compilation_cache_dir=sys.argv[1])
out = llm.generate(prompt_token_ids=[[5, 6, 7]] * 2, sampling_params=[
    jaxkv.SamplingParams(max_tokens=12, temperature=0),
                                     jaxkv.SamplingParams(max_tokens=12, seed=3, logprobs=2)])
print(json.dumps(dict(programs=len(llm.engine.programs()), count=c.count, hits=c.cache_hits,
                      stored=c.stored, tokens=[o.outputs[0].token_ids for o in out])))
"""


def _start(folder, layers: int = 2) -> dict:
    """A new process that builds an LLM of a tiny model (warming it up) and generates: its
    compile counts and tokens."""
    source = _START.replace("num_layers=2", f"num_layers={layers}")
    run = subprocess.run([sys.executable, "-c", source, str(folder)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_every_program_from_disk(tmp_path):
    folder = tmp_path / "xla"
    first = _start(folder)
    assert first["hits"] == 0 and first["stored"] == 0 and first["count"] >= first["programs"]
    store = folder / "jaxkv-programs"
    assert len(list(store.glob("*.exe"))) >= first["programs"]
    second = _start(folder)  # the same model and settings: every program from disk
    assert second["hits"] == second["count"]  # compiles nothing
    assert second["stored"] >= second["programs"]  # the engine's, neither traced nor lowered
    assert second["count"] + second["stored"] == first["count"]
    assert second["tokens"] == first["tokens"]  # the same programs, so the same tokens

    other = _start(folder, layers=3)  # another model: its programs compiled; from the store
    assert 0 < other["stored"] <= 3  # only the samplers (logits in, tokens out: no model)
    assert other["count"] + other["stored"] == first["count"]

    for path in store.glob("*.exe"):  # torn files: compiled again, with a warning
        path.write_bytes(path.read_bytes()[:100])
    torn = _start(folder)
    assert torn["stored"] == 0 and torn["tokens"] == first["tokens"]
    assert _start(folder)["stored"] == second["stored"]  # (and stored again)

    off = _start("none")
    assert off["hits"] == 0 and off["stored"] == 0
    # (jax.jit compiles a decode loop fed its own outputs apart from one fed host arrays; the
    # store keys both alike)
    assert off["count"] >= first["count"]
    assert off["tokens"] == first["tokens"]


def test_none_turns_off_only_jaxkvs_folder_and_a_users_jax_folder_wins(tmp_path,
                                                                      restore_cache_dir,
                                                                      monkeypatch):
    jax.config.update("jax_compilation_cache_dir", None)
    assert use_compile_cache("none") is None
    assert jax.config.jax_compilation_cache_dir is None
    ours = str(tmp_path / "ours")
    assert use_compile_cache(ours) == ours
    assert use_compile_cache("none") is None  # off again
    assert jax.config.jax_compilation_cache_dir is None
    mine = str(tmp_path / "mine")
    jax.config.update("jax_compilation_cache_dir", mine)
    monkeypatch.delenv("JAXKV_COMPILATION_CACHE_DIR")
    assert use_compile_cache("auto") == mine  # the user configured jax: theirs
    assert program_store() == Path(mine) / "jaxkv-programs"
    assert use_compile_cache("none") == mine  # and jaxkv does not turn theirs off,
    assert program_store() is None  # but keeps no programs in it
    monkeypatch.setenv("JAXKV_COMPILATION_CACHE_DIR", "none")  # the environment's default
    assert use_compile_cache("auto") == mine and program_store() is None  # wins over jax's
    jax.config.update("jax_compilation_cache_dir", None)
    assert use_compile_cache("auto") is None
    monkeypatch.setenv("JAXKV_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert use_compile_cache("auto") == str(tmp_path / "env")
    assert (tmp_path / "env").is_dir()
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.delenv("JAXKV_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("JAXKV_CACHE_DIR", str(tmp_path / "root"))  # jaxkv's cache folder
    assert default_dir() == tmp_path / "root" / "xla"
    assert use_compile_cache("auto") == str(tmp_path / "root" / "xla")
    with pytest.raises(ValueError, match="compilation_cache_dir"):
        RuntimeConfig(compilation_cache_dir=3)
