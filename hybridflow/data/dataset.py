"""Prompt datasets in verl's format, read from `.jsonl` or `.parquet`, tokenized once at load.

A record (one JSON line, or one parquet row):
    prompt:        a string, or a list of chat messages [{"role": ..., "content": ...}, ...]
    data_source:   str, picks the reward rule (e.g. "openai/gsm8k")
    reward_model:  {"ground_truth": ..., "style": "rule"}  (style optional; any ground-truth type)
    extra_info:    dict, optional; handed to the reward function

Choices:
- Chat prompts are rendered through the tokenizer's chat template with the generation prompt and
  encoded without special tokens (the template owns BOS). `enable_thinking` (data.enable_thinking)
  reaches the template as its `enable_thinking` variable (Qwen3's thinking switch) when it is a
  bool; None leaves the variable undefined, so the template's own default applies. `tools` (the
  OpenAI function schemas of rollout.multi_turn's tool config) reach it as `tools`.
  `system_prompt` (data.system_prompt) becomes the first message of chat prompts that have no
  system message of their own. String prompts are used as they are and get
  BOS when the tokenizer asks for one; so do messages rendered by the plain fallback of a tokenizer
  without a template.
- Tokenization happens eagerly in the constructor: RL prompt sets are small (thousands to a few
  hundred thousand) and a bad record then fails before the first step, not hours in.
- Too-long prompts raise by default, naming the row; `truncation="left"` keeps the last
  `max_prompt_length` tokens (the question usually sits at the end), `"right"` keeps the first ones.
  `prompt_text` always holds the full rendered text.
- Errors name the file and the 1-based line (jsonl), the 0-based row (parquet) or the 0-based record
  (in-memory), plus the field.
- With `require_ground_truth=False` (reward-model-only data) `reward_model` may be absent and the
  ground truth is None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from hybridflow.data.tokenizer import Tokenizer

_TRUNCATIONS = {
    "left": lambda ids, n: ids[-n:],
    "right": lambda ids, n: ids[:n],
}


@dataclass
class PromptItem:
    index: int  # position in the dataset, 0-based; the id rewards and errors refer to
    prompt_ids: list[int]  # (P,) token ids, P <= max_prompt_length
    prompt_text: str  # rendered prompt before truncation
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] | None


class PromptDataset:
    """A list of tokenized `PromptItem`s; index it, iterate it, or take its length."""

    def __init__(self, items: list[PromptItem], *, source: str):
        self.items = items
        self.source = source

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self.items)

    @classmethod
    def from_file(cls, path: str | Path, *, tokenizer: Tokenizer, prompt_key: str = "prompt",
                  max_prompt_length: int, truncation: str = "error",
                  require_ground_truth: bool = True,
                  enable_thinking: bool | None = None, tools: list | None = None,
                  system_prompt: str | None = None) -> "PromptDataset":
        p = Path(path).expanduser()
        if p.suffix not in (".jsonl", ".parquet"):
            raise ValueError(f"dataset file {str(p)!r}: unknown extension {p.suffix!r}; expected .jsonl or .parquet")
        if not p.is_file():
            raise FileNotFoundError(f"dataset file {str(p)!r} does not exist")
        records = _read_jsonl(p) if p.suffix == ".jsonl" else _read_parquet(p)
        return cls._build(records, source=str(p), tokenizer=tokenizer, prompt_key=prompt_key,
                          max_prompt_length=max_prompt_length, truncation=truncation,
                          require_ground_truth=require_ground_truth,
                          enable_thinking=enable_thinking, tools=tools,
                          system_prompt=system_prompt)

    @classmethod
    def from_records(cls, records: Iterable[dict[str, Any]], *, tokenizer: Tokenizer, prompt_key: str = "prompt",
                     max_prompt_length: int, truncation: str = "error", require_ground_truth: bool = True,
                     source: str = "<records>", enable_thinking: bool | None = None,
                     tools: list | None = None,
                  system_prompt: str | None = None) -> "PromptDataset":
        located = ((f"{source}: record {i}", r) for i, r in enumerate(records))
        return cls._build(located, source=source, tokenizer=tokenizer, prompt_key=prompt_key,
                          max_prompt_length=max_prompt_length, truncation=truncation,
                          require_ground_truth=require_ground_truth,
                          enable_thinking=enable_thinking, tools=tools,
                          system_prompt=system_prompt)

    @classmethod
    def _build(cls, located: Iterable[tuple[str, Any]], *, source: str, tokenizer: Tokenizer, prompt_key: str,
               max_prompt_length: int, truncation: str, require_ground_truth: bool,
               enable_thinking: bool | None = None, tools: list | None = None,
                  system_prompt: str | None = None) -> "PromptDataset":
        if truncation != "error" and truncation not in _TRUNCATIONS:
            raise ValueError(f"truncation must be one of error, {', '.join(_TRUNCATIONS)}; got {truncation!r}")
        if not isinstance(max_prompt_length, int) or max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be a positive int, got {max_prompt_length!r}")
        items = []
        for where, record in located:
            item = _parse(record, where=where, index=len(items), tokenizer=tokenizer, prompt_key=prompt_key,
                          require_ground_truth=require_ground_truth, enable_thinking=enable_thinking,
                          tools=tools, system_prompt=system_prompt)
            if len(item.prompt_ids) > max_prompt_length:
                if truncation == "error":
                    raise ValueError(f"{where}: prompt is {len(item.prompt_ids)} tokens, longer than "
                                     f"max_prompt_length={max_prompt_length}; raise max_prompt_length or set "
                                     "truncation to left or right")
                item.prompt_ids = _TRUNCATIONS[truncation](item.prompt_ids, max_prompt_length)
            items.append(item)
        if not items:
            raise ValueError(f"dataset {source!r} has no records")
        return cls(items, source=source)


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {line_no}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise ValueError(f"{path}: cannot read as parquet ({e})") from e
    for row, record in enumerate(table.to_pylist()):
        yield f"{path}: row {row}", record


def _parse(record: Any, *, where: str, index: int, tokenizer: Tokenizer, prompt_key: str,
           require_ground_truth: bool, enable_thinking: bool | None = None,
           tools: list | None = None,
           system_prompt: str | None = None) -> PromptItem:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with fields {prompt_key}, data_source, reward_model; "
                         f"got {type(record).__name__}")
    prompt = _field(record, prompt_key, where)
    if isinstance(prompt, str):
        text, add_special = prompt, True
    elif isinstance(prompt, list):
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"{where}: field {prompt_key!r}[{j}] must be a message "
                                 f'{{"role": str, "content": str}}, got {m!r}')
        if system_prompt and not (prompt and prompt[0]["role"] == "system"):
            prompt = [{"role": "system", "content": system_prompt}, *prompt]
        switch = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        if tools:  # the tool schemas (rollout.multi_turn), for the template's system prompt
            switch["tools"] = tools
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **switch)
        add_special = not tokenizer.has_chat_template
    else:
        raise ValueError(f"{where}: field {prompt_key!r} must be a string or a list of chat messages, "
                         f"got {type(prompt).__name__}")
    ids = tokenizer.encode(text, add_special_tokens=add_special)
    if not ids:
        raise ValueError(f"{where}: field {prompt_key!r} encodes to zero tokens")

    data_source = _field(record, "data_source", where)
    if not isinstance(data_source, str):
        raise ValueError(f"{where}: field 'data_source' must be a string, got {type(data_source).__name__}")

    ground_truth = None
    reward_model = record.get("reward_model")
    if require_ground_truth or reward_model is not None:
        reward_model = _field(record, "reward_model", where)
        if not isinstance(reward_model, dict):
            raise ValueError(f"{where}: field 'reward_model' must be an object with 'ground_truth', "
                             f"got {type(reward_model).__name__}")
        ground_truth = reward_model.get("ground_truth")
        if ground_truth is None and require_ground_truth:
            raise ValueError(f"{where}: field 'reward_model.ground_truth' is missing")

    extra_info = record.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        raise ValueError(f"{where}: field 'extra_info' must be an object, got {type(extra_info).__name__}")
    return PromptItem(index=index, prompt_ids=ids, prompt_text=text, data_source=data_source,
                      ground_truth=ground_truth, extra_info=extra_info)


def _field(record: dict[str, Any], key: str, where: str) -> Any:
    if record.get(key) is None:  # parquet fills absent columns with null
        raise ValueError(f"{where}: required field {key!r} is missing (fields present: {sorted(record)})")
    return record[key]
