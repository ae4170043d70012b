"""The paper's SpecReason settings: the 0-9 LLM judge on every draft (no confidence gate).

Scripted models script a judge's reply (next-token log-probabilities of the score digit) but cannot
score a continuation or report their tokens' log-probabilities, which the default check (the large
model's agreement, behind the small model's confidence gate) needs; tests of the judge path say so
with these settings.
"""

LLM_JUDGE = {"judge": "llm", "gate_logprob": None}
LLM_JUDGE_FLAGS = ["--judge", "llm", "--gate-logprob", "off"]  # the same, as CLI options
LLM_SPECREASON = {"name": "specreason", **LLM_JUDGE}  # the policy setting of a config or an Orchestrator
