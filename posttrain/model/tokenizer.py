"""Tokenizer and chat template: a fast `tokenizers.Tokenizer` built from GGUF metadata or a Hugging Face directory.

GGUF keys: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. The pad id may equal the EOS id."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

# GGUF token types (llama.cpp `llama_token_type`): 3 = CONTROL (special), 4 = USER_DEFINED (added, not special).
_CONTROL, _USER_DEFINED = 3, 4
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# Split regexes of llama.cpp's pre-tokenizer types (llama-vocab.cpp), as used by the models' own tokenizer.json.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre():
    # llama.cpp "smollm"/"starcoder": regexes {"\p{N}", GPT-2}; HF spells it Digits(individual) + ByteLevel.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _split_pre(pattern: str):
    return lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


# `tokenizer.ggml.pre` -> (pre-tokenizer factory, BPE ignore_merges). Unknown values raise rather than guess.
GGUF_PRE_TOKENIZERS = {
    "default": (_gpt2_pre, False),
    "gpt2": (_gpt2_pre, False),
    "smollm": (_digits_then_gpt2_pre, False),
    "starcoder": (_digits_then_gpt2_pre, False),
    "refact": (_digits_then_gpt2_pre, False),
    "codeshell": (_digits_then_gpt2_pre, False),
    "qwen2": (_split_pre(_QWEN2_SPLIT), False),
    "deepseek-r1-qwen": (_split_pre(_QWEN2_SPLIT), False),
    "llama-bpe": (_split_pre(_LLAMA3_SPLIT), True),
    "llama3": (_split_pre(_LLAMA3_SPLIT), True),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies are spelled in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2 `namespace` that refuses underscore-prefixed attributes (as transformers' sandbox does)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template namespace attribute {name!r} is not allowed")


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template as transformers.utils.chat_template_utils does; jinja2.TemplateSyntaxError if bad."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env.from_string(template)


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, Mapping) else value


class Tokenizer:
    """Text <-> token ids, special ids and the chat template; ValueError for a special token not in the vocabulary.

    Args:
      backend: its post-processor decides what `add_special_tokens=True` adds.
      pad_token: defaults to EOS. chat_template: Jinja2 source, or None (`apply_chat_template` then raises ValueError).
    """

    def __init__(self, backend: _Backend, *, eos_token: str, bos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None, chat_template: str | None = None):
        self.backend = backend
        self.special_tokens = {k: v for k, v in zip(_SPECIAL_NAMES, (bos_token, eos_token, unk_token, pad_token))
                               if v is not None}
        self._ids = {}
        for name, token in self.special_tokens.items():
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{name} {token!r} is not in the tokenizer's vocabulary")
            self._ids[name] = token_id
        self.chat_template = chat_template
        self._template = None
        self._stop_ids = None

    # ----- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata: byte-level BPE ("gpt2") with a pre-tokenizer of GGUF_PRE_TOKENIZERS.

        Raises ValueError for another model or pre-tokenizer, or when tokens, merges or the eos id are missing."""
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {model!r}; supported: 'gpt2' (byte-level BPE)")
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZERS:
            raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(GGUF_PRE_TOKENIZERS)}")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"):
            if key not in metadata:
                raise ValueError(f"GGUF tokenizer metadata lacks {key!r}")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # Tokens outside the byte alphabet are llama.cpp mislabels; re-spell them byte by byte (as transformers).
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
        make_pre, ignore_merges = GGUF_PRE_TOKENIZERS[pre]
        backend = _Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        backend.pre_tokenizer = make_pre()
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                                    if k == _CONTROL and set(t) <= alphabet])
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                            if k == _USER_DEFINED and t in vocab])

        def token(key):
            index = metadata.get(f"tokenizer.ggml.{key}")
            return None if index is None else tokens[int(index)]

        bos, eos = token("bos_token_id"), token("eos_token_id")
        head = [bos] if metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None else []
        tail = [eos] if metadata.get("tokenizer.ggml.add_eos_token", False) else []
        if head or tail:
            backend.post_processor = processors.TemplateProcessing(
                single=[*head, "$A", *tail], pair=[*head, "$A", *tail, "$B"],
                special_tokens=[(t, backend.token_to_id(t)) for t in {*head, *tail}])
        return cls(backend, bos_token=bos, eos_token=eos, pad_token=token("padding_token_id"),
                   unk_token=token("unknown_token_id"), chat_template=metadata.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> Tokenizer:
        """Build from a Hugging Face tokenizer directory (as written by `save_pretrained`).

        The chat template: `chat_template.jinja`, else `tokenizer_config.json` (of a named list, "default").
        Raises FileNotFoundError without `tokenizer.json`, ValueError when no EOS token is declared."""
        path = pathlib.Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = _Backend.from_file(str(path / "tokenizer.json"))
        config = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later files win
            if (path / name).is_file():
                config.update(json.loads((path / name).read_text(encoding="utf-8")))
        template = config.get("chat_template")
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}.get("default")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        tokens = {name: _token_content(config.get(name)) for name in _SPECIAL_NAMES}
        if tokens["eos_token"] is None:
            raise ValueError(f"{path} declares no eos_token in tokenizer_config.json or special_tokens_map.json")
        return cls(backend, chat_template=template, **tokens)

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """A 259-id ChatML byte tokenizer for tests: 256 bytes, then pad, `<|im_start|>` and `<|im_end|>` (EOS)."""
        spelling = _bytes_to_unicode()
        vocab = {spelling[b]: b for b in range(256)}
        backend = _Backend(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
        template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
        return cls(backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template)

    # ----- ids and properties -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._ids["eos_token"]

    @property
    def bos_id(self) -> int | None:
        return self._ids.get("bos_token")

    @property
    def pad_id(self) -> int:
        """The pad id; equals `eos_id` when the tokenizer has no pad token (or declares pad == eos)."""
        return self._ids.get("pad_token", self.eos_id)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """EOS and the chat template's end-of-turn token (the special token written after a reply), sorted."""
        if self._stop_ids is None:
            self._stop_ids = tuple(sorted({self.eos_id, *self._end_of_turn_ids()}))
        return self._stop_ids

    def _end_of_turn_ids(self) -> list[int]:
        if self.chat_template is None:
            return []
        sentinel = "posttrainSentinelReply"
        try:
            text = self.apply_chat_template([{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": sentinel}], add_generation_prompt=False)
        except (jinja2.TemplateError, TypeError, KeyError, ValueError):  # a template that rejects this chat
            return []
        after = text[text.rfind(sentinel) + len(sentinel):].lstrip() if sentinel in text else ""
        special = {t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        return [i for content, i in special.items() if after.startswith(content)][:1]

    # ----- text <-> ids -------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (special-token strings map to their ids; add_special_tokens: BOS/EOS as configured)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, ids_batch: Sequence[Sequence[int]] | np.ndarray, skip_special_tokens: bool = True
                     ) -> list[str]:
        return self.backend.decode_batch([[int(i) for i in ids] for ids in ids_batch],
                                         skip_special_tokens=skip_special_tokens)

    # ----- chat template ------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render `messages` ([{"role", "content", ...}]) with the chat template, as transformers does.

        The template sees the messages without None-valued keys, `tools=None`, `documents=None`, the special token
        strings and `kwargs` (which override them). Returns the string, or with tokenize=True its ids.
        Raises ValueError without a template or with no messages; jinja2.TemplateError from the template.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        context = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        text = self._template.render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
        return self.encode(text) if tokenize else text
