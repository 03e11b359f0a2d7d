"""`python sample.py`: load a checkpoint, continue a prompt, print (or stream) the samples.

`main(cfg)` is the entry point's whole body; `run(cfg)` does the work and raises on user
mistakes, which `main` turns into one `error: ...` line and exit code 2.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import tiktoken
import torch

from base.errors import ConfigError, check, non_negative_int, positive_int, user_errors, user_path
from base.files import read_utf8
from checkpoints.store import Checkpoint, find_checkpoint, load_source
from data.chat import IM_END, bad_message, prompt_within, text_of
from hardware.device import configure_backends, decoding_dtype, quantize_setting, resolve_device
from inference import attention_plot
from inference.generate import (
    SamplingParams,
    TextStream,
    decode_escapes,
    decoding_plan,
    stream_tokens,
)
from model import GPT

SEPARATOR = "---------------"
MESSAGES_FORM = "a list like 'messages=[{role: user, content: \"Hi\"}]', or a JSON file holding one"


def read_prompt(prompt: Any, prompt_file: str | None) -> str:
    """The prompt text, from `prompt` or from a UTF-8 `prompt_file` (not both)."""
    if prompt_file is None:
        return "" if prompt is None else str(prompt)
    if prompt:
        raise ConfigError("give either prompt or prompt_file, not both")
    return read_utf8(Path(prompt_file).expanduser(), "prompt_file")


def write_attention_plot(
    model: GPT, tokenizer: tiktoken.Encoding, ids: list[int], layer: int | None, path: str
) -> None:
    """Draw the prompt's attention probabilities S of `layer` (default the last) to `path`."""
    idx = torch.tensor([ids], dtype=torch.long, device=model.lm_head.weight.device)
    probs = attention_plot.prompt_attention(model, idx, layer)  # refuses a layer out of range
    n_layer, shown = model.config.n_layer, -1 if layer is None else layer
    title = f"Causal attention probabilities S, layer {shown % n_layer} (layers 0 to {n_layer - 1})"
    attention_plot.plot_attention(probs, attention_plot.token_labels(tokenizer, ids), path, title)


def figure_path(key: str, value: Any) -> str | None:
    """attention_plot= and formula=: a file name, true for `<key>.png` here, or null (false)."""
    if value is None or value is False:
        return None
    if value is True:
        return f"{key}.png"
    ok = isinstance(value, str) and value != ""
    return check(key, value, ok, f"a file name like {key}.png, true (for {key}.png) or null")


FORMULA_KEYS = dict(layer="attention_layer", head="formula_head", row="formula_row")


def write_formula(
    model: GPT, tokenizer: tiktoken.Encoding, ids: list[int], cfg: Mapping[str, Any], err: TextIO
) -> None:
    """`formula=<png>`: one head's attention formula step by step, drawn, and the chosen row's
    computation printed; in float32 whatever the sampling dtype, so its numbers add up."""
    if model.lm_head.weight.dtype != torch.float32:
        model = copy.deepcopy(model).float()
    layer = model.config.n_layer - 1 if cfg["attention_layer"] is None else cfg["attention_layer"]
    idx = torch.tensor([ids], dtype=torch.long, device=model.lm_head.weight.device)
    head, row = cfg["formula_head"], cfg["formula_row"]
    view = attention_plot.formula_view(model, idx, layer, head, row, FORMULA_KEYS)
    labels = attention_plot.token_labels(tokenizer, ids)
    attention_plot.plot_formula(view, labels, cfg["formula"])
    print(*attention_plot.row_lines(view, labels), f"wrote {cfg['formula']}", sep="\n", file=err)


def read_messages(value: Any) -> list[dict[str, str]] | None:
    """The one-shot conversation of `messages`: a list (``'messages=[{role: user, content:
    Hi}]'``) or a JSON file holding one; None when not given."""
    if value is None:
        return None
    if isinstance(value, str):
        path = Path(value).expanduser()
        if not path.exists():  # a bare text, most often: say what a conversation looks like
            raise ConfigError(f"messages {value!r} is not a file: give {MESSAGES_FORM}")
        text = read_utf8(path, "messages")
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"messages: {path} is not JSON ({e}): give {MESSAGES_FORM}") from None
        value = value.get("messages") if isinstance(value, dict) else value
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ConfigError(f"messages must be {MESSAGES_FORM}")
    for i, message in enumerate(value):
        if why := bad_message(dict(message) if isinstance(message, Mapping) else message):
            raise ConfigError(f"messages[{i}] is {why}: each is {{role: ..., content: ...}}")
    return [{"role": str(m["role"]), "content": text_of(m["content"])} for m in value]


def decoding_settings(
    cfg: Mapping[str, Any], model: GPT, generator: torch.Generator, err: TextIO
) -> dict[str, Any]:
    """stream_tokens' params, generator, compiled and quantize for `cfg`, with the line that says
    how the tokens are decoded, and why, printed first (where there are any)."""
    compiled, line = decoding_plan(cfg.get("compile", "auto"), model, cfg["max_new_tokens"])
    quantize = cfg.get("quantize")
    if cfg["max_new_tokens"]:
        print(f"{line}; weights in {quantize}" if quantize else line, file=err)
    return {
        "params": cfg["params"], "generator": generator, "compiled": compiled, "quantize": quantize
    }  # fmt: skip


def reply(
    ckpt: Checkpoint,
    model: GPT,
    messages: list[dict[str, str]],
    settings: dict[str, Any],
    shown: TextIO,
) -> str:
    """The model's next turn in `messages`, printed to `shown` as it comes; it ends at
    <|im_end|>, a stop string or max_new_tokens."""
    tokenizer = ckpt.tokenizer()
    ids = prompt_within(messages, tokenizer, model.config.block_size)
    idx = torch.tensor([ids], dtype=torch.long, device=model.lm_head.weight.device)
    end, text = tokenizer.encode_single_token(IM_END), TextStream(tokenizer, settings["stop"])
    decoding = {key: settings[key] for key in ("params", "generator", "compiled", "quantize")}
    steps = stream_tokens(
        model, idx, settings["max_new_tokens"], eot_token=end, vocab_size=tokenizer.n_vocab,
        **decoding,
    )  # fmt: skip
    for step in steps:
        token = step.item()
        print(text.finish() if token == end else text.push(token), end="", file=shown, flush=True)
        if text.done:
            break
    print(text.finish(), file=shown, flush=True)
    return text.text


def converse(
    ckpt: Checkpoint,
    model: GPT,
    settings: dict[str, Any],
    messages: list[dict[str, str]],
    out: TextIO,
    err: TextIO,
    lines: TextIO,
) -> list[str]:
    """The terminal conversation from `messages` (answered first when they end with a user
    turn): a user turn per line read, each reply streamed; the history is kept within the
    context (the oldest turns leave first). An empty line or the end of input ends it (Ctrl-C
    too, with sample.py's exit code 130)."""
    replies = []
    if messages and messages[-1]["role"] == "user":
        replies.append(reply(ckpt, model, messages, settings, out))
        messages.append({"role": "assistant", "content": replies[-1]})
    print("chat: type a message and press Enter; an empty line ends the chat", file=err)
    while True:
        print("> ", end="", file=err, flush=True)
        line = lines.readline()
        if not line:  # the end of input (Ctrl-D): the prompt's line ends too
            print(file=err)
        if not line.strip():
            return replies
        messages.append({"role": "user", "content": line.rstrip("\n")})
        replies.append(reply(ckpt, model, messages, settings, out))
        messages.append({"role": "assistant", "content": replies[-1]})


def chat_replies(
    ckpt: Checkpoint,
    model: GPT,
    cfg: Mapping[str, Any],
    messages: list[dict[str, str]] | None,
    settings: dict[str, Any],
    out: TextIO,
    err: TextIO,
) -> list[str]:
    """`messages=`: their one reply; `chat=true`: the terminal conversation."""
    if not ckpt.chat_template:
        raise ConfigError(
            f"{ckpt.path} is a base model without a chat template: fine-tune it for chat "
            f"first (python train.py experiment=chat_sft train.init_from={ckpt.path})"
        )
    settings = {**settings, **decoding_settings(cfg, model, settings["generator"], err)}
    if not cfg.get("chat"):  # messages alone: their one reply
        return [reply(ckpt, model, messages, settings, out)]
    system = [{"role": "system", "content": cfg["system"]}] if cfg.get("system") else []
    return converse(ckpt, model, settings, messages or system, out, err, sys.stdin)


def sample_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """sample.py's keys checked, cheaply, before a model loads: `cfg` with the sampling params,
    the stop strings decoded, the prompt and messages read, the figures' paths resolved and
    whether it is a chat."""
    params = SamplingParams(**{f.name: cfg[f.name] for f in dataclasses.fields(SamplingParams)})
    num_samples = positive_int("num_samples", cfg["num_samples"])
    stop = cfg["stop"] or []
    stop = [stop] if isinstance(stop, str) else stop  # stop=ro: one string, not 'r' and 'o'
    check("stop", stop, isinstance(stop, Sequence), "a string or a list like '[\"\\n\\n\"]'")
    stream = cfg["stream"]
    check("stream", stream, stream is None or isinstance(stream, bool), "true, false or null")
    prompt = read_prompt(cfg["prompt"], cfg["prompt_file"])
    plots = {key: figure_path(key, cfg.get(key)) for key in ("attention_plot", "formula")}
    compile = cfg.get("compile", "auto")  # .get: as messages
    check("compile", compile, compile in (True, False, "auto"), "true, false or auto")
    quantize_setting(cfg.get("quantize"))
    messages = read_messages(cfg.get("messages"))  # .get: keys newer than a caller's dict
    chat = bool(cfg.get("chat")) or messages is not None
    if chat and (prompt or num_samples > 1 or plots["attention_plot"] or plots["formula"]):
        raise ConfigError(
            "chat=true and messages answer a conversation: drop prompt, prompt_file, "
            "num_samples, attention_plot and formula (they are for continuing text)"
        )
    if messages is not None and cfg.get("system"):
        raise ConfigError(
            "messages is the whole conversation: give its system turn there, not as system="
        )
    return {
        **cfg, **plots, "params": params, "num_samples": num_samples, "prompt": prompt,
        "max_new_tokens": non_negative_int("max_new_tokens", cfg["max_new_tokens"]),
        "seed": non_negative_int("seed", cfg["seed"]), "messages": messages, "chat": chat,
        "stop": [decode_escapes(str(s)) for s in stop],
    }  # fmt: skip


def run(cfg: Mapping[str, Any], out: TextIO | None = None, err: TextIO | None = None) -> list[str]:
    """Sample as configured (see configs/sample.yaml); return the completions (without the
    prompt). Samples go to `out` (stdout), notes to `err` (stderr). A user mistake raises a
    UserError (base/errors.py), which sample.py prints as one line."""
    out, err = out or sys.stdout, err or sys.stderr
    cfg = sample_settings(cfg)  # everything cheap checked before a model loads
    device = resolve_device(str(cfg["device"]))
    configure_backends(device)
    dtype = decoding_dtype(str(cfg["dtype"]), device)
    source = cfg["checkpoint"]
    if source is None:  # train.py's runs only: -m sweeps live under multirun/
        source = find_checkpoint()
        print(f"checkpoint: {source.absolute()} (the newest run under ./outputs)", file=err)
    ckpt = load_source(source, device)
    model = ckpt.model.to(dtype).eval()
    generator = torch.Generator(device=device).manual_seed(cfg["seed"])
    if cfg["chat"]:
        keys = ("params", "stop", "max_new_tokens")
        decoding = {"generator": generator, **{key: cfg[key] for key in keys}}
        return chat_replies(ckpt, model, cfg, cfg["messages"], decoding, out, err)
    return continue_text(model, ckpt.tokenizer(), cfg, generator, out, err)


def continue_text(
    model: GPT,
    tokenizer: tiktoken.Encoding,
    cfg: Mapping[str, Any],
    generator: torch.Generator,
    out: TextIO,
    err: TextIO,
) -> list[str]:
    """The prompt's `num_samples` continuations (`sample_settings`' cfg), streamed to `out` as they
    come where one is shown live; the figures asked for first."""
    prompt, num_samples, stream = cfg["prompt"], cfg["num_samples"], cfg["stream"]
    eot = tokenizer.eot_token
    ids = tokenizer.encode_ordinary(prompt) or [eot]
    block_size = model.config.block_size
    if len(ids) > block_size:
        print(
            f"warning: the prompt has {len(ids)} tokens, more than block_size={block_size}; "
            f"using its last {block_size}",
            file=err,
        )
        ids = ids[-block_size:]
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=generator.device)
    if cfg["attention_plot"]:
        with user_path("attention_plot"):
            write_attention_plot(
                model, tokenizer, ids, cfg["attention_layer"], cfg["attention_plot"]
            )
        print(f"wrote {cfg['attention_plot']}", file=err)
        if len(ids) == 1:
            print(
                "warning: the prompt is one token, so the attention plot has a single cell; "
                "give a longer prompt, e.g. 'prompt=\"To be, or not to be\"'",
                file=err,
            )
    if cfg["formula"]:
        with user_path("formula"):
            write_formula(model, tokenizer, ids, cfg, err)
    live = out.isatty() if stream is None else stream
    if stream and num_samples > 1:
        print(
            "note: stream=true prints one sample as it comes; these are printed at the end",
            file=err,
        )
    live = live and num_samples == 1  # a batch advances all samples at once: print at the end
    shown = out if live else io.StringIO()  # not live: the samples are printed at the end
    texts = [TextStream(tokenizer, cfg["stop"]) for _ in range(num_samples)]
    print(prompt, end="", file=shown, flush=True)
    decoding = decoding_settings(cfg, model, generator, err)
    steps = stream_tokens(
        model, idx, cfg["max_new_tokens"], eot_token=eot, vocab_size=tokenizer.n_vocab, **decoding
    )
    for step in steps:
        for text, token in zip(texts, step.tolist(), strict=True):
            piece = text.finish() if token == eot else text.push(token)
            print(piece, end="", file=shown, flush=True)
        if all(t.done for t in texts):
            break
    for text in texts:
        print(text.finish(), file=shown)
        if not live:
            out.write(prompt + text.text + "\n" + SEPARATOR + "\n")
    out.flush()
    return [t.text for t in texts]


def main(cfg: Mapping[str, Any]) -> int:
    """Run; a user mistake exits 2 with one `error:` line. Returns the exit code."""
    with user_errors():
        try:
            run(cfg)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
    return 0
