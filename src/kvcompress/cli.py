"""The ``kvcompress`` command line.

``generate``, ``methods`` and ``models`` live here. ``eval``, ``report``, ``bench`` and ``train`` hand their
arguments unchanged to the ``main(argv)`` of the module that does the work, so each option is defined once
(``kvcompress eval --help`` prints the runner's own help).
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

import kvcompress
from kvcompress import params as parse_params
from kvcompress.models import list_models, load_model, model_info
from kvcompress.registry import METHODS, method_defaults

app = typer.Typer(no_args_is_help=True, add_completion=False, help="KV-cache compression for transformers models.")
console = Console()


def method_params(method: str, budget: int | None, ratio: float | None, extra: list[str]) -> dict[str, object]:
    """The method's parameters from ``--budget``, ``--ratio`` and ``-p key=value`` (parsed by each one's type)."""
    params = parse_params.method_params(method, parse_params.split_pairs(extra))
    if budget is not None:
        params["budget"] = budget
    if ratio is not None:
        params["ratio"] = ratio
    return params


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} GiB"


@app.command()
def generate(
    prompt: Annotated[str | None, typer.Argument(help="Prompt text (or use --file).")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Read the prompt from this file.")] = None,
    method: Annotated[str, typer.Option("--method", "-m", help="Compression method (see `kvcompress methods`).")] = (
        "streaming"
    ),
    budget: Annotated[int | None, typer.Option(help="Tokens kept per layer and KV head.")] = None,
    ratio: Annotated[float | None, typer.Option(help="Share of the prompt kept, one-shot methods.")] = None,
    param: Annotated[list[str], typer.Option("--param", "-p", help="Extra method parameter key=value.")] = [],  # noqa: B006
    model: Annotated[str, typer.Option(help="Model name, local path or HF id.")] = "smollm2-135m",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 128,
    chunk_size: Annotated[int, typer.Option(min=1, help="Prefill chunk (tokens); eviction between chunks.")] = 512,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the model's chat template.")] = True,
    threads: Annotated[int, typer.Option(min=1, help="torch CPU threads.")] = 1,
) -> None:
    """Generate with a compressed cache and report tokens seen vs stored and KV bytes vs the full cache."""
    torch.set_num_threads(threads)
    if (prompt is None) == (file is None):
        raise typer.BadParameter("give the prompt as an argument or with --file, not both")
    text = file.read_text(encoding="utf-8-sig") if file is not None else prompt
    config = kvcompress.make_config(method, **method_params(method, budget, ratio, param))
    with console.status(f"loading {model}"):
        lm, tokenizer = load_model(model)
    if chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=not chat)
    cache = kvcompress.cache_for(lm, config)
    one_shot = cache.compressed_layers[0].policy.one_shot
    with console.status(f"prefilling {inputs.input_ids.shape[1]} tokens and generating"), torch.no_grad():
        output = lm.generate(
            **inputs,
            past_key_values=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            prefill_chunk_size=None if one_shot else chunk_size,
            pad_token_id=tokenizer.pad_token_id,
        )
    new_tokens = output[0, inputs.input_ids.shape[1] :]
    console.print(tokenizer.decode(new_tokens, skip_special_tokens=True), markup=False, highlight=False)
    full_bytes = cache.tokens_seen() * model_info(lm)["kv_bytes_per_token"]
    table = Table(title=f"{config.name} on {model}", show_header=False)
    table.add_row("prompt tokens", str(inputs.input_ids.shape[1]))
    table.add_row("tokens seen (logical)", str(cache.tokens_seen()))
    table.add_row("tokens stored per layer (physical)", str(max(cache.tokens_stored())))
    table.add_row("KV bytes stored", f"{cache.nbytes():,} ({human_bytes(cache.nbytes())})")
    table.add_row("KV bytes, full cache", f"{full_bytes:,} ({human_bytes(full_bytes)})")
    table.add_row("saved", f"{1 - cache.nbytes() / full_bytes:.1%}")
    console.print(table)


@app.command()
def methods() -> None:
    """List the methods with their parameters, defaults and papers."""
    table = Table(title="kvcompress methods")
    for column in ("method", "parameters (defaults)", "paper"):
        table.add_column(column)
    for name, config in METHODS.items():
        defaults = ", ".join(f"{key}={value!r}" for key, value in method_defaults(name).items())
        table.add_row(name, defaults or "-", config.paper)
    console.print(table)
    console.print(
        f"{len(METHODS)} methods; each parameter's meaning is in its config docstring "
        "(e.g. `python -c 'import kvcompress; help(kvcompress.METHODS[\"h2o\"])'`)."
    )


@app.command()
def models() -> None:
    """List the offline models and whether each is installed and converted."""
    table = Table(title="kvcompress models")
    for column in ("name", "model", "installed", "converted", "install"):
        table.add_column(column)
    for info in list_models():
        name = info.name + (" (default)" if info.default else "")
        table.add_row(
            name, info.hf_id, "yes" if info.installed else "no", "yes" if info.cached else "no", info.install_command
        )
    console.print(table)
    console.print("Any Hugging Face id (owner/model) or local path also works where the Hub is reachable.")


PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}

BENCHMARKS = {
    "cache-op": "kvcompress.bench.cache_op",
    "decode": "kvcompress.bench.decode",
    "prefill": "kvcompress.bench.prefill",
}
TRAINERS = {
    "less": "kvcompress.train.less",
    "pod-calibrate": "kvcompress.train.pod_calibrate",
    "pod-adapt": "kvcompress.train.pod_adapt",
}


def delegate(module: str, argv: list[str], prog: str) -> None:
    """Run ``module.main(argv)`` as if it were this command, and exit with its status."""
    sys.argv[0] = prog
    status = importlib.import_module(module).main(argv)
    raise typer.Exit(status or 0)


def choose(kind: str, name: str, table: dict[str, str]) -> str:
    if name not in table:
        raise typer.BadParameter(f"{kind} must be one of {', '.join(table)}; got {name!r}")
    return table[name]


@app.command("eval", context_settings=PASS_THROUGH)
def evaluate(ctx: typer.Context) -> None:
    """Evaluate methods x budgets on a task into resumable JSONL (TASK --methods --budgets --samples --out ...)."""
    delegate("kvcompress.eval.runner", ctx.args, "kvcompress eval")


@app.command(context_settings=PASS_THROUGH)
def report(ctx: typer.Context) -> None:
    """Turn a results folder into a markdown table and PNG plots (RUN_DIR --out PREFIX)."""
    delegate("kvcompress.eval.report", ctx.args, "kvcompress report")


@app.command(context_settings=PASS_THROUGH)
def bench(ctx: typer.Context, name: Annotated[str, typer.Argument(help="cache-op | decode | prefill")]) -> None:
    """Benchmarks: cache-op latency, decode step time vs context, prefill time and peak memory."""
    delegate(choose("benchmark", name, BENCHMARKS), ctx.args, f"kvcompress bench {name}")


@app.command(context_settings=PASS_THROUGH)
def train(ctx: typer.Context, name: Annotated[str, typer.Argument(help="less | pod-calibrate | pod-adapt")]) -> None:
    """Training steps: LESS kernels, PoD calibration and adaptation."""
    delegate(choose("trainer", name, TRAINERS), ctx.args, f"kvcompress train {name}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    app()


if __name__ == "__main__":
    main()
