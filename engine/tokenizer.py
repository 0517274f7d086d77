"""Tokenizer: a thin wrapper around the Hugging Face ``tokenizers`` library.

Two sources are supported:

* GGUF metadata (``tokenizer.ggml.*`` keys, see the GGUF spec in
  ggml/docs/gguf.md): a GPT-2 style byte-level BPE is rebuilt from
  ``tokenizer.ggml.tokens`` / ``merges`` / ``token_type``.
* A Hugging Face ``tokenizer.json`` file.

No BOS token is ever added by :meth:`Tokenizer.encode`; chat templates insert
whatever special tokens they need as text, and special tokens written in the
text (e.g. ``<|im_start|>``) encode to their single id.
"""
from __future__ import annotations

import numbers

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer

from .errors import ModelError

# GGUF token_type values (llama.cpp enum llama_token_type).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# Split regexes for the pre-tokenizer names written by llama.cpp's converter
# (``tokenizer.ggml.pre``) that differ from the GPT-2 default.
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_PRE_REGEX = {
    "qwen2": _LETTERS + r"\p{N}" + _TAIL,
    "llama-bpe": _LETTERS + r"\p{N}{1,3}" + _TAIL,
}


def _field(fields, key, default=None, source: str = "<gguf>"):
    """Value of GGUF metadata ``key`` from ``GGUFReader.fields`` or ``default``.

    Raises:
        ModelError: the value cannot be read (e.g. a string that is not UTF-8).
    """
    f = fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except UnicodeDecodeError:
        raise ModelError(f"{source}: GGUF metadata key {key} is not valid UTF-8 text; "
                         "re-convert the model or fix that key") from None
    except Exception as e:
        raise ModelError(f"{source}: GGUF metadata key {key} is unreadable ({type(e).__name__}); "
                         "re-download or re-convert the model") from None


def _one_line(text) -> str:
    """``text`` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(str(text).split())


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _gguf_str_list(fields, key, source, required: bool) -> list[str] | None:
    """A GGUF array-of-strings key (None when absent and not ``required``)."""
    v = _field(fields, key, None, source)
    if v is None and not required:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        what = "missing" if v is None else f"a {type(v).__name__}" if not isinstance(v, list) else \
            "empty" if not v else "not all strings"
        raise ModelError(f"{source}: GGUF metadata key {key} must be a non-empty array of strings "
                         f"(it is {what}); re-convert the model with its tokenizer")
    return v


def _gguf_merges(fields, vocab: dict, source) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` checked: each "left right" with both parts and their
    concatenation in the vocabulary (``tokenizers`` would crash on anything else)."""
    key = "tokenizer.ggml.merges"
    if key not in fields:
        raise ModelError(f"{source}: GGUF metadata key {key} is missing, but the BPE tokenizer "
                         "(tokenizer.ggml.model='gpt2') needs its merges; re-convert the model "
                         "with its tokenizer or load the Hugging Face directory")
    merges = []
    for i, m in enumerate(_gguf_str_list(fields, key, source, required=True)):
        parts = m.split(" ")
        problem = None
        if len(parts) != 2 or not all(parts):
            problem = "is not two tokens separated by one space"
        else:
            missing = [t for t in (parts[0], parts[1], parts[0] + parts[1]) if t not in vocab]
            if missing:
                problem = f"uses {missing[0]!r}, which is not in tokenizer.ggml.tokens"
        if problem:
            raise ModelError(f"{source}: GGUF metadata key {key} is malformed: entry {i} {m!r} "
                             f"{problem}; re-convert the model with its tokenizer")
        merges.append((parts[0], parts[1]))
    return merges


def _gguf_token_id(fields, key, n_tokens: int, source) -> int | None:
    v = _field(fields, key, None, source)
    if v is None:
        return None
    if not _is_int(v) or not 0 <= v < n_tokens:
        raise ModelError(f"{source}: GGUF metadata key {key} must be a token id in 0..{n_tokens - 1}, "
                         f"got {v!r}; fix that key or re-convert the model")
    return int(v)


def _pre_tokenizer(pre: str):
    """The pre-tokenizer matching GGUF ``tokenizer.ggml.pre`` == ``pre`` (one of PRE_TOKENIZERS)."""
    if pre in _PRE_REGEX:
        split = pre_tokenizers.Split(Regex(_PRE_REGEX[pre]), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # "smollm" and the GPT-2 like default: digits one by one, then GPT-2 regex.
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


# Values of ``tokenizer.ggml.pre`` this module reproduces; any other would split text
# differently from the model's own tokenizer, so it is refused rather than guessed.
PRE_TOKENIZERS = tuple(_PRE_REGEX) + ("smollm", "gpt2", "default")


class Tokenizer:
    """Text <-> token ids, chat templates and streaming decode.

    Attributes:
        eos_id: the primary end-of-sequence id (int) or None.
        bos_id: the beginning-of-sequence id (int) or None.
        chat_template: a Jinja2 chat template string or None (ChatML is used).
        chat_template_source: where the template came from (a file, or a file
            and a key), used in error messages.
    """

    def __init__(self, hf: _HFTokenizer, eos_id: int | None = None,
                 bos_id: int | None = None, chat_template: str | None = None,
                 chat_template_source: str | None = None):
        self.hf = hf
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.chat_template = chat_template
        self.chat_template_source = chat_template_source

    # ------------------------------------------------------------ builders
    @classmethod
    def from_gguf(cls, fields, source: str = "<gguf>") -> "Tokenizer":
        """Build from ``gguf.GGUFReader(path).fields`` (a dict name -> field).

        Reads ``tokenizer.ggml.{model,pre,tokens,merges,token_type,eos_token_id,
        bos_token_id}`` and ``tokenizer.chat_template`` (GGUF spec, llama.cpp
        converter conventions).  Only ``tokenizer.ggml.model == "gpt2"``
        (byte-level BPE) with a ``tokenizer.ggml.pre`` in :data:`PRE_TOKENIZERS`
        is supported.  Control tokens (token_type 3) become special added
        tokens, user-defined ones (4) plain added tokens.

        Raises:
            ModelError: tokenizer metadata missing, malformed (tokens not
                strings, merges missing or naming unknown tokens, token_type of
                another length, ids out of range) or of an unsupported kind;
                ``source`` (the file name) and the key are named in the message.
        """
        kind = _field(fields, "tokenizer.ggml.model", None, source)
        if kind is None or "tokenizer.ggml.tokens" not in fields:
            raise ModelError(f"{source}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens); "
                             "use a GGUF converted with its tokenizer or a Hugging Face directory")
        if kind != "gpt2":
            raise ModelError(f"{source}: tokenizer.ggml.model={kind!r} is not supported (only "
                             "'gpt2' byte-level BPE); load the Hugging Face directory with "
                             "tokenizer.json instead")
        pre = _field(fields, "tokenizer.ggml.pre", "gpt2", source)
        if pre not in PRE_TOKENIZERS:
            raise ModelError(f"{source}: GGUF metadata key tokenizer.ggml.pre={pre!r} is not supported "
                             f"(known: {', '.join(PRE_TOKENIZERS)}); load the Hugging Face directory "
                             "with tokenizer.json instead")
        tokens = _gguf_str_list(fields, "tokenizer.ggml.tokens", source, required=True)
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ModelError(f"{source}: tokenizer.ggml.tokens contains duplicate tokens; "
                             "re-convert the model or use its Hugging Face directory")
        merges = _gguf_merges(fields, vocab, source)
        types = _field(fields, "tokenizer.ggml.token_type", None, source)
        if types is None:
            types = [_TOKEN_NORMAL] * len(tokens)
        if not isinstance(types, list) or len(types) != len(tokens) or not all(map(_is_int, types)):
            what = (f"{len(types)} integers" if isinstance(types, list) and all(map(_is_int, types))
                    else f"{type(types).__name__} {_one_line(repr(types))[:40]}")
            raise ModelError(f"{source}: GGUF metadata key tokenizer.ggml.token_type must be "
                             f"{len(tokens)} integers (one per token), got {what}; "
                             "re-convert the model with its tokenizer")
        try:
            hf = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        except Exception as e:
            raise ModelError(f"{source}: the GGUF tokenizer (tokenizer.ggml.tokens / merges) is "
                             f"invalid ({_one_line(e)}); re-convert the model") from None
        hf.pre_tokenizer = _pre_tokenizer(pre)
        hf.decoder = decoders.ByteLevel()
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if t == _TOKEN_CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED]
        hf.add_special_tokens(special)
        hf.add_tokens(user)
        eos, bos = (_gguf_token_id(fields, f"tokenizer.ggml.{k}_token_id", len(tokens), source)
                    for k in ("eos", "bos"))
        return cls(hf, eos_id=eos, bos_id=bos,
                   chat_template=_field(fields, "tokenizer.chat_template", None, source),
                   chat_template_source=f"{source} (GGUF key tokenizer.chat_template)")

    @classmethod
    def from_file(cls, path: str, eos_id: int | None = None, bos_id: int | None = None,
                  chat_template: str | None = None) -> "Tokenizer":
        """Load a Hugging Face ``tokenizer.json`` (the ``tokenizers`` format).

        Raises:
            ModelError: the file is missing or not a valid tokenizer.json.
        """
        try:
            hf = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception
            raise ModelError(f"{path}: cannot read tokenizer.json ({str(e).splitlines()[0]}); "
                             "provide the tokenizer.json of the model") from None
        return cls(hf, eos_id=eos_id, bos_id=bos_id, chat_template=chat_template)

    def save(self, path: str) -> None:
        """Write this tokenizer as a Hugging Face ``tokenizer.json`` to ``path``."""
        self.hf.save(str(path))

    # ------------------------------------------------------------ basic API
    @property
    def vocab_size(self) -> int:
        """Number of ids (base vocabulary plus added tokens)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of the token string ``token`` (vocabulary form) or None."""
        return self.hf.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Encode ``text`` to a list of int ids; no BOS/EOS is added.

        Special tokens spelled in the text (e.g. ``<|im_start|>``) map to their id.
        """
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special: bool = False) -> str:
        """Decode a sequence of int ids to text.

        Special tokens are kept as text unless ``skip_special``; invalid UTF-8
        byte sequences become U+FFFD.
        """
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        """A new :class:`StreamDecoder` bound to this tokenizer."""
        return StreamDecoder(self, skip_special)

    # ------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            default_system: bool = False) -> str:
        """Render ``messages`` (dicts with "role" and "content") to a prompt string.

        Uses the model's Jinja2 template (rendered like ``transformers`` does:
        sandboxed, ``trim_blocks``/``lstrip_blocks``) when the model has one,
        otherwise plain ChatML::

            <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n

        A system prompt appears only when ``messages`` start with one: a block that the
        template adds on its own when there is none (SmolLM2's "You are a helpful AI
        assistant named SmolLM ...") is left out, unless ``default_system`` is True
        (the template's output verbatim, as ``transformers`` renders it).

        Raises:
            ModelError: the template is not a string, does not parse, or fails
                while rendering (including its own ``raise_exception``); the
                message names :attr:`chat_template_source`.
        """
        template = self.chat_template
        if template is None or template == "":
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
        where = self.chat_template_source or "the model's chat template"
        fix = "fix the template or run without --chat"
        if isinstance(template, list):      # tokenizer_config.json: [{"name":, "template":}]
            raise ModelError(f"{where}: the chat template is a list of named templates without a "
                             f"usable 'default' entry; {fix}")
        if not isinstance(template, str):
            shown = _one_line(repr(template))
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise ModelError(f"{where}: the chat template must be a string, got {shown} "
                             f"({type(template).__name__}); {fix}")
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ModelError(f"{where}: rendering the chat template needs jinja2; "
                             "pip install jinja2, or run without --chat") from None

        def raise_exception(msg):
            raise ModelError(f"{where}: the chat template refused the conversation: "
                             f"{_one_line(msg)}; {fix}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            compiled = env.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ModelError(f"{where}: chat template syntax error at line {e.lineno}: "
                             f"{_one_line(e.message)}; {fix}") from None
        except Exception as e:
            raise ModelError(f"{where}: the chat template does not compile "
                             f"({type(e).__name__}: {_one_line(e)}); {fix}") from None
        name = lambda i: None if i is None else self.hf.id_to_token(i)  # noqa: E731

        def render(msgs, generation_prompt, bos_token=name(self.bos_id) or ""):
            return compiled.render(messages=msgs, add_generation_prompt=generation_prompt,
                                   bos_token=bos_token, eos_token=name(self.eos_id) or "")
        try:
            text = render(messages, add_generation_prompt)
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"{where}: the chat template failed while rendering "
                             f"({type(e).__name__}: {_one_line(e)}); {fix}") from None
        if default_system or (messages and messages[0].get("role") == "system"):
            return text
        return _without_default_system(render, messages, add_generation_prompt, text)


_MARK = "\x00system prompt\x00"    # a system prompt no conversation contains


def _without_default_system(render, messages, add_generation_prompt, text) -> str:
    """``text`` (the template's rendering of ``messages``, which hold no system message) without
    the system block that the template added on its own, if it did.

    The template's system block is found by rendering a marker system prompt alone
    (``head + _MARK + tail``) and before the conversation (``head + _MARK + tail + rest``):
    ``text`` holds an added block when it reads ``head + anything + tail + rest`` and ``rest``
    holds the messages' texts (it is the conversation); then the result is ``rest``, after the
    BOS text if ``head`` starts with the template's ``bos_token``.  A template that refuses a
    system message, or renders it inside another turn, adds none."""
    system = [{"role": "system", "content": _MARK}]
    try:
        alone = render(system, False)
        no_bos = render(system, False, bos_token="")
        with_mark = render(system + list(messages), add_generation_prompt)
    except Exception:
        return text
    if alone.count(_MARK) != 1 or not with_mark.startswith(alone):
        return text
    head, tail = alone.split(_MARK)
    rest = with_mark[len(alone):]
    texts = [m.get("content") for m in messages if isinstance(m.get("content"), str)]
    if len(text) < len(alone) - len(_MARK) + len(rest) or not text.startswith(head) \
            or not text.endswith(tail + rest) or not all(t in rest for t in texts):
        return text
    bos = alone[:len(alone) - len(no_bos)] if alone.endswith(no_bos) else ""
    return bos + rest


class StreamDecoder:
    """Incremental detokenizer for generation.

    ``push(id)`` returns the new text made final by that id ("" while the tail
    is an incomplete UTF-8 character, i.e. while the decoded tail ends with
    U+FFFD); ``flush()`` returns whatever is still held back.  The
    concatenation of all returned pieces equals ``tokenizer.decode(all ids)``.
    Each step decodes only the ids since the last emitted piece (plus the
    previous piece as context), so the cost per token stays small.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tok = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._ctx = 0    # ids[_ctx:_done] are context: already emitted
        self._done = 0   # ids[:_done] have been emitted as text

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special=self.skip_special)

    def _emit(self) -> str:
        prefix = self._decode(self.ids[self._ctx:self._done])
        full = self._decode(self.ids[self._ctx:])
        self._ctx, self._done = self._done, len(self.ids)
        return full[len(prefix):]

    def push(self, token_id: int) -> str:
        """Add one id; return the text piece it completes (possibly "")."""
        self.ids.append(int(token_id))
        if self._decode(self.ids[self._done:]).endswith("\ufffd"):
            return ""
        return self._emit()

    def flush(self) -> str:
        """Return the held-back tail (may contain U+FFFD for invalid bytes)."""
        return self._emit() if self._done < len(self.ids) else ""
