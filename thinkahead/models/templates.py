"""Chat templates as a model loads: repairs of damage done in conversion.

Some GGUF conversions of Qwen2.5's template carry its tool instructions with the JSON example's
braces doubled (`{{"name": <function-name>, ...}}` inside a Jinja string literal, where a literal
brace needs no escaping), so the prompt shows the model `{{...}}` and the model copies it. The
repair rewrites exactly that example to single braces; any other template is left as it is.
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger(__name__)

# The doubled example as it stands inside the template's string literal (quotes escaped as \").
_DOUBLED_CALL = re.compile(r'\{\{(\\"name\\": <function-name>, \\"arguments\\": <args-json-object>)\}\}')


def repaired_template(template: str) -> str:
    """`template` with the doubled-brace tool-call example made single (unchanged if it has none)."""
    return _DOUBLED_CALL.sub(r"{\1}", template)


def repair_chat_template(tokenizer: Any) -> Any:
    """Repair `tokenizer.chat_template` in place where conversion damaged it; returns the tokenizer."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        fixed = repaired_template(template)
        if fixed != template:
            tokenizer.chat_template = fixed
            log.info("repaired the chat template's tool-call example (doubled braces from conversion)")
    return tokenizer
