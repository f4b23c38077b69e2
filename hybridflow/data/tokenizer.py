"""Tokenizers for prompts and responses, without `transformers`.

`load_tokenizer(path)` accepts
  1. a directory with a Hugging Face `tokenizer.json` (read with the `tokenizers` library), plus the
     optional `tokenizer_config.json` / `special_tokens_map.json` / `chat_template.jinja` beside it;
  2. a sentencepiece `.model` file, or a directory holding exactly one `*.model` (a
     `tokenizer_config.json` beside it may add a chat template and name special tokens).
Every source gives the same small `Tokenizer`.

Choices:
- `encode(text)` adds no special tokens: the same text always maps to the same ids. With
  `add_special_tokens=True` it prepends BOS when the tokenizer wants one (`add_bos_token` in
  tokenizer_config.json; without that key: whatever the HF post-processor adds, and always for
  sentencepiece). EOS is never appended: prompts must not end the sequence.
- Chat templates are rendered with jinja2 in an immutable sandbox, with the same helpers Hugging Face
  gives templates (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII) and the special
  token strings (`bos_token`, `eos_token`, ...) as variables. The template owns BOS: text it renders is
  encoded without special tokens, as verl and transformers do.
- Without a template, messages render as plain "role: content\n" lines followed by "assistant: "
  when `add_generation_prompt` is set, so small demo tokenizers can still take chat data; the
  tokenizer counts those renders (`num_plain_chat_renders`) so its user can say so.
- An EOS token is required (generation needs a stop token); `pad_id` falls back to `eos_id`.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
PLAIN_CHAT_FORMAT = "a 'role: content' line per message then 'assistant: '"  # without a template


class Tokenizer:
    """Encode/decode plus the special ids and chat template of one loaded tokenizer."""

    def __init__(self, *, backend: Any, source: str, eos_id: int, pad_id: int, bos_id: int | None,
                 add_bos: bool, special_tokens: dict[str, str], chat_template: str | None):
        self._backend = backend
        self.source = source
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.add_bos = add_bos and bos_id is not None
        self.special_tokens = special_tokens  # e.g. {"eos_token": "</s>"}, passed to the template
        self.chat_template = chat_template
        self._compiled_template = _compile_template(chat_template) if chat_template else None
        self.num_plain_chat_renders = 0  # chat messages rendered in PLAIN_CHAT_FORMAT

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size()

    @property
    def has_chat_template(self) -> bool:
        return self._compiled_template is not None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids = self._backend.encode(text)
        if add_special_tokens and self.add_bos:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens)

    def decode_batch(self, rows: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """[decode(r) for r in rows]; the HF backend decodes the rows in parallel in Rust, without
        the GIL (a step's responses: one call, not one per row)."""
        return self._backend.decode_batch([list(r) for r in rows], skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render chat `messages` to prompt text; extra kwargs reach the template (e.g. enable_thinking)."""
        if self._compiled_template is None:
            self.num_plain_chat_renders += 1
            lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return lines + ("assistant: " if add_generation_prompt else "")
        return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              **self.special_tokens, **template_kwargs)

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
                f"pad_id={self.pad_id}, bos_id={self.bos_id}, chat_template={self.has_chat_template})")


class _HFBackend:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        self.tok = HFTokenizer.from_file(str(path))
        self.tok.no_truncation()  # a tokenizer.json may ship with these on; we want raw ids
        self.tok.no_padding()

    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, rows: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return self.tok.decode_batch(rows, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def post_processor_adds(self) -> list[int]:
        return self.tok.encode("", add_special_tokens=True).ids


class _SentencePieceBackend:
    def __init__(self, path: Path):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(path))

    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if not self.sp.is_control(i)])
        # sentencepiece always drops control pieces; decode the runs between them and keep their text.
        out, run = [], []
        for i in ids:
            if self.sp.is_control(i):
                out.append(self.sp.decode(run) + self.sp.id_to_piece(i))
                run = []
            else:
                run.append(i)
        return "".join(out) + self.sp.decode(run)

    def decode_batch(self, rows: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return [self.decode(r, skip_special_tokens) for r in rows]

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return None if self.sp.is_unknown(i) and token != self.sp.id_to_piece(i) else i


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from an HF tokenizer directory, a sentencepiece `.model`, or a dir with one."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {str(p)!r} does not exist; expected a directory with "
                                "tokenizer.json, a sentencepiece .model file, or a directory with one .model")
    if p.is_file():
        if p.suffix != ".model":
            raise FileNotFoundError(f"tokenizer path {str(p)!r} is a file but not a sentencepiece .model; pass "
                                    "the directory that holds tokenizer.json, or a .model file")
        return _load_sentencepiece(p, config_dir=p.parent)
    if (p / "tokenizer.json").is_file():
        return _load_hf(p)
    models = sorted(p.glob("*.model"))
    if len(models) == 1:
        return _load_sentencepiece(models[0], config_dir=p)
    if len(models) > 1:
        raise FileNotFoundError(f"tokenizer directory {str(p)!r} holds several sentencepiece models "
                                f"({', '.join(m.name for m in models)}); pass the .model file itself")
    raise FileNotFoundError(f"tokenizer directory {str(p)!r} has neither tokenizer.json nor a sentencepiece "
                            "*.model file")


def _load_hf(directory: Path) -> Tokenizer:
    backend = _HFBackend(directory / "tokenizer.json")
    config = _read_config(directory)
    special = _special_token_strings(config)
    ids = {key: _token_id(backend, special, key, directory) for key in _SPECIAL_KEYS}
    eos_id = _require_eos(ids["eos_token"], directory)
    if "add_bos_token" in config:
        add_bos = bool(config["add_bos_token"])
    else:  # follow what the file's post-processor would do (e.g. Llama-3 adds <|begin_of_text|>)
        add_bos = ids["bos_token"] is not None and ids["bos_token"] in backend.post_processor_adds()
    return Tokenizer(backend=backend, source=str(directory), eos_id=eos_id,
                     pad_id=eos_id if ids["pad_token"] is None else ids["pad_token"], bos_id=ids["bos_token"],
                     add_bos=add_bos, special_tokens=special, chat_template=_chat_template(directory, config))


def _load_sentencepiece(model_path: Path, *, config_dir: Path) -> Tokenizer:
    backend = _SentencePieceBackend(model_path)
    sp = backend.sp
    config = _read_config(config_dir)
    special = {"bos_token": sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None,
               "eos_token": sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None,
               "pad_token": sp.id_to_piece(sp.pad_id()) if sp.pad_id() >= 0 else None,
               "unk_token": sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None}
    special.update(_special_token_strings(config))
    special = {k: v for k, v in special.items() if v is not None}
    ids = {key: _token_id(backend, special, key, config_dir) for key in _SPECIAL_KEYS}
    eos_id = _require_eos(ids["eos_token"], model_path)
    return Tokenizer(backend=backend, source=str(model_path), eos_id=eos_id,
                     pad_id=eos_id if ids["pad_token"] is None else ids["pad_token"], bos_id=ids["bos_token"],
                     add_bos=bool(config.get("add_bos_token", True)), special_tokens=special,
                     chat_template=_chat_template(config_dir, config))


def _read_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json over special_tokens_map.json; both optional."""
    merged: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        f = directory / name
        if f.is_file():
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}: not valid JSON ({e})") from e
            if not isinstance(data, dict):
                raise ValueError(f"{f}: expected a JSON object, got {type(data).__name__}")
            merged.update(data)
    return merged


def _special_token_strings(config: dict[str, Any]) -> dict[str, str]:
    out = {}
    for key in _SPECIAL_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # transformers serialises AddedToken as {"content": ..., ...}
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _token_id(backend: Any, special: dict[str, str], key: str, where: Path) -> int | None:
    token = special.get(key)
    if token is None:
        return None
    i = backend.token_to_id(token)
    if i is None:
        raise ValueError(f"{where}: {key} {token!r} is not in the tokenizer's vocabulary")
    return i


def _require_eos(eos_id: int | None, where: Path) -> int:
    if eos_id is None:
        raise ValueError(f"{where}: no EOS token; set eos_token in tokenizer_config.json (or train the "
                         "sentencepiece model with eos_id >= 0): generation needs a stop token")
    return eos_id


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"  # newer transformers save the template on its own
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: use "default", else the first
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{directory / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                         f"{{name, template}}, got {type(template).__name__}")
    return template


def _compile_template(template: str):
    """Compile a chat template the way transformers does (same sandbox, options and helpers)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat_template does not compile: {e} (template line {e.lineno})") from e


def train_sentencepiece(*, lines: list[str], model_prefix: str | Path, vocab_size: int,
                        model_type: str = "unigram", user_defined_symbols: tuple[str, ...] | list[str] = (),
                        byte_fallback: bool = False, split_digits: bool = True) -> Path:
    """Train a small sentencepiece model from in-memory `lines`; returns the `.model` path.

    Special ids: pad=0 ("<pad>"), unk=1 ("<unk>"), bos=2 ("<s>"), eos=3 ("</s>"); pad at 0 so
    zero-filled buffers read as padding. `vocab_size` is a soft limit (a tiny corpus may give fewer
    pieces rather than fail); every character of the corpus is covered and text is not normalised, so
    decode(encode(s)) == s for text made of seen characters. Digits are split one per piece by default
    (arithmetic-friendly). Meant for demos and tests: it trains in well under a second.
    """
    import sentencepiece as spm

    if model_type not in ("unigram", "char", "bpe", "word"):
        raise ValueError(f"model_type must be one of unigram, char, bpe, word; got {model_type!r}")
    lines = [line for line in lines if line]
    if not lines:
        raise ValueError("train_sentencepiece: lines is empty; need some text to train on")
    prefix = Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=vocab_size, model_type=model_type,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>",
        eos_piece="</s>", user_defined_symbols=list(user_defined_symbols), byte_fallback=byte_fallback,
        split_digits=split_digits, hard_vocab_limit=False, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, num_threads=1, minloglevel=2)
    return prefix.with_name(prefix.name + ".model")
