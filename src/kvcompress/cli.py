"""The ``kvcompress`` command line.

``generate``, ``methods`` and ``models`` live here. ``eval``, ``leaderboard``, ``report``, ``lm-eval``, ``bench`` and
``train`` hand their arguments unchanged to the ``main(argv)`` of the module that does the work, so each option is
defined once (``kvcompress eval --help`` prints the runner's own help).

A user error (a bad option or parameter value, a missing file, model or data folder, a missing optional package)
prints one line, ``kvcompress COMMAND: error: ...`` naming what is wrong and what is allowed, and exits with 2;
tracebacks are for bugs, or for every error with ``--debug``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Annotated, NoReturn

import torch
import typer
from rich.console import Console
from rich.table import Table

import kvcompress
from kvcompress import params as parse_params
from kvcompress.generation import cache_argument
from kvcompress.models import list_models, load_model, model_info
from kvcompress.models.registry import ModelNotInstalledError
from kvcompress.presets import PRESETS
from kvcompress.registry import METHODS, method_defaults

app = typer.Typer(no_args_is_help=True, add_completion=False, help="KV-cache compression for transformers models.")
console = Console()

# click's exception base (typer vendors click from 0.20 on, so it is found through typer's own exceptions)
CLICK_ERROR = next(kind for kind in typer.BadParameter.__mro__ if kind.__name__ == "ClickException")
USER_ERRORS = (ValueError, OSError, ModelNotInstalledError)  # raised for what the user gave, never for a bug
# optional module -> extra
EXTRAS = {"matplotlib": "eval", "rouge_score": "eval", "tqdm": "eval", "vllm": "vllm", "lm_eval": "lmeval"}
USAGE_STATUS = 2


def method_params(
    spec: str, budget: int | None, ratio: float | None, extra: list[str]
) -> tuple[str, dict[str, object]]:
    """The method's name and parameters from ``--method NAME[:key=value;...]`` (the spec ``eval`` and ``leaderboard``
    take: ``params.split_spec``), ``--budget``, ``--ratio`` and ``-p key=value``, each parsed by its type;
    a parameter given twice is a ``ValueError``."""
    method, pairs = parse_params.split_spec(spec, "--method")
    for name, text in parse_params.split_pairs(extra).items():
        if name in pairs:
            raise ValueError(f"{name} is given twice (--method {name}={pairs[name]}, -p {name}={text}); give it once")
        pairs[name] = text
    params = parse_params.method_params(method, pairs)
    for name, value in (("budget", budget), ("ratio", ratio)):
        if value is None:
            continue
        if name in params:
            raise ValueError(f"{name} is given twice (--{name} {value} and {name}={params[name]}); give it once")
        params[name] = value
    return method, params


def read_prompt(prompt: str | None, file: Path | None) -> str:
    """The prompt text from the argument or ``--file`` (exactly one); ``ValueError`` for a missing, unreadable or
    empty one."""
    if (prompt is None) == (file is None):
        raise ValueError("give the prompt as an argument or with --file, not both")
    if file is not None:
        if not file.exists():
            raise ValueError(f"--file {str(file)!r} does not exist")
        if not file.is_file():
            raise ValueError(f"--file {str(file)!r} is not a file (a folder?); give a text file")
        try:
            prompt = file.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError:
            raise ValueError(f"--file {str(file)!r} is not UTF-8 text") from None
    if not prompt.strip():
        source = f"--file {str(file)!r}" if file is not None else "the prompt argument"
        raise ValueError(f"{source} is empty; give some text to continue")
    return prompt


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
    method: Annotated[
        str, typer.Option("--method", "-m", help="Method: NAME or NAME:key=value;... (`kvcompress methods`).")
    ] = "streaming",
    budget: Annotated[int | None, typer.Option(help="Tokens kept per layer and KV head.")] = None,
    ratio: Annotated[float | None, typer.Option(help="Share of the prompt kept, one-shot methods.")] = None,
    param: Annotated[list[str], typer.Option("--param", "-p", help="Extra method parameter key=value.")] = [],  # noqa: B006
    model: Annotated[str, typer.Option(help="Model name, local path or HF id.")] = "smollm2-135m",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 128,
    chunk_size: Annotated[int, typer.Option(min=1, help="Prefill chunk (tokens); eviction between chunks.")] = 512,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the model's chat template.")] = True,
    prefix: Annotated[str, typer.Option(help="Text that starts the model's answer (after the chat template).")] = "",
    threads: Annotated[int, typer.Option(min=1, max=1024, help="torch CPU threads.")] = 1,
) -> None:
    """Generate with a compressed cache and report tokens seen vs stored and KV bytes vs the full cache."""
    text = read_prompt(prompt, file)
    name, params = method_params(method, budget, ratio, param)
    config = kvcompress.make_config(name, **params)
    torch.set_num_threads(threads)
    with console.status(f"loading {model}"):
        lm, tokenizer = load_model(model)
    if chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text += prefix
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=not chat)
    if inputs.input_ids.shape[1] == 0:
        raise ValueError(f"the prompt {text!r} gives no tokens; give some text to continue")
    cache = kvcompress.cache_for(lm, config)
    one_shot = cache.compressed_layers[0].policy.one_shot
    start = time.perf_counter()
    with console.status(f"prefilling {inputs.input_ids.shape[1]} tokens and generating"), torch.no_grad():
        output = lm.generate(
            **inputs,
            **cache_argument(lm, cache),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            prefill_chunk_size=None if one_shot else chunk_size,
            pad_token_id=tokenizer.pad_token_id,
        )
    seconds = time.perf_counter() - start
    new_tokens = output[0, inputs.input_ids.shape[1] :]
    console.print(tokenizer.decode(new_tokens, skip_special_tokens=True), markup=False, highlight=False)
    full_bytes = cache.tokens_seen() * model_info(lm)["kv_bytes_per_token"]
    table = Table(title=f"{config.name} on {model}", show_header=False)
    table.add_row("prompt tokens", str(inputs.input_ids.shape[1]))
    table.add_row("tokens seen (logical)", str(cache.tokens_seen()))
    table.add_row("tokens stored per layer (physical)", str(max(cache.tokens_stored())))
    table.add_row("KV bytes stored", f"{cache.nbytes():,} ({human_bytes(cache.nbytes())})")
    allocated = cache.allocated_nbytes()  # stored plus the room kept for coming tokens (kvcompress.core.capacity)
    table.add_row("KV bytes allocated", f"{allocated:,} ({human_bytes(allocated)})")
    table.add_row("KV bytes, full cache", f"{full_bytes:,} ({human_bytes(full_bytes)})")
    table.add_row("saved", f"{1 - cache.nbytes() / full_bytes:.1%}")
    table.add_row("wall time, prefill and generation", f"{seconds:.1f} s for {len(new_tokens)} new tokens")
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
        "(e.g. `python -c 'import kvcompress; help(kvcompress.METHODS[\"h2o\"])'`). "
        f"With preset=kvpress, {', '.join(PRESETS['kvpress'])} take kvpress's settings (`snapkv:preset=kvpress`)."
    )


@app.command()
def models() -> None:
    """List the offline models, whether each is installed and converted, and the command that installs it."""
    table = Table(title="kvcompress models")
    for column in ("name", "model", "installed", "converted"):
        table.add_column(column)
    infos = list_models()
    for info in infos:
        name = info.name + (" (default)" if info.default else "")
        table.add_row(name, info.hf_id, "yes" if info.installed else "no", "yes" if info.cached else "no")
    console.print(table)
    # printed as plain lines, never cut or wrapped by the table, so each command can be copied whole
    typer.echo("Install commands:")
    for info in infos:
        typer.echo(f"  {info.name}: {info.install_command}")
    typer.echo("Any Hugging Face id (owner/model) or local path also works where the Hub is reachable.")


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
    "duo-calibrate": "kvcompress.train.duo_calibrate",
    "kvzip-calibrate": "kvcompress.train.kvzip_calibrate",
}


def delegate(module: str, argv: list[str], prog: str) -> None:
    """Run ``module.main(argv)`` as if it were this command, and exit with its status. Its argparse errors become
    ``ValueError`` (one line, exit status 2, like every user error) instead of argparse's usage block."""
    sys.argv[0] = prog
    original = argparse.ArgumentParser.error, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.error = _argument_error
    argparse.ArgumentParser.parse_known_args = _once_each
    try:
        status = importlib.import_module(module).main(argv)
    finally:
        argparse.ArgumentParser.error, argparse.ArgumentParser.parse_known_args = original
    raise typer.Exit(status or 0)


def _argument_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    raise ValueError(message)


def _once_each(parser: argparse.ArgumentParser, args=None, namespace=None):
    """``parse_known_args`` refusing an option given twice (argparse keeps the last value silently); options that
    collect values (``action="append"``, counts) may repeat."""
    tokens = list(sys.argv[1:] if args is None else args)
    repeatable = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction, argparse._ExtendAction)
    actions = {
        option: action for option, action in parser._option_string_actions.items() if not isinstance(action, repeatable)
    }
    repeated(tokens, actions, parser.error)
    return argparse.ArgumentParser.parse_known_args.__wrapped__(parser, args, namespace)


_once_each.__wrapped__ = argparse.ArgumentParser.parse_known_args


def repeated(tokens: list[str], options: dict[str, object], error) -> None:
    """Call ``error`` naming the first of ``options`` (option string: what it sets, aliases sharing one) that
    ``tokens`` give twice (``--name value`` or ``--name=value``; nothing after ``--`` counts)."""
    given: dict[int, str] = {}
    for token in tokens:
        if token == "--":
            return
        option = token.split("=", 1)[0] if token.startswith("--") else token
        target = options.get(option)
        if target is None:
            continue
        if id(target) in given:
            first = given[id(target)]
            error(f"{option} is given twice{'' if first == option else f' (as {first} and {option})'}; give it once")
        given[id(target)] = option


def choose(kind: str, name: str, table: dict[str, str], ctx: typer.Context) -> str:
    """The module of ``name``; ``--help``/``-h`` in its place prints the command's help and exits with 0."""
    if name in ("--help", "-h"):
        typer.echo(ctx.get_help())
        typer.echo(f"\nEach {kind} has its own options: `{ctx.command_path} NAME --help`.")
        raise typer.Exit(0)
    if name not in table:
        raise typer.BadParameter(f"{kind} must be one of {', '.join(table)}; got {name!r}")
    return table[name]


@app.command("eval", context_settings=PASS_THROUGH)
def evaluate(ctx: typer.Context) -> None:
    """Evaluate methods x budgets on a task into resumable JSONL (TASK --methods --budgets --samples --out ...)."""
    delegate("kvcompress.eval.runner", ctx.args, "kvcompress eval")


@app.command(context_settings=PASS_THROUGH)
def leaderboard(ctx: typer.Context) -> None:
    """Methods x kept ratios on a model, context compressed before the question: one table and one plot."""
    delegate("kvcompress.eval.leaderboard", ctx.args, "kvcompress leaderboard")


@app.command(context_settings=PASS_THROUGH)
def report(ctx: typer.Context) -> None:
    """Turn a results folder into a markdown table and PNG plots (RUN_DIR --out PREFIX)."""
    delegate("kvcompress.eval.report", ctx.args, "kvcompress report")


@app.command("lm-eval", context_settings=PASS_THROUGH)
def lm_eval(ctx: typer.Context) -> None:
    """lm-evaluation-harness with the kvcompress model and the local kvc_ tasks (lm-eval's own options)."""
    delegate("kvcompress.lmeval.cli", ctx.args, "kvcompress lm-eval")


@app.command(context_settings=PASS_THROUGH)
def bench(ctx: typer.Context, name: Annotated[str, typer.Argument(help="cache-op | decode | prefill")]) -> None:
    """Benchmarks: cache-op latency, decode step time vs context, prefill time and peak memory."""
    delegate(choose("benchmark", name, BENCHMARKS, ctx), ctx.args, f"kvcompress bench {name}")


@app.command(context_settings=PASS_THROUGH)
def train(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="less | pod-calibrate | pod-adapt | duo-calibrate | kvzip-calibrate")],
) -> None:
    """Training steps: LESS kernels, PoD calibration and adaptation, DuoAttention and KVzip head scores."""
    delegate(choose("trainer", name, TRAINERS, ctx), ctx.args, f"kvcompress train {name}")


@app.callback()
def options(
    debug: Annotated[bool, typer.Option("--debug", help="Show the full traceback of any error.")] = False,
) -> None:
    """KV-cache compression for transformers models. User errors print one line and exit with 2."""


def main(argv: list[str] | None = None) -> None:
    """The ``kvcompress`` command: run ``app`` and turn user errors into one line on stderr and exit status 2.

    ``--debug`` anywhere on the command line re-raises every error with its traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [arg for arg in args if arg != "--debug"]
    logging.basicConfig(level=logging.WARNING)
    warnings.formatwarning = one_line_warning
    try:
        check_repeated_options(args)
        status = app(args=args, prog_name="kvcompress", standalone_mode=False)
    except Exception as error:
        if debug or not isinstance(error, (CLICK_ERROR, ModuleNotFoundError, *USER_ERRORS)):
            raise
        status = report_error(error, args)
    except KeyboardInterrupt:
        status = 130
    raise SystemExit(status if isinstance(status, int) else 0)


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning kvcompress gives as one line, ``kvcompress: warning: ...``; other packages' as Python shows them."""
    if Path(filename).resolve().is_relative_to(Path(kvcompress.__file__).resolve().parent):
        return f"kvcompress: warning: {message}\n"
    return ORIGINAL_FORMATWARNING(message, category, filename, lineno, line)


ORIGINAL_FORMATWARNING = warnings.formatwarning


def report_error(error: Exception, args: list[str]) -> int:
    """Print ``error`` as one line naming the command and return the exit status (``raise`` a missing module that
    is not an optional extra's: that is a bug)."""
    if type(error).__name__ == "NoArgsIsHelpError":  # the help has been printed
        return USAGE_STATUS
    if isinstance(error, CLICK_ERROR):
        message = error.format_message()
    elif isinstance(error, ModuleNotFoundError):
        root = (error.name or "").split(".")[0]
        if root not in EXTRAS:
            raise error
        message = f'{root} is not installed; it comes with pip install "kvcompress[{EXTRAS[root]}]"'
    else:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    command = "kvcompress" + (f" {args[0]}" if args and args[0] in app_commands() else "")
    sys.stderr.write(f"{command}: error: {' '.join(message.split())} (see `{command} --help`)\n")
    return USAGE_STATUS


def check_repeated_options(args: list[str]) -> None:
    """A ``ValueError`` for an option of a command defined here given twice (click keeps the last value silently);
    options that take several values (``-p``) may repeat. Delegated commands check their own (``delegate``)."""
    if not args:
        return
    group = typer.main.get_command(app)
    command = group.commands.get(args[0]) if hasattr(group, "commands") else None
    if command is None or command.context_settings.get("ignore_unknown_options"):
        return
    options = {}
    for param in command.params:
        if getattr(param, "multiple", False) or getattr(param, "count", False) or not hasattr(param, "opts"):
            continue
        for option in (*param.opts, *param.secondary_opts):
            if option.startswith("-"):  # (an argument's name is no option)
                options[option] = param
    repeated(args[1:], options, _raise_value_error)


def _raise_value_error(message: str) -> NoReturn:
    raise ValueError(message)


def app_commands() -> set[str]:
    return {command.name or command.callback.__name__ for command in app.registered_commands}
