"""Train the embedded default model: a tiny Llama on the Python standard library's own source.

Corpus (PSF License 2.0, ships with every Python): the top-level ``*.py`` files of
``sysconfig.get_paths()["stdlib"]`` plus a few pure-Python packages, test folders and files over
200 kB excluded, sorted by path; every 20th file is held out. Pipeline: byte-level BPE tokenizer
-> one token stream (each file framed as ``<|bos|> text <|eos|>``) -> AdamW on random crops,
warmup + cosine decay, under a wall-clock budget -> held-out loss -> a Hugging Face folder
(config, safetensors, tokenizer, generation config, model card, loss curve).

    .venv/bin/python scripts/train_tiny.py [--minutes 12] [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import jaxkv
from jaxkv.model.config import ModelConfig
from jaxkv.model.llama import Llama
from jaxkv.model.loading import save_params
from jaxkv.model.pretrained import DEFAULT_MODEL_DIR
from pallas_kernels.reference import dense_causal_attention

PACKAGES = ("asyncio", "collections", "concurrent", "email", "html", "http", "importlib", "json",
            "logging", "re", "tomllib", "urllib", "wsgiref", "zoneinfo")
MAX_FILE_BYTES = 200_000
HELDOUT_EVERY = 20
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
                 "<|eos|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@dataclasses.dataclass(frozen=True)
class Hparams:
    """Everything that shapes the result; recorded in train_log.json and the model card."""

    vocab_size: int = 4096
    # Small beats big on this budget: hidden 192 / MLP 512 / 6 heads (2.4M params) reached a
    # held-out loss of 4.08 in the same 12 minutes, this size 3.93.
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4  # head_dim 32; on CPU the [B, H, T, T] softmax costs more than the matmuls
    num_kv_heads: int = 2
    seq_len: int = 256
    batch_size: int = 8  # ~2M tokens fit the CPU budget: more, smaller steps learn faster
    peak_lr: float = 3e-3
    final_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0


def corpus_files(stdlib: Path) -> list[Path]:
    """The corpus, in a deterministic order (sorted relative paths)."""
    files = [p for p in stdlib.glob("*.py") if not p.name.startswith("_sysconfigdata")]
    for pkg in PACKAGES:
        files += [p for p in (stdlib / pkg).rglob("*.py")
                  if not any(part.startswith("test") for part in p.relative_to(stdlib).parts)]
    files = [p for p in files if p.stat().st_size <= MAX_FILE_BYTES]
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization); encode adds no special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    ids = [[bos, *e.ids, eos] for e in tok.encode_batch(texts)]
    return np.concatenate([np.asarray(i, np.int32) for i in ids])


def dense_attention(b: int, t: int, sm_scale: float):
    """The model's attention callback for B contiguous sequences of T tokens (no cache)."""
    def attend(layer, q_thd, k_tkd, v_tkd, carry):
        split = lambda x: x.reshape(b, t, *x.shape[1:])  # noqa: E731
        out = dense_causal_attention(split(q_thd), split(k_tkd), split(v_tkd), sm_scale=sm_scale)
        return out.reshape(q_thd.shape), carry
    return attend


def make_loss(graphdef):
    """Mean next-token cross-entropy of a batch i32[B, T+1]."""
    def loss_fn(params, batch_bt):
        model = nnx.merge(graphdef, params)
        b, t = batch_bt.shape[0], batch_bt.shape[1] - 1
        positions_t = jnp.tile(jnp.arange(t, dtype=jnp.int32), b)
        attend = dense_attention(b, t, model.config.sm_scale)
        hidden, _ = model(batch_bt[:, :-1].reshape(-1), positions_t, attend, None)
        logits = model.logits(hidden)
        labels = batch_bt[:, 1:].reshape(-1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss_fn


def make_optimizer(hp: Hparams) -> optax.GradientTransformation:
    """AdamW direction without the learning rate, which the step takes as an argument."""
    def decay_mask(params):  # no weight decay on norm gains
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "norm" not in jax.tree_util.keystr(path), params)
    return optax.chain(optax.clip_by_global_norm(hp.grad_clip),
                       optax.scale_by_adam(*hp.betas),
                       optax.add_decayed_weights(hp.weight_decay, mask=decay_mask))


def learning_rate(hp: Hparams, step: int, progress: float) -> float:
    """Linear warmup, then cosine decay to final_lr_ratio * peak as progress goes 0 -> 1."""
    if step < hp.warmup_steps:
        return hp.peak_lr * (step + 1) / hp.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return hp.peak_lr * (hp.final_lr_ratio + (1 - hp.final_lr_ratio) * cos)


def windows(stream: np.ndarray, seq_len: int, limit: int) -> np.ndarray:
    """Non-overlapping i32[N, seq_len + 1] windows of a stream (held-out evaluation)."""
    n = min(limit, (len(stream) - 1) // seq_len)
    return np.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


def train(hp, args, train_ids, heldout_ids, config):
    """Trains under the step cap and time budget; returns (model, log dict)."""
    model = Llama(config, rngs=nnx.Rngs(hp.seed))
    graphdef, params = nnx.split(model)
    tx = make_optimizer(hp)
    opt_state = tx.init(params)
    loss_fn = make_loss(graphdef)

    @jax.jit
    def step_fn(params, opt_state, batch_bt, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch_bt)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates))
        return params, opt_state, loss

    rng, offsets = np.random.default_rng(hp.seed), np.arange(hp.seq_len + 1)
    budget_s, curve, recent, done = args.minutes * 60, [], [], 0
    t0 = time.perf_counter()
    while done < args.steps and (elapsed := time.perf_counter() - t0) < budget_s:
        # The schedule ends at the step cap or the time budget, whichever comes first.
        lr = learning_rate(hp, done, max(done / args.steps, elapsed / budget_s))
        starts = rng.integers(0, len(train_ids) - hp.seq_len - 1, hp.batch_size)
        batch = jnp.asarray(train_ids[starts[:, None] + offsets])
        params, opt_state, loss = step_fn(params, opt_state, batch, jnp.float32(lr))
        loss, recent, done = float(loss), (recent + [float(loss)])[-20:], done + 1
        if done % args.log_every == 1 or done == args.steps:
            curve.append([done, round(loss, 4)])
            print(f"step {done:5d}  loss {loss:.4f}  lr {lr:.2e}  {time.perf_counter() - t0:5.0f}s",
                  flush=True)
    train_s = time.perf_counter() - t0
    eval_fn = jax.jit(loss_fn)
    held = windows(heldout_ids, hp.seq_len, 128)
    heldout = float(np.mean([eval_fn(params, jnp.asarray(held[i:i + hp.batch_size]))
                             for i in range(0, len(held), hp.batch_size)]))
    log = {"steps": done, "train_seconds": round(train_s, 1),
           "tokens_seen": done * hp.batch_size * hp.seq_len,
           "final_train_loss": round(float(np.mean(recent)), 4),
           "heldout_loss": round(heldout, 4), "heldout_tokens": int(held.size - len(held)),
           "loss_curve": curve}
    return nnx.merge(graphdef, params), log


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    """tokenizer.json + the two small files AutoTokenizer reads beside it."""
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
                "additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>"]}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": 1024, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def model_card(hp, config, log, files, heldout, stdlib, command, sample) -> str:
    """README.md: what the model is, what it was trained on, and how to rebuild it."""
    rel = lambda ps: ", ".join(f"`{p.relative_to(stdlib).as_posix()}`" for p in ps)  # noqa: E731
    c, n = config, config.num_params()
    return f"""---
license: apache-2.0
library_name: jaxkv
pipeline_tag: text-generation
---
# tiny-llama: jaxkv's embedded default model

A {n:,}-parameter Llama that ships inside `jaxkv` so every script and test runs with no download.
It writes Python-looking text; it is a fixture and demo, not a useful model.

- **Corpus**: the CPython {sys.version.split()[0]} standard library source (PSF License 2.0):
  top-level `*.py` of `Lib/` (no `_sysconfigdata*`) and the packages {", ".join(PACKAGES)};
  no test folders, no file over {MAX_FILE_BYTES // 1000} kB; {len(files)} files, sorted by path.
  Every {HELDOUT_EVERY}th file is held out ({len(heldout)} files): {rel(heldout)}.
- **License**: weights and tokenizer Apache-2.0 (as jaxkv), trained on text under the Python
  Software Foundation License Version 2, which permits derivative works.
- **Tokenizer**: byte-level BPE (`tokenizers`, GPT-2 pre-tokenization), vocabulary
  {c.vocab_size}, trained on the training files. Special tokens
  {", ".join(f"`{t}`" for t in SPECIAL_TOKENS)}. `encode` adds no BOS/EOS; each training file
  is framed `<|bos|> text <|eos|>` and crops start anywhere, so prompts need no BOS. The chat
  template renders `<|role|>\\ncontent<|eos|>\\n` per message (markers unseen in training).
- **Architecture**: `LlamaForCausalLM`, {c.num_layers} layers, hidden {c.hidden_size}, SiLU MLP
  {c.intermediate_size}, {c.num_heads} query / {c.num_kv_heads} KV heads (GQA) of dim
  {c.head_dim}, RMSNorm eps {c.rms_norm_eps}, RoPE theta {c.rope_theta:g}, tied embeddings,
  max_position_embeddings {c.max_position_embeddings} (trained on {hp.seq_len}-token crops).
  {n:,} parameters in float32.
- **Training**: optax on CPU, AdamW (betas {hp.betas}, weight decay {hp.weight_decay}, none on
  norms, clip {hp.grad_clip}), peak LR {hp.peak_lr}, {hp.warmup_steps} warmup steps, cosine to
  {hp.final_lr_ratio}x, batch {hp.batch_size} x {hp.seq_len}, seed {hp.seed}: {log["steps"]}
  steps, {log["tokens_seen"]:,} tokens, {log["train_seconds"]:.0f} s of training,
  {log["wall_seconds"]:.0f} s for the whole script.
- **Result**: training loss {log["final_train_loss"]:.3f} (mean of the last 20 steps), held-out
  loss {log["heldout_loss"]:.3f} nats/token on {log["heldout_tokens"]:,} tokens; curve in
  `train_log.json`.
- **Reproduce**: `{command}` (the step cap, not the clock, then ends the schedule, so the
  result matches up to how evenly the original run's steps were timed).

Greedy sample:

```python
{sample}
```
"""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=12.0, help="training time budget")
    parser.add_argument("--steps", type=int, default=100_000, help="step cap")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    args = parser.parse_args(argv)
    hp, start = Hparams(), time.perf_counter()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files(stdlib)
    heldout_files = files[HELDOUT_EVERY // 2::HELDOUT_EVERY]
    train_files = [p for p in files if p not in heldout_files]
    read = lambda ps: [p.read_text(encoding="utf-8", errors="replace") for p in ps]  # noqa: E731
    train_texts, heldout_texts = read(train_files), read(heldout_files)
    tok = train_tokenizer(train_texts, hp.vocab_size)
    train_ids, heldout_ids = token_stream(tok, train_texts), token_stream(tok, heldout_texts)
    print(f"{len(files)} files, {sum(map(len, train_texts)):,} chars -> {len(train_ids):,} "
          f"train / {len(heldout_ids):,} held-out tokens ({time.perf_counter() - start:.0f}s)")

    config = ModelConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=hp.hidden_size,
        intermediate_size=hp.intermediate_size, num_layers=hp.num_layers,
        num_heads=hp.num_heads, num_kv_heads=hp.num_kv_heads,
        head_dim=hp.hidden_size // hp.num_heads, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=1024, tie_word_embeddings=True, model_type="llama",
        bos_token_id=tok.token_to_id("<|bos|>"), eos_token_ids=(tok.token_to_id("<|eos|>"),))
    print(f"{config.num_params():,} parameters")
    model, log = train(hp, args, train_ids, heldout_ids, config)

    args.out.mkdir(parents=True, exist_ok=True)
    save_params(model, args.out)
    save_tokenizer(tok, args.out)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids[0],
                  "pad_token_id": tok.token_to_id("<|pad|>"), "do_sample": False}
    (args.out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    reloaded = jaxkv.load_pretrained(args.out)  # also checks the saved folder end to end
    greedy = jaxkv.SamplingParams(temperature=0, max_tokens=48)
    prompt = "def fibonacci(n):"
    sample = prompt + reloaded.decode(jaxkv.generate(reloaded, [prompt], greedy)[0])
    print(sample)
    log = {"wall_seconds": round(time.perf_counter() - start, 1), **log,
           "hparams": dataclasses.asdict(hp), "corpus_files": len(files)}
    command = f".venv/bin/python scripts/train_tiny.py --steps {log['steps']} --minutes 60"
    (args.out / "README.md").write_text(
        model_card(hp, config, log, files, heldout_files, stdlib, command, sample))
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps({k: v for k, v in log.items() if k != "loss_curve"}))


if __name__ == "__main__":
    main()
