"""How tool calls look in the model's text and how their results are appended (rollout.multi_turn.format).

- "hermes" (Qwen2.5 / Hermes): a call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  an assistant turn that ends with `</tool_call>` pauses (several calls in the turn all run). The
  results are appended as the chat template renders messages of role "tool" after the assistant's
  turn, plus the generation prompt of the next assistant turn (for Qwen2.5:
  `<|im_end|>\n<|im_start|>user\n<tool_response>\n...\n</tool_response><|im_end|>\n<|im_start|>assistant\n`).
  A template without a tool role gets `<tool_response>` blocks as plain text.
- "code" (code-interpreter models): a fenced block "```python\n...\n```" that ends the text so far
  is run by the first tool of the config (its `code` argument); its output is appended as
  "\n```output\n...\n```\n" and the model continues the same turn.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from hybridflow.tools.base import ToolCall, ToolOutcome

FORMATS = ("hermes", "code")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_CODE_BLOCK = re.compile(r"```python[ \t]*\n(.*?)\n?```\s*$", re.S)
_SENTINEL = "\x00HF_ASSISTANT_TURN\x00"


class ToolFormat:
    """Finds complete calls at the end of a turn's text and renders their results as text."""

    def __init__(self, kind: str, *, tokenizer, tools: list):
        if kind not in FORMATS:
            raise ValueError(f"rollout.multi_turn.format={kind!r}: expected one of {FORMATS}")
        self.kind, self.tok, self.tools = kind, tokenizer, tools
        # the closing marker: a cheap check on the turn's last tokens before any parsing
        self.close = "</tool_call>" if kind == "hermes" else "```"
        self._suffix = None

    def ends_with_call(self, tail_text: str) -> bool:
        return tail_text.rstrip().endswith(self.close)

    def parse(self, turn_text: str) -> Optional[list]:
        """The calls of a turn whose text ends with a closing marker: a list of ToolCall, or of
        ToolOutcome for a call that does not parse (its error text goes back to the model); None
        when the text holds no complete call."""
        if self.kind == "code":
            m = _CODE_BLOCK.search(turn_text)
            if m is None:
                return None
            return [ToolCall(name=self.tools[0].name, arguments={"code": m.group(1)})]
        calls = []
        for body in _HERMES_CALL.findall(turn_text):
            try:
                obj = json.loads(body)
                if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                    raise ValueError('expected {"name": ..., "arguments": {...}}')
                args = obj.get("arguments", {})
                if isinstance(args, str):
                    args = json.loads(args)
                if not isinstance(args, dict):
                    raise ValueError("arguments must be a JSON object")
                calls.append(ToolCall(name=obj["name"], arguments=args))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                calls.append(ToolOutcome(text=f"Error: the tool call does not parse: {e}",
                                         error=True))
        return calls or None

    def render(self, outcomes: list) -> str:
        """The text appended after the turn for these results."""
        if self.kind == "code":
            return "\n```output\n" + "\n".join(o.text.rstrip("\n") for o in outcomes) + "\n```\n"
        if self.tok.has_chat_template:
            return self._template_delta([o.text.rstrip("\n") for o in outcomes])
        body = "".join(f"<tool_response>\n{o.text.rstrip()}\n</tool_response>\n" for o in outcomes)
        return "\n" + body + "assistant: "

    def _template_delta(self, texts: list) -> str:
        """What the template renders after an assistant turn's content for these tool messages,
        up to and including the next generation prompt."""
        msgs = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": _SENTINEL}]
        full = self.tok.apply_chat_template(
            msgs + [{"role": "tool", "content": t} for t in texts], add_generation_prompt=True,
            tools=[t.schema for t in self.tools])
        at = full.find(_SENTINEL)
        if at < 0:
            raise ValueError("the chat template drops the assistant's content; use "
                             "rollout.multi_turn.format=code or a template with tool messages")
        return full[at + len(_SENTINEL):]
