"""Token recordings: every generation's prompt and output ids, appended to JSONL as they happen.

A model run with `record=PATH` writes one line per generation (model, session, prompt ids,
output ids) and one line when a session ends. `read_sessions` groups them back into agent
sessions, in order, so the simulator can replay real outputs through any drafter with no model
(`thinkahead simulate`). The end lines matter when a session id comes back later (a benchmark
runs the same tasks under several configurations): that is a new session, not a continuation.
"""

from __future__ import annotations

from array import array
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from thinkahead.token_spec.simulator import Turn


class TokenRecorder:
    """Appends generations to a JSONL file; safe to share between threads."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"token recording {self.path} is a directory, not a .jsonl file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def record(self, model: str, session_id: str | None, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self._append({"model": model, "session_id": session_id, "prompt_ids": list(prompt_ids),
                      "output_ids": list(output_ids)})

    def end_session(self, model: str, session_id: str) -> None:
        """Note that `session_id` ended: a later generation under that id starts a new session."""
        self._append({"model": model, "session_id": session_id, "end": True})

    def _append(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)


def read_sessions(path: str | os.PathLike[str], model: str | None = None) -> list[list[Turn]]:
    """The recorded generations as sessions of turns (a generation without a session is its own).

    `model` keeps only that model's generations; a file holding several models needs it, since
    their token ids do not mix.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"token recording {path} does not exist")
    open_sessions: dict[object, list[Turn]] = {}
    sessions: list[list[Turn]] = []  # in order of each session's first generation
    models: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                name, sid = record["model"], record["session_id"]
                if record.get("end"):
                    open_sessions.pop((name, sid), None)
                    continue
                turn = Turn(_token_ids(record["prompt_ids"]), _token_ids(record["output_ids"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"{path}:{lineno}: not a token record ({exc})") from exc
            models.add(name)
            if model is not None and name != model:
                continue
            key = (name, sid) if sid is not None else (name, "line", lineno)
            if key not in open_sessions:
                open_sessions[key] = []
                sessions.append(open_sessions[key])
            elif open_sessions[key]:
                _share_prefix(turn, open_sessions[key][-1])
            open_sessions[key].append(turn)
    if model is None and len(models) > 1:
        raise ValueError(f"{path} holds generations of several models ({', '.join(sorted(models))}); pick one")
    return sessions


def _share_prefix(turn: Turn, previous: Turn) -> None:
    """Where `turn`'s prompt continues `previous` (prompt + output), hold that prefix as the very same ids.

    Equal values either way; but a replay compares each prompt with the previous turn's conversation
    once per drafter (and drafters again, to continue their sessions), and identical objects compare
    at a pointer check each, where ids parsed apart compare as numbers.
    """
    old = previous.prompt_ids + previous.output_ids
    prompt = turn.prompt_ids
    if len(prompt) >= len(old) and prompt[:len(old)] == old:
        turn.prompt_ids = old + prompt[len(old):]


def _token_ids(value: object) -> list[int]:
    """A record's token ids as parsed: a list of integers, checked in one C-level pass instead of copied."""
    if type(value) is not list:
        raise TypeError(f"token ids must be a list, got {type(value).__name__}")
    array("q", value)  # TypeError for anything but integers, OverflowError beyond 64 bits
    return value
