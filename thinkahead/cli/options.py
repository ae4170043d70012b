"""What the commands share: input errors and exit codes, the orchestrator options, settings, stores, loading."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from thinkahead.config import default
from thinkahead.models.engine.weights.load import DTYPES
from thinkahead.step_spec.policies import JUDGES, POLICIES as POLICY_REGISTRY, POLICY_NAMES, REPAIRS
from thinkahead.token_spec.names import DRAFTER_CHOICES, HEAD_KIND, SOLO_DRAFTER

POLICIES = POLICY_NAMES  # the registry's policies for batch runs (run, bench, serve)
DRAFTER_HELP = (f"The large model's token drafter: auto is {HEAD_KIND} where a draft head is packaged for the model "
                f"(its trained head beside {SOLO_DRAFTER}: the fastest measured, alone and with runs in flight), else "
                f"{SOLO_DRAFTER} (model-free); hybrid also drafts with the small model (the small model must be local "
                f"and share the tokenizer) [{default('large.drafter')}].")

EXIT_OK, EXIT_RUNS_FAILED, EXIT_INPUT = 0, 1, 2  # docs/cli.md "Exit codes"


class InputError(click.ClickException):
    """A usage or input problem the user can fix (a bad file, value or path): exit code 2, no usage text."""

    exit_code = EXIT_INPUT


@contextmanager
def output_errors(out: Path) -> Iterator[None]:
    """Writing a command's output `out` (`-o`, a file or a folder): what goes wrong there is an
    `InputError` (one line, exit 2), the same for every command.

    A store that is not ours, is corrupt or holds another configuration (`LogError`), and a path on
    the way to or inside `out` that the system will not create or write (`OSError`: a parent that
    is a file, is missing or is not writable). Any other `OSError` is not about `out` and goes on."""
    from thinkahead.orchestrator.jsonl import LogError, cannot_write

    try:
        yield
    except LogError as exc:
        raise InputError(str(exc)) from None
    except OSError as exc:
        if exc.filename is None:
            raise
        where, out_abs = Path(os.fsdecode(exc.filename)).absolute(), out.absolute()
        if where != out_abs and where not in out_abs.parents and out_abs not in where.parents:
            raise
        raise InputError(cannot_write(exc.filename, exc)) from None


@contextmanager
def model_file_errors() -> Iterator[None]:
    """Loading models: a damaged model file (`ModelFileError`: a truncated GGUF, a tensor out of bounds, a
    NaN scale) is an `InputError`, one line naming the file and the tensor, exit 2."""
    from thinkahead.models.errors import ModelFileError

    try:
        yield
    except ModelFileError as exc:
        raise InputError(str(exc)) from None


OFF = "off"  # --gate-logprob off: check every draft


class GateLogprob(click.ParamType):
    """`--gate-logprob`: a log-probability below 0, or `off` (every draft is checked)."""

    name = "LOGPROB|off"

    def get_metavar(self, *args: Any, **kwargs: Any) -> str:
        return self.name

    def convert(self, value: Any, param: Any, ctx: Any) -> float | str:
        if isinstance(value, float) or value == OFF:
            return value
        if str(value).strip().lower() in (OFF, "none"):
            return OFF
        try:
            return float(value)
        except ValueError:
            self.fail(f"{value!r} is neither a log-probability (e.g. -0.1) nor 'off'", param, ctx)


def gate_setting(value: float | str | None) -> float | None:
    """The policy's `gate_logprob` for a parsed `--gate-logprob` (`off` -> None: no gate)."""
    return None if value == OFF else value


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (through links and relative paths)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def open_store(path: Path, config: dict[str, Any] | None, inputs: tuple[Path, ...] = ()):
    """A result store checked for writing (recognised, same configuration, writable) before any model loads;
    open, it keeps what it read (`store.done_ids()` reads nothing more)."""
    from thinkahead.orchestrator.store import ResultStore

    for source in inputs:
        if source is not None and same_file(path, source):
            raise InputError(f"-o {path} is the input file; write results to another file")
    with output_errors(path):
        store = ResultStore(path, config=config)
        store.open_for_append()
    if store.moved_torn_to is not None:
        click.echo(f"{path}: a torn last line (a write cut short) was moved to {store.moved_torn_to}", err=True)
    return store


def orchestrator_options(fn):
    """The options `run`, `bench` and `serve` share: models, policy, budgets, config file.

    Each one left out keeps the config file's value, or the built-in default (`config.default`,
    shown in brackets)."""
    options = [
        click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     default=None, help="YAML/TOML/JSON orchestrator config; the options below override it."),
        click.option("--small", default=None, help=f"Small (drafting) model spec [{default('small.spec')}]."),
        click.option("--large", default=None, help=f"Large (judging) model spec [{default('large.spec')}]."),
        click.option("--dtype", type=click.Choice(list(DTYPES)), default=None,
                     help=f"Local model dtype [{default('large.dtype')}]."),
        click.option("--drafter", type=click.Choice(DRAFTER_CHOICES), default=None, help=DRAFTER_HELP),
        click.option("--threshold", type=float, default=None,
                     help=f"specreason: accept drafts scoring at least this [{default('policy.threshold'):g}]."),
        click.option("--judge", type=click.Choice(JUDGES), default=None,
                     help="specreason's verifier: the large model's 0-9 judge prompt, or token agreement (the large "
                          "model re-reads the step; a digit it disagrees with by more than --margin fails it) "
                          f"[{default('policy.judge')}]."),
        click.option("--margin", type=float, default=None, help="Agreement judge: nats a checked drafted token may "
                     f"trail the large model's own choice [{default('policy.margin')}]."),
        click.option("--word-margin", type=float, default=None,
                     help="Agreement judge: also check tokens without digits, failing one that trails the large "
                          "model's choice by more than this many nats [unchecked]."),
        click.option("--repair", type=click.Choice(REPAIRS), default=None,
                     help="Agreement judge, on a failed check: the large model finishes the step, or puts its own "
                          f"token in place of the failing one and the small model drafts on [{default('policy.repair')}]."),
        click.option("--router", default=None, help="arbitrage: 'trained' (shipped for the packaged models), "
                     f"'heuristic', or a router JSON from `thinkahead router train` [{default('policy.router')}]."),
        click.option("--pre-router", default=None, help="specreason: a router (as --router) that hands steps to the "
                     "large model before the small model drafts them [none]."),
        click.option("--gate-logprob", type=GateLogprob(), default=None,
                     help="specreason: keep a draft unchecked when every token with digits has at least this "
                          "log-probability under the small model; 'off' checks every draft "
                          f"[{default('policy.gate_logprob')}]."),
        click.option("--max-steps", type=int, default=None,
                     help=f"Steps per reasoning chain [{default('steps.max_steps')}]."),
        click.option("--max-tokens", type=int, default=None,
                     help=f"Generated tokens per reasoning chain [{default('steps.max_tokens')}]."),
        click.option("--step-tokens", type=int, default=None,
                     help=f"Token cap per step [{default('segment.max_step_tokens')}]."),
        click.option("--no-token-spec", is_flag=True, help="Turn token-level speculation off (the plain baseline)."),
        click.option("--record", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="Append every generation's token ids to this JSONL (replay it with `thinkahead simulate`)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def build_settings(config_path, small, large, dtype, threshold, max_steps, max_tokens, step_tokens, no_token_spec,
                   record=None, judge=None, margin=None, word_margin=None, repair=None, router=None,
                   pre_router=None, gate_logprob=None, drafter=None, reads: Sequence[str] | None = None,
                   **extra: Any) -> dict[str, Any]:
    """An `OrchestratorConfig` as a dict: the file's values, overridden by the options given. A step policy's
    option given here must be read by one of `reads`, the policies the command runs (None: the configured one)."""
    from pydantic import ValidationError

    from thinkahead.config import OrchestratorConfig, explain
    from thinkahead.models.loader import check_hub_model_local

    try:
        config = OrchestratorConfig.from_file(config_path, partial=True) if config_path else OrchestratorConfig()
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    data = config.model_dump()
    for tier, spec in (("small", small), ("large", large)):
        if spec is not None:
            data[tier]["spec"] = spec
        if dtype is not None:
            data[tier]["dtype"] = dtype
        if record is not None:
            data[tier]["record"] = str(record)
    if drafter is not None:
        data["large"]["drafter"] = drafter
    for key, value in (("threshold", threshold), ("judge", judge), ("margin", margin), ("word_margin", word_margin),
                       ("repair", repair), ("router", router), ("pre_router", pre_router)):
        if value is not None:
            data["policy"][key] = value
    if gate_logprob is not None:
        data["policy"]["gate_logprob"] = gate_setting(gate_logprob)
    if max_steps is not None:
        data["steps"]["max_steps"] = max_steps
    if max_tokens is not None:
        data["steps"]["max_tokens"] = max_tokens
    if step_tokens is not None:
        data["segment"]["max_step_tokens"] = step_tokens
    if no_token_spec:
        data["token_spec"] = False
    for key, value in extra.items():
        if value is not None:
            if key == "policy":
                data["policy"]["name"] = value
            else:
                data[key] = value
    try:
        OrchestratorConfig.model_validate(data)
    except ValidationError as exc:
        raise InputError(explain(exc, "options")) from None
    check_policy_options({"threshold": threshold, "judge": judge, "margin": margin, "word_margin": word_margin,
                          "repair": repair, "router": router, "pre_router": pre_router, "gate_logprob": gate_logprob},
                         [data["policy"]["name"]] if reads is None else reads)
    for tier in ("small", "large"):  # as the Orchestrator will, before any work (a hub model not on disk)
        try:
            check_hub_model_local(data[tier]["spec"])
        except ValueError as exc:
            raise InputError(f"{tier} model: {exc}") from None
    return data


def check_policy_options(given: dict[str, Any], policies: Sequence[str]) -> None:
    """An `InputError` for a step policy's option given on the command line that none of `policies` reads
    (`--gate-logprob` with `--policy large`): it would change nothing, so it is refused by name."""
    for key, value in given.items():
        if value is None or any(key in POLICY_REGISTRY[name].options.model_fields for name in policies):
            continue
        readers = [name for name, entry in POLICY_REGISTRY.items() if entry.batch and key in entry.options.model_fields]
        ran = f"the policy {policies[0]}" if len(policies) == 1 else f"the policies {', '.join(policies)}"
        raise InputError(f"--{key.replace('_', '-')} is a setting of {' and '.join(readers)}; {ran} would not read "
                         f"it (choose the policy {readers[0]}, or leave --{key.replace('_', '-')} out)")


def quiet_loading() -> None:
    """No per-tensor progress bars from transformers while GGUF weights convert (`load_causal_lm`'s bar
    per converting model still shows: it passes `disable` itself)."""
    from functools import partialmethod

    import tqdm
    from transformers.utils import logging as hf_logging

    # transformers' GGUF converter draws a bar per tensor with plain tqdm, which ignores its switch
    tqdm.tqdm.__init__ = partialmethod(tqdm.tqdm.__init__, disable=True)
    hf_logging.disable_progress_bar()


def first_loads(models: list[tuple[str, str]]) -> list[str]:
    """The local model specs that will convert on this start (the weight cache is on and has no entry)."""
    from thinkahead.models.loader import REMOTE_PREFIXES
    from thinkahead.models.specs import resolve_model_spec
    from thinkahead.models.engine.weights.cache import cache_enabled
    from thinkahead.models.engine.weights.load import is_weight_cached

    if not cache_enabled():
        return []
    first: dict[str, None] = {}
    for spec, dtype in models:
        if spec.startswith(REMOTE_PREFIXES) or resolve_model_spec(spec).kind == "hf":  # hub models are not cached
            continue
        if not is_weight_cached(spec, dtype):
            first[spec] = None
    return list(first)


def load_models(orch) -> None:
    """Load both models now (quietly), so the progress clock starts with the first run."""
    quiet_loading()
    c = orch.config
    click.echo(f"loading {c.small.spec} and {c.large.spec} ({c.large.dtype}) ...", err=True)
    with model_file_errors():
        first = first_loads([(c.small.spec, c.small.dtype), (c.large.spec, c.large.dtype)])
        if first:
            click.echo(f"first start: converting {' and '.join(first)} once (minutes); later starts load them "
                       "from the weight cache in seconds", err=True)
        t0 = time.perf_counter()
        orch.runtime  # noqa: B018 - builds the runtime, which loads the models
    check_scores(c.policy, orch.small, orch.large)
    click.echo(f"models ready in {time.perf_counter() - t0:.0f}s", err=True)


def check_scores(policy: Any, small: Any, large: Any) -> None:
    """Before any run: under specreason, ask each remote model whose token scores the policy needs whether its
    server gives them (`probe_scores`); a refusal, or a server that cannot be asked, is an `InputError` naming
    the setting (exit 2), not a failure of every run."""
    from thinkahead.models.errors import ThinkaheadError
    from thinkahead.sdk import run_coroutine
    from thinkahead.step_spec.specreason import probe_scores

    if getattr(policy, "name", None) != "specreason":
        return
    try:
        run_coroutine(probe_scores(policy, small, large))
    except ValueError as exc:
        raise InputError(" ".join(str(exc).split())) from None
    except ThinkaheadError as exc:  # a server that is down or answers with errors
        why = " ".join(getattr(exc, "__notes__", []))
        raise InputError(f"the server could not be asked for token scores ({why}): "
                         f"{' '.join(str(exc).split())}") from None


def grader(checker_name: str):
    """Fills `meta["correct"]` of a run that has a reference answer."""
    from thinkahead.verifiers.grading import get_checker

    if checker_name == "none":
        return None
    checker = get_checker(checker_name)

    def annotate(result) -> None:
        reference = result.meta.get("reference")
        if reference is None:
            return
        answer = result.answer if isinstance(result.answer, str) else ("" if result.answer is None else str(result.answer))
        try:
            result.meta["correct"] = bool(checker.check(answer, reference))
        except ValueError:
            result.meta["correct"] = False

    return annotate
