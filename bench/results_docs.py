"""Regenerate docs/results/ from bench/results/: one page per result, and an index.

    python bench/results_docs.py            # rewrite docs/results/*.md (and remove pages with no source)
    python bench/results_docs.py --check    # write nothing; exit 1 if docs/results/ is not up to date
    python bench/results_docs.py --out DIR  # write the pages to DIR (links still point from docs/results/)

The measurements are the files the benchmarks wrote; the words about them are hand-written notes kept
next to the data. Pages are never edited by hand: edit the notes (or rerun a benchmark), then run this.

Sources and pages:

- A suite folder, `bench/results/<suite>/` holding a `report.md` (what `thinkahead bench` and
  `thinkahead compare` write), becomes `docs/results/<suite>.md`; its notes are
  `bench/results/<suite>/NOTES.md`. The data block is the folder's `report.md` (headings moved
  one level down), the `report.md` of each subfolder (reruns, checks), `simulate.txt` (the replay
  of a `--record` recording, as a fenced block) and every `*.png` of the folder as an image.
- A top-level result, the files `bench/results/<name>.*` and `bench/results/<name>_*.*` (a file goes
  to the longest name that matches: `token_spec_int8.json` to `token_spec_int8`,
  `token_spec_baselines_run1.json` to `token_spec`), becomes `docs/results/<name>.md` when its
  notes `bench/results/NOTES-<name>.md` exist. The data block is `<name>.md`, else `<name>.txt`
  (fenced), else `<name>.json` (rendered as tables), and `<name>.png` as an image.
- `bench/results/NOTES.md` is the introduction of the index, `docs/results/README.md`, which
  links every page and lists top-level files no page claims.

A page is its notes (the first `# ` line is the page title, else the result's name) with the data
block put where the notes hold the line `<!-- data -->` (at the end when they do not), followed by
a "Files" list that links every file of the result. Links in notes are written relative to the
notes file, so they also work when the notes are read next to the data; the generator rewrites
them relative to docs/results/, and a link to another result's notes becomes a link to its page.

Output is deterministic (sorted, no dates), so tests/test_results_docs.py can regenerate the pages
and compare them with the committed ones.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("bench/results")  # relative to the repository root
DOCS = Path("docs/results")
DATA_MARKER = "<!-- data -->"
NOTES = "NOTES.md"
TOP_NOTES_PREFIX = "NOTES-"
LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")


@dataclass
class Result:
    """One page: a suite folder or a top-level result, with its notes and data files (repo-relative)."""

    name: str
    kind: str  # "suite" or "file"
    notes: Path | None
    files: list[Path] = field(default_factory=list)

    @property
    def page(self) -> Path:
        return DOCS / f"{self.name}.md"

    @property
    def main_file(self) -> Path | None:
        """What the data block shows first: a suite's report.md, or `<name>.md`, `.txt` or `.json`."""
        if self.kind == "suite":
            return RESULTS / self.name / "report.md"
        for suffix in (".md", ".txt", ".json"):
            path = (RESULTS / self.name).with_suffix(suffix)
            if path in self.files:
                return path
        return None


def _posix(path: Path | str) -> str:
    return Path(path).as_posix()


def _rel(target: Path, start: Path) -> str:
    """`target` relative to folder `start` (both repo-relative), with forward slashes."""
    return _posix(os.path.relpath(target, start))


def find_results(root: Path = ROOT) -> tuple[list[Result], list[Path]]:
    """Every result under bench/results, and the top-level files no page claims."""
    base = root / RESULTS
    results: list[Result] = []
    for folder in sorted(p for p in base.iterdir() if p.is_dir()):
        if not (folder / "report.md").is_file():
            continue
        notes = folder / NOTES
        files = sorted(p.relative_to(root) for p in folder.rglob("*") if p.is_file() and p.name != NOTES)
        results.append(Result(folder.name, "suite", notes.relative_to(root) if notes.is_file() else None, files))
    names = sorted(p.name[len(TOP_NOTES_PREFIX):-3] for p in base.glob(f"{TOP_NOTES_PREFIX}*.md"))
    by_name = {n: Result(n, "file", RESULTS / f"{TOP_NOTES_PREFIX}{n}.md") for n in names}
    unclaimed = []
    for path in sorted(p for p in base.iterdir() if p.is_file() and not p.name.startswith(("NOTES-", NOTES))):
        owners = [n for n in names if path.name.startswith((f"{n}.", f"{n}_"))]
        if owners:
            by_name[max(owners, key=len)].files.append(path.relative_to(root))
        else:
            unclaimed.append(path.relative_to(root))
    results += [by_name[n] for n in names]
    return results, unclaimed


def _title_and_body(text: str, fallback: str) -> tuple[str, str]:
    lines = text.strip("\n").splitlines()
    if lines and lines[0].startswith("# "):
        return lines[0][2:].strip(), "\n".join(lines[1:]).strip("\n")
    return fallback, "\n".join(lines)


def _rewrite_links(text: str, source_dir: Path, notes_pages: dict[str, Path]) -> str:
    """Relative links of a file in `source_dir` (repo-relative) rewritten for a page in docs/results."""

    def fix(match: re.Match) -> str:
        label, target = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path, hash_, anchor = target.partition("#")
        resolved = Path(os.path.normpath(source_dir / path))
        page = notes_pages.get(_posix(resolved))
        new = _posix(page.name) if page is not None else _rel(resolved, DOCS)
        return f"{label}({new}{hash_}{anchor})"

    return LINK.sub(fix, text)


def _demote(markdown: str, levels: int = 1) -> str:
    """Markdown headings `levels` deeper (outside fenced blocks)."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"^#{1,5} ", line):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out)


def _fenced(text: str) -> str:
    return "```\n" + text.rstrip("\n") + "\n```"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (dict, list)):
        return "`" + json.dumps(value) + "`"
    return str(value).strip().replace("|", "\\|")


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def render_json(data) -> str:
    """A benchmark's JSON as markdown: scalars as a list, flat objects and lists of objects as tables.

    Consecutive flat objects with the same keys share one table, one column each.
    """
    if not isinstance(data, dict):
        return _fenced(json.dumps(data, indent=1))
    parts: list[str] = []
    scalars = [f"- {k}: {_cell(v)}" for k, v in data.items() if not isinstance(v, (dict, list))]
    if scalars:
        parts.append("\n".join(scalars))
    group: list[tuple[str, dict]] = []

    def flush() -> None:
        if group:
            keys = list(group[0][1])
            header = ["", *[f"`{name}`" for name, _ in group]]
            parts.append(_table(header, [[k, *[obj[k] for _, obj in group]] for k in keys]))
            group.clear()

    for key, value in data.items():
        flat = isinstance(value, dict) and all(not isinstance(v, (dict, list)) for v in value.values())
        if flat:
            if group and list(group[0][1]) != list(value):
                flush()
            group.append((key, value))
            continue
        flush()
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            header = list(dict.fromkeys(k for row in value for k in row))
            parts.append(f"`{key}`:\n\n" + _table(header, [[row.get(k, "") for k in header] for row in value]))
        elif isinstance(value, (dict, list)):
            parts.append(f"`{key}`:\n\n" + _fenced(json.dumps(value, indent=1)))
    flush()
    return "\n\n".join(parts)


def _image(path: Path) -> str:
    return f"![{_posix(path.relative_to(RESULTS))}]({_rel(path, DOCS)})"


def data_block(result: Result, root: Path = ROOT) -> str:
    """The generated part of a page: tables, replays and plots of the result's files."""
    parts: list[str] = []
    if result.kind == "suite":
        folder = RESULTS / result.name
        reports = sorted(p for p in result.files if p.name == "report.md")
        for report in sorted(reports, key=lambda p: (p.parent != folder, _posix(p))):
            text = (root / report).read_text()
            if report.parent != folder:
                title, body = _title_and_body(text, "")
                sub = _posix(report.parent.relative_to(folder))
                text = f"## `{sub}/`" + (f": {title}" if title and title != "thinkahead bench" else "") + "\n\n" + body
                parts.append(_rewrite_links(text, report.parent, {}))
            else:
                parts.append(_rewrite_links(_demote(text), report.parent, {}))
        replays = [p for p in result.files if p.name == "simulate.txt"]
        for replay in replays:
            where = _posix(replay.relative_to(folder))
            parts.append(f"Replay of the recorded sessions through the model-free drafters (`{where}`, "
                         "`thinkahead simulate`):\n\n" + _fenced((root / replay).read_text()))
        images = [p for p in result.files if p.suffix == ".png"]
    else:
        path = result.main_file
        if path is not None:
            text = (root / path).read_text()
            if path.suffix == ".md":
                parts.append(_rewrite_links(_demote(text), RESULTS, {}))
            elif path.suffix == ".txt":
                parts.append(_fenced(text))
            else:
                parts.append(render_json(json.loads(text)))
        images = [p for p in result.files if p == (RESULTS / result.name).with_suffix(".png")]
    parts += [_image(p) for p in images]
    return "\n\n".join(parts)


def _notes_pages(results: list[Result]) -> dict[str, Path]:
    return {_posix(r.notes): r.page for r in results if r.notes is not None}


def render_page(result: Result, results: list[Result], root: Path = ROOT) -> str:
    source = RESULTS / result.name if result.kind == "suite" else result.notes
    header = (f"<!-- Generated by bench/results_docs.py from {_posix(source)}"
              + (f"/ (notes: {_posix(result.notes)})" if result.kind == "suite" and result.notes else "")
              + "; do not edit: edit the notes, then run `python bench/results_docs.py`. -->")
    if result.notes is not None:
        title, body = _title_and_body((root / result.notes).read_text(), result.name)
        body = _rewrite_links(body, result.notes.parent, _notes_pages(results))
    else:
        title, body = result.name, ""
    data = data_block(result, root)
    if DATA_MARKER in body:
        body = body.replace(DATA_MARKER, data, 1)
    else:
        body = (body + "\n\n" + data).strip("\n")
    files = "\n".join(f"- [`{_posix(p.relative_to(RESULTS))}`]({_rel(p, DOCS)})" for p in result.files)
    return f"{header}\n\n# {title}\n\n{body}\n\n## Files\n\n{files}\n"


def render_index(results: list[Result], unclaimed: list[Path], root: Path = ROOT) -> str:
    intro_path = RESULTS / NOTES
    if (root / intro_path).is_file():
        title, body = _title_and_body((root / intro_path).read_text(), "Results")
        body = _rewrite_links(body, RESULTS, _notes_pages(results))
    else:
        title, body = "Results", ""
    header = ("<!-- Generated by bench/results_docs.py from bench/results/ (intro: bench/results/NOTES.md); "
              "do not edit: edit the notes, then run `python bench/results_docs.py`. -->")
    lines = [header, "", f"# {title}", ""]
    if body:
        lines += [body, ""]
    for kind, heading in (("file", "Benchmark scripts (top-level results)"), ("suite", "Suites (`thinkahead bench`)")):
        lines += [f"## {heading}", "", "| page | data |", "|---|---|"]
        for r in (r for r in results if r.kind == kind):
            title = _title_and_body((root / r.notes).read_text(), r.name)[0] if r.notes else r.name
            where = RESULTS / r.name if kind == "suite" else r.main_file or r.notes
            shown = _posix(where.relative_to(RESULTS)) + ("/" if kind == "suite" else "")
            lines.append(f"| [{title}]({r.page.name}) | [`{shown}`]({_rel(where, DOCS)}) |")
        lines.append("")
    if unclaimed:
        lines += ["## Other files", "", "No page describes these yet (add `bench/results/NOTES-<name>.md`):", ""]
        lines += [f"- [`{p.name}`]({_rel(p, DOCS)})" for p in unclaimed] + [""]
    return "\n".join(lines)


def render_all(root: Path = ROOT) -> dict[str, str]:
    """Every page of docs/results/, by file name."""
    results, unclaimed = find_results(root)
    pages = {r.page.name: render_page(r, results, root) for r in results}
    pages["README.md"] = render_index(results, unclaimed, root)
    return pages


def stale(pages: dict[str, str], folder: Path) -> list[str]:
    """Names of pages that differ from `folder`'s, are missing there, or are there with no source."""
    have = {p.name for p in folder.glob("*.md")} if folder.is_dir() else set()
    out = [n for n, text in pages.items() if not (folder / n).is_file() or (folder / n).read_text() != text]
    return sorted(out + [n for n in have if n not in pages])


def write(pages: dict[str, str], folder: Path) -> None:
    """Write the pages to `folder` and remove its .md files that no source produces."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.md"):
        if old.name not in pages:
            old.unlink()
    for name, text in pages.items():
        (folder / name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / DOCS, help="Folder to write [docs/results].")
    parser.add_argument("--check", action="store_true", help="Write nothing; exit 1 if the folder is stale.")
    args = parser.parse_args(argv)
    pages = render_all()
    if args.check:
        bad = stale(pages, args.out)
        for name in bad:
            print(f"{args.out / name}: out of date; run python bench/results_docs.py", file=sys.stderr)
        return 1 if bad else 0
    write(pages, args.out)
    print(f"{len(pages)} pages in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
