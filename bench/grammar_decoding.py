"""Grammar-constrained decoding on the real model (greedy, one process).

1. speed   Constrained against unconstrained decoding on the same outputs: each prompt is decoded under its
           JSON schema, then without a grammar for as many tokens as the constrained output has; "same" says
           whether the free output's token ids equal the constrained ones (where not, tok/s still compares).
           Rows: the plain decoder and the suffix drafter; each arm its own decoder (the suffix ones each with
           a fresh SuffixCache, so one arm's outputs never draft the other's), no KV prefix pool. Per prompt
           the four runs go ABBA, reversed on every other prompt. tok/s leaves out the first token (prefill).
2. extract A pipeline sub-agent's workload: one extraction prompt over many short texts into a 5-key schema
           (nested object, array of objects, enums). The suffix drafter under the grammar: arm A as the library
           does it (grammar-forced tokens drafted for free), arm B with `Constraint.forced` patched to return
           nothing; each arm its own fresh SuffixCache. Reported: tokens per verify step and A/B; A and B must
           give the same tokens (greedy is lossless), each output JSON valid against the schema.

The load average before and after goes into the JSON: timings on a busy machine do not compare.
Writes bench/results/grammar_decoding.json and prints markdown tables. Run:
  python bench/grammar_decoding.py            # 6 prompts, 8 items
  python bench/grammar_decoding.py --quick    # 2 and 2 (a smoke run)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
import argparse
import json
import os
import platform

import jsonschema
import torch

from thinkahead.models import LocalModel
from thinkahead.token_spec import grammar as grammar_mod
from thinkahead.token_spec.decoder import GenerationResult, SpeculativeDecoder
from thinkahead.token_spec.grammar import GrammarSpec
from thinkahead.token_spec.presets import build_decoder
from thinkahead.token_spec.suffix_cache import SuffixCache

RESULTS = Path(__file__).resolve().parent / "results"
STR, INT, NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}


def obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


PERSON = obj(name=STR, age=INT, email=STR, city=STR, hobbies={"type": "array", "items": STR})
PRODUCT = obj(sku=STR, name=STR, price=NUM, in_stock={"type": "boolean"}, tags={"type": "array", "items": STR})
ORDER = obj(order_id=STR, customer=STR, items={"type": "array", "items": obj(product=STR, quantity=INT)},
            total=NUM, status={"enum": ["pending", "shipped", "delivered", "cancelled"]})
SPEED_PROMPTS: list[tuple[str, dict[str, Any]]] = [
    ("a fictional person who lives in a small coastal town", PERSON),
    ("a fictional kitchen gadget sold by an online shop", PRODUCT),
    ("a fictional online order of three office supplies", ORDER),
    ("a fictional retired astronaut who now teaches chemistry", PERSON),
    ("a fictional pair of trail-running shoes", PRODUCT),
    ("a fictional order of garden tools that was cancelled", ORDER),
]
TICKET = obj(customer=obj(name=STR, email=STR), product=STR,
             issue={"enum": ["billing", "shipping", "defect", "account", "other"]},
             priority={"enum": ["low", "medium", "high"]}, items={"type": "array", "items": obj(sku=STR, qty=INT)})
TICKETS = [
    "Maria Lopez (maria.lopez@example.com): my Breeze 300 desk fan came with a cracked blade. 2x BF-300. Fix it soon!",
    "Tom Becker here, tom.b@example.org. I was charged twice for my Aurora lamp order (1x AL-22). Not urgent.",
    "From Priya Nair <priya@example.net>: where is my package? 3x KT-9 kettles and 1x KT-9F filter, two weeks ago.",
    "Jonas Vik (jonas.vik@example.com): I can't log in to register my Orbit 5 headphones (OR-5, qty 1). No rush.",
    "Aiko Tanaka, aiko.t@example.jp. The Nimbus rice cooker (NR-10, bought 1) stopped heating. Urgent, I run a cafe.",
    "Sam O'Neil, sam.oneil@example.ie: does the Drift chair (DC-4) come in green? I have 4 in my cart already.",
    "Lena Fischer (lena@example.de): invoice 4471 lists 5x PN-2 pens, but I ordered 2x PN-2 and 1x PN-7 notebook.",
    "This is Omar Haddad, omar.h@example.com. My Volt charger (VC-65) box arrived empty! Ordered 2. Need it ASAP.",
]


def cpu_flags() -> dict[str, bool]:
    info = Path("/proc/cpuinfo")
    flags = set(info.read_text().split()) if info.exists() else set()
    return {"avx2": "avx2" in flags, "avx512f": "avx512f" in flags, "avx512_vnni": "avx512_vnni" in flags,
            "amx": any(f.startswith("amx") for f in flags)}


@contextmanager
def no_forced_drafts() -> Iterator[None]:
    """The same drafter without grammar-forced drafts: `Constraint.forced` gives nothing inside."""
    saved = grammar_mod.Constraint.forced
    grammar_mod.Constraint.forced = lambda self, limit: []  # type: ignore[method-assign]
    try:
        yield
    finally:
        grammar_mod.Constraint.forced = saved  # type: ignore[method-assign]


def parse_valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def prompt_ids(model: LocalModel, content: str) -> list[int]:
    return model.encode(model.render([{"role": "user", "content": content}]))


def run(model: LocalModel, decoder: SpeculativeDecoder, ids: list[int], n: int,
        spec: GrammarSpec | None) -> GenerationResult:
    constraint = model.grammars.constraint(spec) if spec is not None else None
    return decoder.generate(ids, n, stop_token_ids=model.stop_token_ids, constraint=constraint)


def fresh(kind: str, model: LocalModel) -> SpeculativeDecoder:
    """A decoder of drafter `kind` over the model's engine, with its own empty SuffixCache and no KV prefix pool."""
    return build_decoder(kind, model.engine, tokenizer=model.tokenizer, cache=SuffixCache())


def record(r: GenerationResult) -> dict[str, Any]:
    s = r.stats
    return {"tokens": s.completion_tokens, "finish": r.finish_reason, "total_s": round(s.total_time_s, 3),
            "decode_s": round(s.total_time_s - s.first_token_s, 3), "decode_tok_s": round(s.tokens_per_s, 2),
            "verify_ct": s.spec_verify_ct, "proposed": s.spec_num_proposed_drafts,
            "correct": s.spec_num_correct_drafts, "forced": s.grammar_forced_drafts,
            "tok_per_verify": round(s.spec_accept_length, 3), "text": r.text}


def tok_s(rows: list[dict[str, Any]]) -> float:
    """Decode tokens/s over all rows (the first token, which carries the prefill, left out)."""
    time_s = sum(r["decode_s"] for r in rows)
    return sum(r["tokens"] - 1 for r in rows) / time_s if time_s > 0 else 0.0


def speed(model: LocalModel, prompts: list[tuple[str, dict[str, Any]]], max_new: int) -> list[dict[str, Any]]:
    decoders = {(row, arm): fresh(kind, model) for row, kind in (("plain", "none"), ("suffix", "suffix"))
                for arm in ("constrained", "free")}
    rows: list[dict[str, Any]] = []
    for i, (what, schema) in enumerate(prompts):
        keys = ", ".join(schema["properties"])
        ask = (f"Invent {what}. Reply with one line of JSON only, no code fence, no other text: an object with "
               f"the keys {keys}, in that order, written with ', ' and ': ' as separators.")
        ids, spec = prompt_ids(model, ask), GrammarSpec.json_schema(schema)
        order = ["plain", "suffix"] if i % 2 == 0 else ["suffix", "plain"]
        out: dict[str, dict[str, Any]] = {}
        ref: list[int] = []
        for j, row in enumerate(order):  # ABBA: the first row constrained first, the second free first
            arms = ["constrained", "free"] if j == 0 else ["free", "constrained"]
            for arm in arms:
                r = run(model, decoders[row, arm], ids, len(ref) if arm == "free" else max_new,
                        spec if arm == "constrained" else None)
                if arm == "constrained" and not ref:
                    ref = r.token_ids
                elif arm == "constrained" and r.token_ids != ref:
                    print(f"!! prompt {i}: the {row} decoder's constrained output differs from the other row's")
                out[f"{row}/{arm}"] = {**record(r), "same_as_constrained": r.token_ids == ref}
        valid = parse_valid(out["plain/constrained"]["text"], schema)
        rows.append({"prompt": i, "what": what, "order": order, "constrained_valid": valid, "runs": out})
        print(f"speed {i}: {len(ref)} tokens, valid {valid}, free the same: {out['plain/free']['same_as_constrained']}")
    return rows


def extract(model: LocalModel, texts: list[str], max_new: int) -> list[dict[str, Any]]:
    spec = GrammarSpec.json_schema(TICKET)
    arms = {arm: fresh("suffix", model) for arm in ("A", "B")}
    rows: list[dict[str, Any]] = []
    for i, text in enumerate(texts):
        ask = ("You are the extraction agent of a support pipeline. Extract the ticket below into JSON matching "
               f"this JSON schema:\n{json.dumps(TICKET)}\nReply with the JSON only.\n\nTicket: {text}")
        ids = prompt_ids(model, ask)
        out: dict[str, dict[str, Any]] = {}
        for arm in (["A", "B"] if i % 2 == 0 else ["B", "A"]):
            with no_forced_drafts() if arm == "B" else nullcontext():
                r = run(model, arms[arm], ids, max_new, spec)
            out[arm] = {**record(r), "ids": r.token_ids, "valid": parse_valid(r.text, TICKET)}
        same = out["A"].pop("ids") == out["B"].pop("ids")
        if not same:
            print(f"!! extract item {i}: arm A and arm B outputs differ (greedy should be lossless)\n"
                  f"   A: {out['A']['text']!r}\n   B: {out['B']['text']!r}")
        rows.append({"item": i, "same": same, "arms": out})
        print(f"extract {i}: tok/verify A {out['A']['tok_per_verify']} B {out['B']['tok_per_verify']}, same {same}")
    return rows


def summarize(speed_rows: list[dict[str, Any]], extract_rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"speed": {}, "extract": {}}
    for row in ("plain", "suffix"):
        free = [p["runs"][f"{row}/free"] for p in speed_rows]
        c, f = tok_s([p["runs"][f"{row}/constrained"] for p in speed_rows]), tok_s(free)
        summary["speed"][row] = {"constrained_tok_s": round(c, 2), "free_tok_s": round(f, 2),
                                 "ratio": round(c / f, 3) if f else None,
                                 "same_share": round(sum(r["same_as_constrained"] for r in free) / len(free), 3)}
    for arm in ("A", "B"):
        recs = [item["arms"][arm] for item in extract_rows]
        tokens, verify = sum(r["tokens"] for r in recs), sum(r["verify_ct"] for r in recs)
        summary["extract"][arm] = {"tokens": tokens, "verify_ct": verify, "tok_per_verify": round(tokens / verify, 3),
                                   "forced": sum(r["forced"] for r in recs), "tok_s": round(tok_s(recs), 2),
                                   "valid": sum(r["valid"] for r in recs)}
    e = summary["extract"]
    e.update(ratio_A_B=round(e["A"]["tok_per_verify"] / e["B"]["tok_per_verify"], 3), items=len(extract_rows),
             identical=sum(item["same"] for item in extract_rows))
    return summary


def print_tables(s: dict[str, Any]) -> None:
    print("\n| decoder | constrained tok/s | unconstrained tok/s | constrained/unconstrained | same outputs |")
    print("|---|---|---|---|---|")
    for row, v in s["speed"].items():
        print(f"| {row} | {v['constrained_tok_s']} | {v['free_tok_s']} | {v['ratio']}x | {v['same_share']:.0%} |")
    e = s["extract"]
    print("\n| extraction (suffix + grammar) | tokens | verify steps | tok/verify | forced drafts | tok/s | valid |")
    print("|---|---|---|---|---|---|---|")
    for arm, name in (("A", "A: grammar-forced drafts"), ("B", "B: no forced drafts")):
        v = e[arm]
        print(f"| {name} | {v['tokens']} | {v['verify_ct']} | {v['tok_per_verify']} | {v['forced']} | {v['tok_s']} "
              f"| {v['valid']}/{e['items']} |")
    print(f"\nA/B tokens per verify: {e['ratio_A_B']}x; A and B identical on {e['identical']}/{e['items']} items")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quick", action="store_true", help="2 prompts and 2 items (a smoke run)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--out", default=str(RESULTS / "grammar_decoding.json"))
    args = ap.parse_args()
    n_prompts, n_items = (2, 2) if args.quick else (len(SPEED_PROMPTS), len(TICKETS))
    load = os.getloadavg()
    model = LocalModel(args.model, dtype=args.dtype)
    run(model, fresh("none", model), prompt_ids(model, "Say hi."), 8, None)  # warm-up
    speed_rows = speed(model, SPEED_PROMPTS[:n_prompts], args.max_new_tokens)
    extract_rows = extract(model, TICKETS[:n_items], args.max_new_tokens)
    summary = summarize(speed_rows, extract_rows)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": args.model,
            "dtype": args.dtype, "quick": args.quick, "max_new_tokens": args.max_new_tokens,
            "load_avg_before": load, "load_avg_after": os.getloadavg(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "cpu_flags": cpu_flags()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "speed": speed_rows, "extract": extract_rows},
                              indent=1, ensure_ascii=False))
    print_tables(summary)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
