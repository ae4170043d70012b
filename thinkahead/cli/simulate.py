"""`thinkahead simulate`: replay recorded generations through drafters, with no model."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Callable

import click

from thinkahead.token_spec.names import MAX_DRAFT, MODEL_FREE_KINDS


# Drafters that `replay_sessions_shared` can replay together: those of one SuffixCache; the prompt lookups.
SHARED_GROUPS = (("suffix", "suffix-tree", "combined"), ("prompt-lookup", "prompt-lookup-recent"))


@click.command()
@click.argument("recordings", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--drafters", default="suffix,prompt-lookup,prompt-lookup-recent,combined", show_default=True,
              help=f"Comma-separated model-free drafters: {', '.join(MODEL_FREE_KINDS)}.")
@click.option("--model", default=None, help="Replay only this model's generations (needed when the file has several).")
@click.option("--max-draft", type=int, default=MAX_DRAFT, show_default=True,
              help="Draft tokens per verify step at most.")
def simulate(recordings: tuple[Path, ...], drafters: str, model: str | None, max_draft: int) -> None:
    """Replay RECORDINGS (from `--record`) through each drafter: tokens per verify step, draft precision.

    Agent sessions are replayed turn by turn as they ran, so session-aware drafting is judged on
    the real conversations, in seconds. Several files replay one after another through one cache
    per drafter, as one process serving those workloads would.
    """
    kinds = [k.strip() for k in drafters.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in MODEL_FREE_KINDS]
    if not kinds or unknown:
        raise click.UsageError(f"--drafters: unknown {unknown or '(none)'}; choose from {', '.join(MODEL_FREE_KINDS)}")
    if max_draft < 1:
        raise click.UsageError("--max-draft must be at least 1")
    # The imports and the recordings make no garbage: the collector, off meanwhile, does not walk them as they grow.
    gc.disable()
    try:
        from thinkahead.token_spec.presets import model_free_drafter
        from thinkahead.token_spec.recording import read_sessions
        from thinkahead.token_spec.simulator import SessionReplayStats, replay_sessions, replay_sessions_shared
        from thinkahead.token_spec.suffix_cache import SuffixCache

        sessions = _read_all(read_sessions, recordings, model)
    finally:
        gc.enable()
    turns = sum(len(s) for s in sessions)
    click.echo(f"{len(sessions)} sessions, {turns} generations, "
               f"{sum(len(t.output_ids) for s in sessions for t in s)} output tokens")
    rows = [("drafter", "tok/verify", "precision", "update p50 ms")]
    # What is alive now (modules, the recordings) outlives the replays: frozen, the collector stops walking
    # it again on each full collection that the replays' allocations trigger (up to ~0.2 s each).
    gc.freeze()
    try:
        # Drafters of a group draft from the same trees (or n-gram index), turn by turn: replayed together
        # they build them once (the same numbers as one each); the others (and where that is not native) alone.
        done: dict[str, SessionReplayStats] = {}
        for group in SHARED_GROUPS:
            together = [k for k in dict.fromkeys(kinds) if k in group]
            if len(together) > 1:
                cache = SuffixCache()
                shared = replay_sessions_shared([model_free_drafter(k, cache) for k in together], sessions,
                                                max_tokens=max_draft)
                done.update(zip(together, shared or ()))
        for kind in kinds:
            stats = (done.get(kind) or replay_sessions(model_free_drafter(kind), sessions, max_tokens=max_draft,
                                                       native_rounds=True)).summary()
            rows.append((kind, f"{stats['tokens_per_step']:.3f}", f"{stats['draft_precision']:.3f}",
                         f"{stats['update_p50_ms']:.2f}"))
    finally:
        gc.unfreeze()
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        click.echo("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


def _read_all(read_sessions: Callable[..., list], recordings: tuple[Path, ...], model: str | None) -> list:
    """The sessions of every recording, in order (click errors for a bad or empty file)."""
    sessions = []
    for recording in recordings:
        try:
            found = read_sessions(recording, model)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        if not found:
            raise click.ClickException(f"no generations{' of ' + model if model else ''} in {recording}")
        sessions.extend(found)
    return sessions
