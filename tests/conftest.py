"""Test setup: CPU, strict dtype promotion (silent upcasts are bugs), and shared tiny models."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# No persistent compilation cache unless a test names a folder: a run does not depend on what
# earlier runs left in ~/.cache (tests/test_compile_cache.py checks the cache itself).
os.environ.setdefault("JAXKV_COMPILATION_CACHE_DIR", "none")
# Most of the suite's time is XLA compiling small programs: LLVM's optimizations (level 0, not
# 2) cut that by about a quarter, and a tiny model runs fast enough either way. Processes the
# tests start inherit it. (JAXKV_TEST_XLA_OPT=2 runs the suite as users compile; so do runs on
# a GPU or TPU and the compile checks of `make test-aot`: they judge the code XLA generates.)
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") and \
        os.environ["JAX_PLATFORMS"] == "cpu" and not os.environ.get("JAXKV_AOT"):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_"
                               f"level={os.environ.get('JAXKV_TEST_XLA_OPT', '0')}").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

# One persistent compilation cache per run, shared by its workers and the pytest processes tests
# start (a fresh folder: a run still does not depend on earlier ones): a program that both workers,
# or a test after jax's caches were dropped (below), compile is built once and loaded after.
# jax's cache only: "auto" LLMs keep no programs of their own in it
# (JAXKV_COMPILATION_CACHE_DIR=none above). JAXKV_TEST_COMPILE_CACHE=none: no such cache.
if "JAXKV_TEST_COMPILE_CACHE" not in os.environ:  # the first process of the run: its owner
    import tempfile

    os.environ["JAXKV_TEST_COMPILE_CACHE"] = _SUITE_CACHE_OWNED = tempfile.mkdtemp(
        prefix="jaxkv-test-xla-")
else:
    _SUITE_CACHE_OWNED = None
SUITE_CACHE = os.environ["JAXKV_TEST_COMPILE_CACHE"]
if SUITE_CACHE != "none":
    jax.config.update("jax_compilation_cache_dir", SUITE_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if _SUITE_CACHE_OWNED is not None:
        import shutil

        shutil.rmtree(_SUITE_CACHE_OWNED, ignore_errors=True)


@pytest.fixture(autouse=True)
def _suite_compile_cache():
    """Points jax back at the run's cache after a test that pointed it elsewhere, unbounded: a
    bounded cache (jaxkv bounds the folders it sets) evicts by reading every entry's access-time
    file, which a process writing unbounded does not write."""
    yield
    if SUITE_CACHE != "none" and (jax.config.jax_compilation_cache_dir != SUITE_CACHE
                                  or jax.config.jax_compilation_cache_max_size != -1):
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", SUITE_CACHE)
        jax.config.update("jax_compilation_cache_max_size", -1)
        compilation_cache.reset_cache()

# tests/multidevice needs 8 virtual devices, set before jax initializes: test_scaleout.py
# runs it in a separate process (JAXKV_MULTIDEVICE=1), so this one keeps one device.
collect_ignore = [] if os.environ.get("JAXKV_MULTIDEVICE") else ["multidevice"]
# tests/aot needs the `aot` extra and a process per compile target: `make test-aot` runs it.
if not os.environ.get("JAXKV_AOT"):
    collect_ignore.append("aot")


@pytest.fixture(scope="session")
def tiny_config():
    from jaxkv import ModelConfig

    return ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                       eos_token_ids=(3,))


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    """A random model with sharpened logits, so greedy tokens have clear winners."""

    import jaxkv

    model = jaxkv.random_model(tiny_config, seed=0)
    module = model.module()
    module.embed.set_value(module.embed[...] * 25.0)
    return jaxkv.Model.from_module(module)


@pytest.fixture(scope="session")
def plain_model(tiny_config):
    """The same random model as initialised, without sharpening: its greedy tokens depend on
    the whole context, so KV that is wrong (stale, unfilled, another tenant's) shows in them."""

    import jaxkv

    return jaxkv.random_model(tiny_config, seed=0)


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no map limit to watch
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """XLA:CPU maps each compiled program's code into memory (hundreds of mappings for an
    engine step); a whole test run compiles thousands of programs and would pass Linux's
    per-process limit (vm.max_map_count, 65,530), crashing inside the compiler. Dropping jax's
    compile caches when the count gets high frees them (later tests just recompile)."""
    yield
    if _memory_maps() > 30_000:
        import gc

        jax.clear_caches()
        gc.collect()


FIRST = ("test_scaleout.py", "test_soak.py")  # the longest files (minutes in subprocesses)
# The tiers (pyproject.toml's markers): a file of host tests says so (``pytestmark =
# pytest.mark.host``); these start servers, benchmarks or other processes; the rest builds
# engines in the test's process.
E2E = ("test_server", "test_bench", "test_soak", "test_compile_cache", "test_lm_eval",
       "test_disagg_remote", "test_default_model")
HOST_MARK = "pytestmark = pytest.mark.host"


def pytest_ignore_collect(collection_path, config):
    """`make test-fast` (``-m "host ..."``) does not import the other files: collecting them imports
    transformers and torch, which takes longer than the host tests run."""
    if config.getoption("markexpr").startswith("host") and collection_path.suffix == ".py" and \
            collection_path.name.startswith("test_"):
        return None if HOST_MARK in collection_path.read_text() else True
    return None


def pytest_collection_modifyitems(items):
    """Marks each test with its tier; puts the longest files first, so that `make test`'s two
    workers do not end on one of them while the other idles (stable: every other test keeps
    its order). A test module's SLOW set names parametrized cases that run under `-m slow`."""
    for item in items:
        if item.name in getattr(getattr(item, "module", None), "SLOW", ()):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("host"):
            continue
        name = item.path.name
        tier = ("multidevice" if name == "test_scaleout.py" and "multidevice" in item.name
                else "e2e" if name.startswith(E2E) else "engine")
        item.add_marker(getattr(pytest.mark, tier))
    items.sort(key=lambda item: item.path.name not in FIRST)
