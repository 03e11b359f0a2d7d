"""Where the code lines are: the library and entry scripts' code lines per feature.

Run: ``python benchmarks/bench_lines.py``. Lines are counted as ``../shared/tools/loc.py``
counts them (no blank lines, comments or docstrings): whole modules, or the named top-level
functions, classes, constants and methods of a module. A feature's row is what deleting that
feature would save; the last rows are the rest (the core every run needs) and the total, which
equals loc.py's "library+entry". Issue 32 asked for at most 4,300 (nanochat's 4,341 less a
margin); this table shows which features hold the lines above that.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_LIBRARY = {"tests", "benchmarks"}
SKIPPED = {"venv", "outputs", "multirun", "node_modules"}  # as loc.py, with hidden folders
TARGET = 4300

# Code every run calls, whatever it uses, in the modules of features: counted in the rest (the
# core), never in a feature's row. A single process goes through torchrun's plumbing (each
# function returns at once there), every checkpoint load through the model sources' resolver, and
# every text run through the tokenizer chat data would extend (issue 59).
EVERY_RUN = [
    ("hardware/distributed.py", ["DistInfo", "destroy", "barrier", "main_first", "_is_main"]),
    ("hardware/distributed.py", ["_all_reduce", "all_reduce_sum", "all_reduce_max", "from_main"]),
    ("hardware/distributed.py", ["run_on_main", "in_lockstep", "mean_over_ranks"]),
    ("hardware/distributed.py", ["gradient_sync", "clip_grad_norm"]),
    ("checkpoints/store.py", ["GPT2_NAMES", "ACCEPTED", "is_hf_dir"]),
    ("checkpoints/store.py", ["load_source", "_source_checkpoint"]),
    ("data/pipeline.py", ["data_tokenizer", "tokenizer_key"]),
    ("hardware/device.py", ["is_sharded"]),
]

# feature: [(module, the names in it that are the feature, or None for the whole module)]
FEATURES = {
    "the formula step by step: formula_steps, /api/formula, sample.py formula=, the page": [
        ("model/inspection.py", ["formula_steps"]),
        ("inference/attention_plot.py", ["formula_view", "_rounded", "row_lines"]),
        ("inference/attention_plot.py", ["plot_formula", "_wrapped"]),
        ("inference/server.py", ["FormulaRequest", "Server.formula"]),
        ("inference/cli.py", ["write_formula", "FORMULA_KEYS"]),
    ],
    "OpenAI-compatible server, request batching, live attention page": [
        ("serve.py", None),
        ("inference/server.py", None),
        ("inference/batching.py", None),
        ("inference/attention_plot.py", None),
        ("inference/cli.py", ["write_attention_plot", "figure_path"]),  # attention_plot=
        ("model/inspection.py", ["layer_inputs", "heads", "probs", "attention_probs"]),  # views' S
    ],
    "export to transformers and GGUF": [
        ("export.py", None),
        ("checkpoints/export.py", None),
        ("checkpoints/llamacpp.py", None),
    ],
    "GPT-2 / Hugging Face weights in (train.init_from, sample, evaluate)": [
        ("checkpoints/hf.py", None),
        ("checkpoints/store.py", ["HF_DATA", "download_gpt2", "load_hf_dir"]),
        ("checkpoints/store.py", ["RUNTIME_KEYS", "pretrained_model"]),
        ("trainer/config.py", ["requested_model"]),
        ("model/gpt.py", ["GPT.crop_block_size"]),
    ],
    "the causality audit of transformers models and functions (span, padding, packing, hooks)": [
        ("model/causality.py", ["is_transformers", "_layers", "_empty_cache", "_windows"]),
        ("model/causality.py", ["attention_span_check", "padding_check", "packing_check"]),
        ("model/causality.py", ["undrivable", "audit_transformers", "audit_function"]),
        ("check_causality.py", ["transformers_model"]),
    ],
    "causality proofs, the guard before training, check_causality.py": [
        ("check_causality.py", None),
        ("model/causality.py", None),
        ("trainer/preflight.py", ["GUARD_LAYERS", "causality_guard"]),
        ("trainer/config.py", ["TrainSettings.check_causality"]),
    ],
    "downstream tasks scored as lm-evaluation-harness scores them": [
        ("evals/tasks.py", None),
        ("trainer/loop.py", ["Trainer._tasks", "Trainer._task_metrics"]),  # train.eval_tasks
        ("trainer/config.py", ["TrainSettings.eval_tasks", "TrainSettings.eval_task_items"]),
        ("trainer/config.py", ["_tasks"]),
    ],
    "torchrun: DDP and FSDP2, restarts said and recorded": [
        ("hardware/distributed.py", None),
        ("trainer/loop.py", ["Trainer._restarted"]),
        ("trainer/config.py", ["ParallelSettings", "RunConfig.parallel"]),
    ],
    "sharded checkpoints (parallel.checkpoint=sharded): each rank writes its own rows": [
        ("checkpoints/sharded.py", None),
        ("checkpoints/store.py", ["_shards", "_whole"]),
        (
            "trainer/checkpointing.py",
            ["CheckpointManager._shards", "CheckpointManager._write_shards"],
        ),
        ("trainer/config.py", ["ParallelSettings.checkpoint"]),
        ("hardware/distributed.py", ["gathered", "_placed"]),
    ],
    "the BPE tokenizer trainer (bpe-<N>)": [
        ("data/tokenizer.py", ["FORMAT", "TRAINER_VERSION", "PATTERN", "MIN_VOCAB", "BPE"]),
        ("data/tokenizer.py", ["TrainStats", "_merge", "train_bpe"]),
        ("data/tokenizer.py", ["_read_trained", "_trained_encoding"]),
        ("data/pipeline.py", ["_train_tokenizer"]),
    ],
    "a model's own tokenizer for its fine-tuning and scoring (data.tokenizer_dir)": [
        ("checkpoints/store.py", ["_source_checkpoint", "source_tokenizer"]),
        ("trainer/config.py", ["source_data"]),
        ("data/pipeline.py", ["tokenizer_key", "_copy_tokenizer"]),
    ],
    "a group choice read as a number (model=nan) named with its choices": [
        ("base/errors.py", ["_group_choice_error"]),
    ],
    "untrusted checkpoints: headers and shapes checked before loading": [
        ("base/files.py", ["MAX_JSON_BYTES", "read_json_object"]),
        ("base/files.py", ["FLOAT_DTYPES", "TensorInfo", "read_safetensors_header"]),
        ("model/gpt.py", ["GPT.stored_shapes"]),
        ("checkpoints/store.py", ["check_config_against_weights", "_KEYS", "verify_checkpoint"]),
        ("checkpoints/store.py", ["_json_object", "_inside"]),
    ],
    "tiled FlashAttention (attention: flash)": [
        ("model/flash_attention.py", None),
        ("model/gpt.py", ["flash"]),
        ("model/gpt.py", ["GPTConfig.flash_block_q", "GPTConfig.flash_block_k"]),
    ],
    "Triton GPU kernel (attention: triton)": [
        ("model/triton_attention.py", None),
        ("model/gpt.py", ["unavailable_attention", "triton"]),
    ],
    "memory estimate before allocating": [
        ("trainer/preflight.py", ["MemoryEstimate", "estimate_memory"]),
        ("trainer/preflight.py", ["available_memory", "check_memory"]),
        ("trainer/config.py", ["TrainSettings.skip_memory_check"]),
    ],
    "CPU decoding: row-block copy, thread choice, dtype probe": [
        ("hardware/device.py", ["SplitLinear", "is_sharded", "decodes_from_a_copy", "decoder_for"]),
        ("hardware/device.py", ["decoding_copy", "cpu_threads", "THREAD_TRIALS"]),
        ("hardware/device.py", ["ThreadChoice", "bf16_decoding_speedup", "cpu_decoding_dtype"]),
        ("hardware/device.py", ["decoding_dtype"]),
    ],
    "compiled decoding and 8-bit weights (sample.py compile=, quantize=)": [
        ("inference/generate.py", ["StepKVCache", "_one_token", "compiled_step"]),
        ("inference/generate.py", ["COMPILE_PAYS_AFTER", "decoding_plan"]),
        ("hardware/device.py", ["block_products", "_block_products_shape", "LowBitLinear"]),
        ("hardware/device.py", ["Int8Linear"]),
        ("hardware/device.py", ["Int4Linear", "QUANTIZED", "quantize_setting"]),
        ("inference/cli.py", ["decoding_settings"]),
    ],
    "Muon optimizer": [
        ("trainer/optim.py", ["zeropower_via_newtonschulz5", "Muon", "is_block_matrix"]),
        ("trainer/optim.py", ["muon_group"]),
        ("trainer/config.py", ["OptimSettings.muon_lr", "OptimSettings.muon_momentum"]),
        ("trainer/config.py", ["OptimSettings.muon_nesterov", "OptimSettings.muon_ns_steps"]),
        ("trainer/config.py", ["OptimSettings.muon_weight_decay", "_momentum"]),
    ],
    "resume that refuses changed model, data or optimizer keys": [
        ("trainer/config.py", ["RESUMABLE", "saved_config", "resumed_config"]),
        ("trainer/config.py", ["_under", "_show", "_flatten", "_set"]),
        ("trainer/checkpointing.py", ["CheckpointManager._refuse_changed"]),
    ],
    "Weights & Biases tracker, with samples at each evaluation": [
        ("trainer/reporting.py", ["resolve_mode", "Tracker"]),
        ("trainer/loop.py", ["Trainer._samples"]),
        ("trainer/config.py", ["WandbSettings", "RunConfig.wandb", "TrainSettings.sample_tokens"]),
    ],
    "MFU: peak FLOP/s measured or looked up": [
        ("hardware/device.py", ["GPU_PEAK_FLOPS", "peak_flops", "measured_cpu_matmul_flops"]),
        ("hardware/device.py", ["measured_once", "fastest", "cpuinfo", "cpu_name"]),
        ("trainer/loop.py", ["Trainer._raise_peak", "Trainer._mfu", "Trainer._mfu_peak"]),
        ("model/gpt.py", ["GPT.flops_per_token"]),
    ],
    "CPU dtype=auto: bfloat16 where this CPU's probe measures it faster": [
        ("hardware/device.py", ["BF16_MIN_SPEEDUP", "AUTO_DTYPE_ENV", "cpu_auto_dtype"]),
        ("hardware/device.py", ["probed_dtype", "bf16_speedup", "fast_matmul_dtype"]),
    ],
    "GPU input pipeline: batches read ahead into pinned memory": [
        ("data/loader.py", ["PrefetchingSampler"]),
    ],
    "a warning when warmup outlasts a time budget": [
        ("trainer/optim.py", ["warmup_drop"]),
        ("trainer/loop.py", ["Trainer._warn_warmup"]),
    ],
    "the wsd schedule (optim.schedule=wsd)": [
        ("trainer/optim.py", ["wsd_progress"]),
        ("trainer/config.py", ["OptimSettings.decay_fraction"]),
    ],
    "loss plot (loss.png)": [("trainer/reporting.py", ["draw", "MetricsLog.plot"])],
    "sweeps (`-m`): every job validated first, a table after": [
        ("trainer/reporting.py", ["_overrides", "_result", "sweep_table", "SweepTable"]),
        ("trainer/config.py", ["RunDirGuard.on_multirun_start"]),
    ],
    "a non-finite step: stop or skip (train.on_nan)": [
        ("trainer/loop.py", ["MAX_SKIPPED_STEPS", "TrainingError", "Verdict", "step_verdict"]),
        ("trainer/loop.py", ["Trainer._verdict", "Trainer._non_finite"]),
        ("trainer/config.py", ["TrainSettings.on_nan"]),
    ],
    "step checkpoints (train.keep_checkpoints) and the disk they take": [
        ("checkpoints/store.py", ["STEP_PREFIX", "prune_step_checkpoints", "checkpoint_bytes"]),
        ("trainer/checkpointing.py", ["CheckpointManager._report_disk"]),
        ("trainer/config.py", ["TrainSettings.keep_checkpoints"]),
    ],
    "`python -m data.prepare`: a dataset prepared alone (train.py prepares its own)": [
        ("data/prepare.py", None),
    ],
    "sliding-window evaluation (evaluate.py stride=)": [("evals/loss.py", ["sliding_windows"])],
    "evaluate.py text_file=: any UTF-8 file scored": [("evals/loss.py", ["text_file_tokens"])],
    "a time budget (train.max_seconds): the clock's share of the schedule, said at the start": [
        ("trainer/loop.py", ["Budget.time_fraction", "Budget.spent", "Budget.left_out"]),
        ("trainer/config.py", ["TrainSettings.max_seconds"]),
    ],
    "datasets: an unreachable hub said at once, progress bars on a terminal only": [
        ("data/sources.py", ["refuse_unreachable_hub", "progress_bars"]),
    ],
    "sample.py without checkpoint=: the newest run under ./outputs": [
        ("checkpoints/store.py", ["find_checkpoint"]),
    ],
    "sampling filters beyond temperature and top-k: repetition penalty, top-p, min-p": [
        ("inference/generate.py", ["apply_repetition_penalty", "top_p_filter", "min_p_filter"]),
        ("inference/generate.py", ["SamplingParams.top_p", "SamplingParams.min_p"]),
        ("inference/generate.py", ["SamplingParams.repetition_penalty"]),
    ],
    "architecture options: RoPE, RMSNorm, and the keys of every option": [
        ("model/gpt.py", ["RMSNorm", "rope_tables", "apply_rope"]),
        ("model/gpt.py", ["GPTConfig.rope_base", "GPTConfig.pos_embedding", "GPTConfig.norm"]),
        ("model/gpt.py", ["GPTConfig.qk_norm", "GPTConfig.mlp", "GPTConfig.mlp_ratio"]),
        ("model/gpt.py", ["GPTConfig.logit_softcap", "GPTConfig.zero_init_proj"]),
    ],
    "chat: template, conversation data, chat in sample.py and serve.py": [
        ("data/chat.py", None),
        ("data/sources.py", ["load_chat_plays", "check_json_lines"]),
        ("data/sources.py", ["load_chat_files", "_column"]),
        ("data/pipeline.py", ["data_tokenizer", "_skipped"]),
        ("data/pipeline.py", ["encode_conversations"]),
        ("inference/cli.py", ["chat_replies"]),
        ("model/gpt.py", ["GPT.add_tokens"]),
        ("checkpoints/store.py", ["add_template_tokens"]),
        ("inference/cli.py", ["read_messages", "reply", "converse"]),
        ("inference/server.py", ["Message", "ChatRequest", "Server.chat_completions"]),
    ],
    "run directory lock": [
        ("trainer/preflight.py", ["LOCK_FILE", "RunDirLocked", "_in_forked_child"]),
        ("trainer/preflight.py", ["acquire_run_lock"]),
    ],
}


def code_lines(src: str) -> set[int]:
    """The numbers of the lines that hold code: not blank, not only a comment, not a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            value = getattr(first, "value", None) if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip and tok.type != tokenize.ENDMARKER:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines - docstrings


def span(tree: ast.Module, dotted: str) -> range:
    """The lines of a top-level def, class or assignment (decorators included), or of a method
    (`Class.method`)."""
    body, node = tree.body, None
    for part in dotted.split("."):
        for candidate in body:
            targets = getattr(candidate, "targets", None) or [getattr(candidate, "target", None)]
            names = {getattr(candidate, "name", None), getattr(targets[0], "id", None)}
            if part in names:
                node, body = candidate, getattr(candidate, "body", [])
                break
        else:
            raise SystemExit(f"bench_lines: {dotted} is not in the module; update FEATURES")
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return range(first, node.end_lineno + 1)


def library_files() -> list[Path]:
    """What loc.py counts as library + entry: every .py file but tests/ and benchmarks/."""
    files = []
    for f in sorted(ROOT.rglob("*.py")):
        folders = f.relative_to(ROOT).parts[:-1]
        if not any(p in SKIPPED or p.startswith(".") for p in folders):
            files.append(f)
    return [f for f in files if f.relative_to(ROOT).parts[0] not in NOT_LIBRARY]


def main() -> None:
    counted: dict[str, set[int]] = {}
    for module, names in EVERY_RUN:  # in no feature's row
        tree = ast.parse((ROOT / module).read_text(encoding="utf-8"))
        counted.setdefault(module, set()).update(i for name in names for i in span(tree, name))
    rows = []
    for feature, places in FEATURES.items():
        n = 0
        for module, names in places:
            src = (ROOT / module).read_text(encoding="utf-8")
            lines = code_lines(src)
            if names is not None:
                tree = ast.parse(src)
                lines &= {i for name in names for i in span(tree, name)}
            new = lines - counted.setdefault(module, set())  # each line in one feature only
            counted[module] |= new
            n += len(new)
        rows.append((n, feature))
    total = sum(len(code_lines(f.read_text(encoding="utf-8"))) for f in library_files())
    features = sum(n for n, _ in rows)
    print("| feature | code lines |\n| --- | ---: |")
    for n, feature in sorted(rows, reverse=True):
        print(f"| {feature} | {n:,} |")
    print(f"| the rest: model, data, training loop, sampling, evaluation, checkpoints | "
          f"{total - features:,} |")  # fmt: skip
    print(f"| **library + entry scripts** (target {TARGET:,}) | **{total:,}** |")


if __name__ == "__main__":
    main()
