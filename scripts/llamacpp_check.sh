#!/usr/bin/env bash
# export.py format=gguf checked in llama.cpp itself (not in CI: building llama.cpp takes 15-50
# minutes on 2 cores). For each tokenizer and architecture below, a nano model trained for a few
# steps is exported as GGUF; then llama-tokenize's ids must equal ours on mixed text (accents,
# CJK, emoji, whitespace runs, a literal <|endoftext|>), llama-perplexity's perplexity ours on a
# held-out play (to 1e-4, relative: every logit counts), and llama-simple's greedy continuation
# sample.py's at temperature 0. Then a chat model (chat SFT of the first case's run): llama-server
# applies the GGUF's template to a conversation (/apply-template) as ours renders it, tokenizes
# it (/tokenize) to our ids, and its greedy reply (/completion) is sample.py's chat reply. Prints
# one line per check; exits 1 if any differs.
#
# Get and build llama.cpp: the source vendored in the llama-cpp-python sdist (0.3.36 vendors
# llama.cpp 0c1e57098, the build these results come from: docs/evaluation.md#export):
#   pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/lcp
#   tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
#   cmake -S /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/llamacpp-build \
#     -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
#     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
#   cmake --build /tmp/llamacpp-build --target llama-simple llama-tokenize llama-perplexity \
#     llama-server -j2
# (or a clone of https://github.com/ggml-org/llama.cpp, built the same way).
#
# Usage, from the repository root: scripts/llamacpp_check.sh [llama.cpp's bin dir] [work dir]
#   defaults: /tmp/llamacpp-build/bin, a new temporary directory; the models a work dir already
#   holds are checked again without training them again
set -euo pipefail

BIN=$(realpath "${1:-/tmp/llamacpp-build/bin}")
WORK=$(realpath "${2:-$(mktemp -d)}")
PYTHON=${PYTHON:-python}
TRAIN=(model=nano train.max_steps="${STEPS:-300}" optim.lr=3e-3 train.final_eval=none train.eval_interval=100000)
NEW_TOKENS=40  # with the prompt, within nano's 64 positions (llama.cpp aborts past them)
PROMPT="To be, or not to be"
LLAMA="model.pos_embedding=rope model.norm=rmsnorm model.mlp=swiglu"
GPT2="model.mlp_ratio=2"  # llama.cpp's converter would write 4 * n_embd: the file would not load
CASES=(
  "gpt2 $GPT2"
  "gpt2 $LLAMA"
  "bytes $GPT2 model.bias=false model.tie_embeddings=false"
  "bytes $LLAMA"
  "bpe-1024 $GPT2"
  "bpe-1024 $LLAMA model.bias=false model.tie_embeddings=false"
)
for tool in llama-simple llama-tokenize llama-perplexity llama-server; do
  [[ -x "$BIN/$tool" ]] || { echo "error: no $BIN/$tool; build it as this script's header says" >&2; exit 2; }
done
mkdir -p "$WORK"
printf 'First Citizen:\nBefore we proceed,  hear me speak.\n\n\tCafé naïve Æsop’s ’tis, 1599 & 42\n日本語のテキスト 中文 🙂👨‍👩‍👧 flags 🇫🇷\ntext <|endoftext|> more\n    x**2  # code\n' > "$WORK/text.txt"
"$PYTHON" -c "from data.sources import play_files
open('$WORK/play.txt', 'w', encoding='utf-8').write(play_files()['julius-caesar'].read_text(encoding='utf-8')[:6000].rstrip())"

failed=0
check() {  # check NAME OURS THEIRS
  if [[ "$2" == "$3" ]]; then
    echo "ok    $1"
  else
    failed=1
    printf 'FAIL  %s\n  ours:      %q\n  llama.cpp: %q\n' "$1" "$2" "$3"
  fi
}
# Ours, for checkpoint $1: the ids of text.txt, then the perplexity llama-perplexity computes on
# play.txt with -c 64: chunks of 64 tokens, each scoring its second half
OURS='import sys, torch
from checkpoints.store import load_source
ckpt = load_source(sys.argv[1])
model, tokenizer = ckpt.model.float().eval(), ckpt.tokenizer()
print(tokenizer.encode_ordinary(open(sys.argv[2] + "/text.txt", encoding="utf-8").read()))
ids = tokenizer.encode_ordinary(open(sys.argv[2] + "/play.txt", encoding="utf-8").read())
x = torch.tensor(ids[: len(ids) // 64 * 64]).view(-1, 64)
with torch.no_grad():
    logits = model(x)[0][:, 32:63, : tokenizer.n_vocab]
nll = torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), x[:, 33:].flatten())
print(f"{nll.exp().item():.6f}")'

for case in "${CASES[@]}"; do
  read -r tokenizer options <<< "$case"
  name="$tokenizer $options"
  run="$WORK/$(echo "$name" | tr ' =' '_-')"
  if [[ ! -d "$run/checkpoints/last" ]]; then
    # shellcheck disable=SC2086  # options: one word per override
    "$PYTHON" train.py "${TRAIN[@]}" data.tokenizer="$tokenizer" $options hydra.run.dir="$run" \
      > "$run.train.log" 2>&1 || { echo "error: training failed: $run.train.log" >&2; exit 1; }
  fi
  "$PYTHON" export.py checkpoint="$run" out="$run.gguf" format=gguf overwrite=true > /dev/null
  { read -r ids; read -r ppl; } < <("$PYTHON" -c "$OURS" "$run" "$WORK")
  theirs=$("$BIN/llama-tokenize" -m "$run.gguf" -f "$WORK/text.txt" --no-escape --no-parse-special \
    --ids --log-disable 2> /dev/null || true)  # a file llama.cpp refuses: a FAIL line
  check "ids         $name" "$ids" "$theirs"
  for _ in 1 2 3; do  # llama.cpp logs from a thread: on a busy machine its last line can be lost
    theirs=$("$BIN/llama-perplexity" -m "$run.gguf" -f "$WORK/play.txt" --no-escape -c 64 2>&1 \
      | sed -n 's/.*Final estimate: PPL = \([0-9.]*\).*/\1/p' || true)
    [[ -n "$theirs" ]] && break
  done
  close=$(awk -v a="$ppl" -v b="$theirs" 'BEGIN { d = a - b; print (b > 0 && d * d <= (1e-4 * b) ^ 2) }')
  check "perplexity  $name (ours $ppl, llama.cpp $theirs)" 1 "$close"
  ours=$("$PYTHON" sample.py checkpoint="$run" "prompt=\"$PROMPT\"" temperature=0 \
    max_new_tokens="$NEW_TOKENS" stream=true device=cpu dtype=float32 2> /dev/null)
  theirs=$("$BIN/llama-simple" -m "$run.gguf" -n "$NEW_TOKENS" "$PROMPT" 2> /dev/null || true)
  check "greedy      $name: $(printf %q "${ours#"$PROMPT"}")" "$ours" "$theirs"
done

# Chat: llama-server formats, tokenizes and answers a conversation as we do.
base="$WORK/$(echo "${CASES[0]}" | tr ' =' '_-')"
chat="$WORK/chat"
if [[ ! -d "$chat/checkpoints/last" ]]; then
  "$PYTHON" train.py experiment=chat_sft train.init_from="$base" train.max_steps=50 optim.lr=3e-3 \
    train.final_eval=none train.eval_interval=100000 hydra.run.dir="$chat" > "$chat.train.log" 2>&1 \
    || { echo "error: chat SFT failed: $chat.train.log" >&2; exit 1; }
fi
"$PYTHON" export.py checkpoint="$chat" out="$chat.gguf" format=gguf overwrite=true > /dev/null
printf '[{"role": "system", "content": "This is Hamlet. You are HAMLET, answering HORATIO."}, {"role": "user", "content": "Hail to your lordship! Café 🙂"}]' > "$WORK/messages.json"
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$BIN/llama-server" -m "$chat.gguf" --port "$port" -c 64 > "$chat.server.log" 2>&1 &
server=$!
trap 'kill $server 2> /dev/null' EXIT
THEIRS='import json, sys, time, urllib.request
def post(path, body):
    request = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request))
for _ in range(600):  # until the model is loaded
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health")
        break
    except OSError:
        time.sleep(0.1)
prompt = post("/apply-template", {"messages": json.load(open(sys.argv[2]))})["prompt"]
print(json.dumps(prompt))
print(post("/tokenize", {"content": prompt, "add_special": False, "parse_special": True})["tokens"])
answer = post("/completion", {"prompt": prompt, "n_predict": int(sys.argv[3]), "temperature": 0, "cache_prompt": False})
print(json.dumps(answer["content"]))'
OURS_CHAT='import json, sys
from checkpoints.store import load_source
from data.chat import CHAT_TEMPLATE, generation_prompt
import jinja2
messages = json.load(open(sys.argv[2]))
print(json.dumps(jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)))
print(generation_prompt(messages, load_source(sys.argv[1]).tokenizer()))'
{ read -r their_prompt; read -r their_ids; read -r their_reply; } < <("$PYTHON" -c "$THEIRS" "$port" "$WORK/messages.json" 20)
{ read -r our_prompt; read -r our_ids; } < <("$PYTHON" -c "$OURS_CHAT" "$chat" "$WORK/messages.json")
check "chat template (llama-server /apply-template)" "$our_prompt" "$their_prompt"
check "chat ids      (llama-server /tokenize)" "$our_ids" "$their_ids"
ours=$("$PYTHON" sample.py checkpoint="$chat" messages="$WORK/messages.json" temperature=0 \
  max_new_tokens=20 device=cpu dtype=float32 2> /dev/null)
check "chat greedy   (llama-server /completion): $(printf %q "$ours")" "$(printf %s "$ours" | "$PYTHON" -c 'import json, sys; print(json.dumps(sys.stdin.read()))')" "$their_reply"

[[ $failed == 0 ]] && echo "all equal (work dir: $WORK)"
exit $failed
