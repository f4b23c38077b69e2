"""ToolRunner: the tools of a run, their call format, and the thread pool that runs calls while
generation goes on (hybridflow/rollout/multi_turn.py submits a turn's calls and polls the futures)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np

from hybridflow.config import MultiTurnConfig
from hybridflow.tools.base import Tool, ToolOutcome


class ToolRunner:
    """The tools of a run, the call format, and a thread pool that runs calls while decoding goes on."""

    def __init__(self, tools: list, *, fmt, tokenizer, mt: MultiTurnConfig):
        self.tools: dict[str, Tool] = {t.name: t for t in tools}
        self.fmt, self.tok, self.mt = fmt, tokenizer, mt
        self._pool: Optional[ThreadPoolExecutor] = None
        self._close: Optional[np.ndarray] = None  # (vocab,) bool, see close_tokens

    def close_tokens(self, vocab: int) -> np.ndarray:
        """(vocab,) bool: the token ids whose text holds the closing marker's last character
        (hermes: `>`, code: a backtick). Only a turn whose newest token is one of them can have
        just completed a call, so the decode loop decodes no other row's text. Computed once per
        runner (its tokenizer and format)."""
        if self._close is None or len(self._close) != vocab:
            last = self.fmt.close[-1]
            decode, size = self.tok.decode, self.tok.vocab_size
            self._close = np.fromiter(
                (i < size and last in decode([i], skip_special_tokens=False)
                 for i in range(vocab)), dtype=bool, count=vocab)
        return self._close

    def submit(self, items: list) -> Future:
        """Run the calls of one turn (ToolCall, or a ToolOutcome already decided) -> a future of
        their outcomes, in order."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.mt.tool_workers, thread_name_prefix="hf-tool")
        return self._pool.submit(self._run, items)

    def _run(self, items: list) -> list:
        out = []
        for it in items:
            if isinstance(it, ToolOutcome):
                out.append(it)
            elif it.name not in self.tools:
                out.append(ToolOutcome(text=f"Error: unknown tool {it.name!r}; the tools are "
                                            f"{sorted(self.tools)}", error=True))
            else:
                out.append(self.tools[it.name].run(it))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
