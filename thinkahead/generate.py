"""`thinkahead generate`: speculative decoding of a batch of prompts on the embedded default.

All prompts share one suffix cache, so later prompts draft from earlier answers
(the point of SuffixDecoding for agent loops and batch jobs). Each finished
result is appended to the output JSONL and flushed at once; a rerun with the
same output file skips the ids already there, so a crash loses nothing finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
import json

import click

from thinkahead.model_registry import DTYPES

# The choices of --drafter (token_spec.presets.DRAFTER_KINDS, repeated so that --help stays light).
DRAFTERS = ("suffix", "suffix-tree", "prompt-lookup", "draft-model", "hybrid", "combined", "none")


@dataclass(slots=True)
class PromptItem:
    id: str
    prompt: str


def read_prompts(path: Path) -> Iterator[PromptItem]:
    """Prompts from JSONL (`{"id": ..., "prompt": ...}` per line) with line-numbered errors."""
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise click.UsageError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise click.UsageError(f'{path}:{lineno}: expected an object with a string "prompt"')
            yield PromptItem(id=str(row.get("id", lineno)), prompt=row["prompt"])


def done_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    ids = set()
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                ids.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line from a killed run: that item is simply redone
    return ids


def build_decoder(model_spec: str, drafter: str, draft_spec: str | None, dtype: str, max_draft: int, cache_file: Path | None):
    """Load the target (and draft) model and wire the speculative decoder."""
    from thinkahead.model_registry import load_causal_lm
    from thinkahead.token_spec import presets
    from thinkahead.token_spec.backends.hf import HFEngine
    from thinkahead.token_spec.suffix_cache import SuffixCache

    if drafter in ("draft-model", "hybrid") and not draft_spec:
        raise click.UsageError(f"--drafter {drafter} needs --draft-model")
    model, tokenizer = load_causal_lm(model_spec, dtype)
    needs_draft = drafter in ("draft-model", "hybrid")
    draft_engine = HFEngine(load_causal_lm(draft_spec, dtype)[0]) if needs_draft else None
    cache = SuffixCache.load(cache_file) if cache_file is not None and cache_file.exists() else SuffixCache()
    decoder = presets.build_decoder(
        drafter, HFEngine(model), tokenizer=tokenizer, draft_engine=draft_engine, cache=cache, max_draft=max_draft
    )
    return decoder, tokenizer, cache


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
@click.option("-m", "--model", default="qwen2.5-coder-0.5b", show_default=True,
              help="Target model: a packaged name (thinkahead models list), gguf:PATH, hf:ID or a directory.")
@click.option("--drafter", type=click.Choice(DRAFTERS), default="suffix", show_default=True)
@click.option("--draft-model", default=None, help="Small model for --drafter draft-model / hybrid.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-draft", type=click.IntRange(min=0), default=16, show_default=True, help="Most draft tokens per round.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0, min_open=True, max=1), default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="bfloat16", show_default=True)
@click.option("--cache-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Suffix cache to load before and save after the batch (a warm cache across jobs).")
def generate(prompts, input_path, output, model, drafter, draft_model, max_new_tokens, max_draft,
             temperature, top_p, seed, dtype, cache_file) -> None:
    """Generate answers with speculative decoding and print per-prompt speed and acceptance."""
    from thinkahead.token_spec.verify import SamplingParams

    items: list[PromptItem] = [PromptItem(id=str(i + 1), prompt=p) for i, p in enumerate(prompts)]
    if input_path is not None:
        items += list(read_prompts(input_path))
    if not items:
        raise click.UsageError("give prompts as arguments or with --input FILE.jsonl")
    skip = done_ids(output) if output is not None else set()
    todo = [it for it in items if it.id not in skip]
    if skip:
        click.echo(f"resuming: {len(items) - len(todo)} of {len(items)} already in {output}", err=True)
    if not todo:
        return
    decoder, tokenizer, cache = build_decoder(model, drafter, draft_model, dtype, max_draft, cache_file)
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    totals = {"tokens": 0, "decode_s": 0.0, "verify": 0}
    out_fh = open(output, "a", encoding="utf-8") if output is not None else None
    try:
        for item in todo:
            ids = chat_prompt_ids(tokenizer, item.prompt)
            r = decoder.generate(ids, max_new_tokens, sampling=sampling, seed=seed, request_id=item.id)
            s = r.stats
            record = {"id": item.id, "prompt": item.prompt, "text": r.text, "finish_reason": r.finish_reason,
                      "token_ids": r.token_ids, "stats": s.to_dict()}
            if out_fh is not None:
                out_fh.write(json.dumps(record) + "\n")
                out_fh.flush()
            else:
                click.echo(f"--- {item.id}\n{r.text}")
            click.echo(f"[{item.id}] {s.completion_tokens} tokens, {s.tokens_per_s:.2f} tok/s, "
                       f"accept length {s.spec_accept_length:.2f}, {r.finish_reason}", err=True)
            totals["tokens"] += s.completion_tokens
            totals["decode_s"] += s.total_time_s - s.prefill_time_s
            totals["verify"] += s.spec_verify_ct
    finally:
        if out_fh is not None:
            out_fh.close()
        if cache_file is not None:
            cache.save(cache_file)
    if totals["verify"]:
        click.echo(
            f"done: {len(todo)} prompts, {totals['tokens']} tokens, "
            f"{totals['tokens'] / max(totals['decode_s'], 1e-9):.2f} tok/s, "
            f"{totals['tokens'] / totals['verify']:.2f} tokens per verify step",
            err=True,
        )

