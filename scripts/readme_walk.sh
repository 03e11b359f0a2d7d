#!/usr/bin/env bash
# Walk the README as a new user would: a clean clone, the README's install command in a fresh
# venv, then train (short budget), sample, serve, evaluate, Ctrl-C and resume, and a sweep, each step
# checking its exit code and its output. Run by .ci/run; takes a few minutes on 2 CPU cores.
#
#   scripts/readme_walk.sh [WORK_DIR]     (default: a new temporary directory)
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-$(mktemp -d)}"
CLONE="$WORK/causalgpt"
export CAUSALGPT_CACHE="$WORK/cache"  # prepare the data from scratch, as on a new machine
export WANDB_MODE=offline HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

step() { printf '\n== %s\n' "$*"; }
fail() { printf 'README walk FAILED: %s\n' "$*" >&2; exit 1; }
expect() {  # expect <file> <extended regex> <what>
    grep -Eq -- "$2" "$1" || { cat "$1"; fail "$3: no match for /$2/ in the output above"; }
}
serve() {  # serve <checkpoint>: python serve.py on a free port, in the background; sets PID, URL
    python serve.py checkpoint="$1" port=0 > serve.out 2>&1 &
    PID=$!
    for _ in $(seq 120); do grep -q '^serving ' serve.out && break; sleep 1; done
    URL=$(sed -nE 's/^serving .* on (http:\S+) .*/\1/p' serve.out)
    [ -n "$URL" ] || { kill "$PID"; cat serve.out; fail "serve.py printed no 'serving ... on http://...' line"; }
}

step "clean clone of $REPO"
if git -C "$REPO" rev-parse --git-dir > /dev/null 2>&1; then
    git clone --quiet "$REPO" "$CLONE"
else  # a checkout without .git (an exported tree): copy it, minus local state
    mkdir -p "$CLONE"
    tar -C "$REPO" --exclude=./.venv --exclude=./outputs --exclude=./multirun -cf - . | tar -C "$CLONE" -xf -
fi
cd "$CLONE"

# The README's quick start, verbatim: the venv, PyTorch (here CI's torch==2.13.0, as .ci/run
# installs it, where the README picks a CPU or GPU build), then the project's install, which
# leaves that torch alone; installing and training / testing are one command each. Under CI
# the venv is .ci/run's, made fresh by the same commands.
VENV='python3 -m venv .venv && . .venv/bin/activate'
INSTALL='pip install -e .'
DEV_INSTALL='pip install -e ".[dev]"'
grep -Fq -- "$VENV" README.md || fail "README lost its venv command"
grep -Fq -- "pip install torch --index-url https://download.pytorch.org/whl/cpu" README.md || fail "README lost its CPU torch command"
grep -Fq -- "$INSTALL && python train.py" README.md || fail "README lost its train command"
grep -Fq -- "$DEV_INSTALL && python -m pytest -q" README.md || fail "README lost its test command"

step "install: $VENV, torch==2.13.0, $INSTALL, then $DEV_INSTALL (openai, for the chat step)"
if [ -n "${VIRTUAL_ENV:-}" ]; then
    # .ci/run built the active venv from scratch with these same commands minutes ago: the
    # README's install runs into it (every requirement already there) without a second
    # download and unpacking of torch. Run alone, the walk makes its own venv.
    echo "into the active venv $VIRTUAL_ENV"
else
    eval "$VENV"
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet torch==2.13.0
fi
eval "python -m pip install --quiet ${INSTALL#pip install }"
eval "python -m pip install --quiet ${DEV_INSTALL#pip install }"
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

SHORT=(model=nano train.max_steps=40 train.eval_interval=20 train.ckpt_interval=20 train.log_interval=10)
# The control-flow steps (Ctrl-C, resume, sweep) use the byte tokenizer: scoring the whole
# validation split through GPT-2's 50k-way softmax costs ~1 min a run on 2 cores.
FAST=(model=nano data.tokenizer=bytes train.log_interval=10)

step "python train.py (short budget)"
python train.py "${SHORT[@]}" hydra.run.dir=runs/walk > train.out 2>&1 || { cat train.out; fail "train.py exited $?"; }
expect train.out '^done: 40 steps' "train.py"
expect train.out '"val_bpb": [0-9.]+' "train.py's summary"
test -f runs/walk/checkpoints/last/manifest.json || fail "no last checkpoint"
test -f runs/walk/checkpoints/best/manifest.json || fail "no best checkpoint"
if grep -Eiq 'warn|deprecat|traceback' train.out; then cat train.out; fail "train.py printed a warning"; fi

step "python sample.py"
python sample.py checkpoint=runs/walk 'prompt="**ROMEO**"' max_new_tokens=20 > sample.out 2>&1 || { cat sample.out; fail "sample.py exited $?"; }
expect sample.out '^\*\*ROMEO\*\*' "sample.py"
test -s runs/walk/metrics.jsonl && test -s runs/walk/loss.png || fail "no metrics.jsonl or loss.png in the run dir"
SAMPLE=$(sed -n 's/^sample: //p' train.out)  # the printed hint, run from another directory
(cd / && eval "$SAMPLE max_new_tokens=5") > hint.out 2>&1 || { cat hint.out; fail "the printed '$SAMPLE' exited $?"; }

step "python serve.py, and a completion through its API"
serve runs/walk
python -c 'import sys, urllib.request as r; print(r.urlopen(r.Request(sys.argv[1], b"{\"prompt\": \"**ROMEO**\", \"max_tokens\": 5}", {"Content-Type": "application/json"})).read().decode())' \
    "$URL/v1/completions" > completion.out || { kill "$PID"; cat serve.out; fail "the completion failed"; }
kill "$PID"
expect completion.out '"finish_reason": ?"length"' "serve.py's completion"

step "chat: python train.py experiment=chat_sft train.init_from=<run>, then sample.py chat=true and /v1/chat/completions"
python train.py experiment=chat_sft train.init_from=runs/walk hydra.run.dir=runs/chat train.max_steps=10 \
    train.eval_interval=5 train.final_eval=periodic > chat.out 2>&1 || { cat chat.out; fail "chat SFT exited $?"; }
expect chat.out '^done: 10 steps' "chat SFT"
SAMPLE=$(sed -n 's/^sample: //p' chat.out)  # the printed hint: a conversation, two turns typed
expect chat.out '^sample: .* chat=true$' "chat SFT's sample hint"
printf 'Good morrow, my lord.\nHow now?\n\n' | (cd / && eval "$SAMPLE max_new_tokens=5") > chat_sample.out 2>&1 || { cat chat_sample.out; fail "'$SAMPLE' exited $?"; }
expect chat_sample.out '^chat: type a message' "sample.py chat=true"
serve runs/chat
python -c 'import sys, openai; c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none"); print(c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Good morrow"}], max_tokens=5).choices[0].finish_reason)' \
    "$URL" > chat_completion.out || { kill "$PID"; cat serve.out; fail "the chat completion failed"; }
kill "$PID"
expect chat_completion.out '^(length|stop)$' "serve.py's chat completion"

step "python evaluate.py"
python evaluate.py checkpoint=runs/walk > eval.out 2>&1 || { cat eval.out; fail "evaluate.py exited $?"; }
expect eval.out 'non-overlapping windows' "evaluate.py's method line"
expect eval.out '"bpb": [0-9.]+' "evaluate.py's JSON"

step "python check_causality.py"
python check_causality.py > causal.out 2>&1 || { cat causal.out; fail "check_causality.py exited $?"; }
expect causal.out '^\{"causal": true' "check_causality.py's JSON"
python check_causality.py checkpoint=runs/walk attention=sdpa > causal.out 2>&1 || { cat causal.out; fail "check_causality.py on the checkpoint exited $?"; }
expect causal.out '^\{"causal": true' "check_causality.py's JSON on the checkpoint"
expect train.out '^causality guard: passed' "train.py's guard"

step "Ctrl-C, then resume"
python train.py "${FAST[@]}" train.max_steps=100000 hydra.run.dir=runs/stop > stop.out 2>&1 &
PID=$!
for _ in $(seq 120); do grep -q '^step 10 ' stop.out && break; sleep 1; done
kill -INT "$PID"
set +e; wait "$PID"; CODE=$?; set -e
[ "$CODE" -eq 130 ] || { cat stop.out; fail "Ctrl-C exited $CODE, expected 130"; }
expect stop.out 'Resume with: python /\S*/train\.py hydra\.run\.dir=/\S*runs/stop train\.resume=auto' "the resume hint (absolute paths)"
STOPPED=$(sed -nE 's/^interrupted \(Ctrl-C\) at step ([0-9]+);.*/\1/p' stop.out)
[ -n "$STOPPED" ] || { cat stop.out; fail "no 'interrupted (Ctrl-C) at step N' line"; }
# The printed command as it is (it restores the run's overrides), with a longer budget.
RESUME=$(sed -nE 's/.*Resume with: (.*)$/\1/p' stop.out)
eval "$RESUME train.max_steps=$((STOPPED + 10))" > resume.out 2>&1 || { cat resume.out; fail "resume exited $?"; }
expect resume.out "^resumed from .*runs/stop/checkpoints/last at step $STOPPED\$" "resume"
expect resume.out "^done: $((STOPPED + 10)) steps" "resume"

step "a sweep: python train.py -m optim.lr=1e-3,3e-3"
python train.py -m "${FAST[@]}" train.max_steps=10 optim.lr=1e-3,3e-3 hydra.sweep.dir=runs/sweep > sweep.out 2>&1 || { cat sweep.out; fail "the sweep exited $?"; }
for n in 0 1; do test -f "runs/sweep/$n/checkpoints/last/manifest.json" || fail "sweep run $n has no checkpoint"; done
expect sweep.out '^\| run \| optim.lr \| step \| val loss \| val bpb \|$' "the sweep's table"

step "a user mistake: one line, exit 2"
set +e; python train.py train.batch_size=abc > bad.out 2>&1; CODE=$?; set -e
[ "$CODE" -eq 2 ] || { cat bad.out; fail "a bad override exited $CODE, expected 2"; }
[ "$(wc -l < bad.out)" -eq 1 ] || { cat bad.out; fail "a bad override printed more than one line"; }
expect bad.out '^error: train.batch_size must be a positive integer' "the bad override's message"
set +e; python train.py train.bogus=1 > bad.out 2>&1; CODE=$?; set -e
[ "$CODE" -eq 2 ] && [ "$(wc -l < bad.out)" -eq 1 ] || { cat bad.out; fail "an unknown key: exit $CODE"; }
expect bad.out '^error: unknown config key train.bogus' "the unknown key's message"
[ ! -e outputs ] || fail "a failed attempt left a run dir under outputs/"

printf '\nREADME walk passed (%s)\n' "$WORK"
