"""`thinkahead generate`: speculative decoding of a batch of prompts on the embedded default.

All prompts share one suffix cache, so later prompts draft from earlier answers
(the point of SuffixDecoding for agent loops and batch jobs). Each finished
result is appended to the output JSONL (a `JsonlLog` of kind "generations", whose
header records the settings) and fsynced at once; a rerun with the same output file
and settings skips the ids already there, so a crash loses nothing finished. Every
path and file is checked before a model loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import click

from thinkahead.cli.options import InputError, model_file_errors, output_errors, same_file
from thinkahead.config import default
from thinkahead.models.engine.weights.load import DTYPES
from thinkahead.token_spec.names import (
    DRAFTER_CHOICES, HEAD_KIND, MODEL_DRAFT_KINDS, SOLO_DRAFTER, packaged_head, resolve_drafter,
)


@dataclass(slots=True)
class PromptItem:
    id: str
    prompt: str


def read_prompts(path: Path) -> Iterator[PromptItem]:
    """Prompts from JSONL (`{"id": ..., "prompt": ...}` per line); the first bad line stops with its number."""
    seen: dict[str, int] = {}
    with open(path, "rb") as fh:  # lines end at b"\n" only, as editors count them
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise InputError(f"{path}:{lineno}: not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})") from None
            except ValueError as exc:
                raise InputError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise InputError(f'{path}:{lineno}: expected an object with a string "prompt"')
            rid = str(row.get("id", lineno))
            if rid in seen:
                raise InputError(f"{path}:{lineno}: duplicate id {rid!r} (first on line {seen[rid]})")
            seen[rid] = lineno
            yield PromptItem(id=rid, prompt=row["prompt"])


GENERATIONS_KIND = "generations"


def _generation(record: dict) -> dict:
    if not isinstance(record.get("id"), str) or not isinstance(record.get("text"), str):
        raise ValueError('expected an object with string "id" and "text"')
    return record


def generation_log(path: Path, config: dict | None = None):
    """The output file of `generate` as a `JsonlLog` (read it with `list(...)`, one dict per result)."""
    from thinkahead.orchestrator.jsonl import JsonlLog

    return JsonlLog(path, GENERATIONS_KIND, _generation, config)


def load_cache(cache_file: Path | None):
    """The suffix cache to start from: `cache_file` if it exists (checked now, before any model loads)."""
    from thinkahead.token_spec.suffix_cache import SuffixCache

    if cache_file is None or not cache_file.exists():
        return SuffixCache()
    try:
        return SuffixCache.load(cache_file)
    except (ValueError, OSError, EOFError, KeyError, TypeError) as exc:
        raise InputError(f"--cache-file {cache_file}: not a readable suffix cache ({exc}); "
                         "delete it or give another path") from None


def check_writable_dir(path: Path, option: str) -> None:
    """A file can be created at `path` (its folder exists and takes writes); else an input error."""
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"{option} {path} is a directory, not a file")
    if not folder.is_dir():
        raise InputError(f"{option} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{option} {path}: folder {folder} is not writable")


def build_decoder(model_spec: str, drafter: str, draft_spec: str | None, dtype: str, max_draft: int, cache):
    """Load the target (and draft) model and wire the speculative decoder over `cache`."""
    from thinkahead.models.engine.weights.load import load_causal_lm
    from thinkahead.token_spec import presets
    from thinkahead.models.engine.runner import HFEngine

    model, tokenizer = load_causal_lm(model_spec, dtype)
    engine = HFEngine(model)
    vocab = engine.vocab_size  # a GGUF model's embedding has no `.weight`: its blocks are looked up on demand
    largest = cache.max_token_id()
    if largest is not None and largest >= vocab:
        raise InputError(f"--cache-file holds token id {largest}, outside {model_spec}'s vocabulary of {vocab}: "
                         "it was built for another model; use another --cache-file")
    needs_draft = drafter in MODEL_DRAFT_KINDS
    draft_engine = HFEngine(load_causal_lm(draft_spec, dtype)[0]) if needs_draft else None
    decoder = presets.build_decoder(
        drafter, engine, tokenizer=tokenizer, draft_engine=draft_engine, cache=cache, max_draft=max_draft
    )
    return decoder, tokenizer


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as one user turn under the model's chat template (plain text if it has none)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(prompt)["input_ids"]


@click.command("generate")
@click.argument("prompts", nargs=-1)
@click.option("-i", "--input", "input_path", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help='JSONL of {"id": ..., "prompt": ...} lines.')
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Append results here as JSONL (and skip ids already in it).")
@click.option("-m", "--model", default=default("small.spec"), show_default=True,
              help="Target model: a packaged name (thinkahead models list), gguf:PATH, hf:ID or a directory.")
@click.option("--drafter", type=click.Choice(DRAFTER_CHOICES), default=default("small.drafter"), show_default=True,
              help=f"Token drafter; auto: {HEAD_KIND} where a draft head is packaged for the model, else {SOLO_DRAFTER}; "
              "draft-model and hybrid need --draft-model.")
@click.option("--draft-model", default=None, help="Small model with the target's tokenizer, for --drafter "
              "hybrid and draft-model.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-draft", type=click.IntRange(min=1), default=default("small.max_draft"), show_default=True,
              help="Most draft tokens per round.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0, min_open=True, max=1), default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=default("small.dtype"), show_default=True)
@click.option("--cache-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Suffix cache to load before and save after the batch (a warm cache across jobs).")
def generate(prompts, input_path, output, model, drafter, draft_model, max_new_tokens, max_draft,
             temperature, top_p, seed, dtype, cache_file) -> None:
    """Generate answers with speculative decoding and print per-prompt speed and acceptance."""
    from thinkahead.token_spec.verify import SamplingParams

    from thinkahead.models.loader import check_model_spec

    items: list[PromptItem] = [PromptItem(id=str(i + 1), prompt=p) for i, p in enumerate(prompts)]
    if input_path is not None:
        items += list(read_prompts(input_path))
    if not items:
        raise click.UsageError("give prompts as arguments or with --input FILE.jsonl")
    if draft_model and drafter not in MODEL_DRAFT_KINDS:
        raise click.UsageError(f"--draft-model drafts for --drafter hybrid or draft-model, not {drafter}")
    try:
        drafter = resolve_drafter(drafter, draft_model is not None, has_head=packaged_head(model) is not None)
    except ValueError as exc:
        if drafter == HEAD_KIND:
            raise click.UsageError(f"--drafter head: {exc}") from None
        raise click.UsageError(f"--drafter {drafter} needs --draft-model") from None
    for option, spec in (("--model", model), ("--draft-model", draft_model)):
        try:
            if spec is not None:
                check_model_spec(spec)
        except ValueError as exc:
            raise InputError(f"{option}: " + " ".join(str(exc).split())) from None
    if output is not None and input_path is not None and same_file(output, input_path):
        raise InputError(f"-o {output} is the input file; write results to another file")
    if cache_file is not None:
        check_writable_dir(cache_file, "--cache-file")
    cache = load_cache(cache_file)
    settings = {"model": model, "drafter": drafter, "draft_model": draft_model, "dtype": dtype,
                "max_new_tokens": max_new_tokens, "max_draft": max_draft, "temperature": temperature,
                "top_p": top_p, "seed": seed}
    out_log = generation_log(output, settings) if output is not None else None
    skip: set[str] = set()
    if out_log is not None:
        with output_errors(output):
            out_log.open_for_append(lambda record: skip.add(record["id"]))  # one read: checks and ids
    if out_log is not None and out_log.moved_torn_to is not None:
        click.echo(f"{output}: a torn last line (a write cut short) was moved to {out_log.moved_torn_to}", err=True)
    todo = [it for it in items if it.id not in skip]
    if skip:
        click.echo(f"resuming: {len(items) - len(todo)} of {len(items)} already in {output}", err=True)
    if not todo:
        return
    with model_file_errors():
        decoder, tokenizer = build_decoder(model, drafter, draft_model, dtype, max_draft, cache)
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    totals = {"tokens": 0, "decode_s": 0.0, "verify": 0}
    try:
        for item in todo:
            ids = chat_prompt_ids(tokenizer, item.prompt)
            r = decoder.generate(ids, max_new_tokens, sampling=sampling, seed=seed, request_id=item.id)
            s = r.stats
            record = {"id": item.id, "prompt": item.prompt, "text": r.text, "finish_reason": r.finish_reason,
                      "token_ids": r.token_ids, "stats": s.to_dict()}
            if out_log is not None:
                out_log.append_record(record)
            else:
                click.echo(f"--- {item.id}\n{r.text}")
            click.echo(f"[{item.id}] {s.completion_tokens} tokens, {s.tokens_per_s:.2f} tok/s, "
                       f"accept length {s.spec_accept_length:.2f}, {r.finish_reason}", err=True)
            totals["tokens"] += s.completion_tokens
            totals["decode_s"] += s.total_time_s - s.prefill_time_s
            totals["verify"] += s.spec_verify_ct
    finally:
        if out_log is not None:
            out_log.close()
        if cache_file is not None:
            cache.save(cache_file)  # atomic: a temporary file renamed over the old cache
    if totals["verify"]:
        click.echo(
            f"done: {len(todo)} prompts, {totals['tokens']} tokens, "
            f"{totals['tokens'] / max(totals['decode_s'], 1e-9):.2f} tok/s, "
            f"{totals['tokens'] / totals['verify']:.2f} tokens per verify step",
            err=True,
        )

