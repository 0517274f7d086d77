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


def _field(fields, key, default=None):
    """Value of GGUF metadata ``key`` from ``GGUFReader.fields`` or ``default``."""
    f = fields.get(key)
    return default if f is None else f.contents()


def _pre_tokenizer(pre: str):
    """The pre-tokenizer matching GGUF ``tokenizer.ggml.pre`` == ``pre``."""
    if pre in _PRE_REGEX:
        split = pre_tokenizers.Split(Regex(_PRE_REGEX[pre]), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # "smollm" and the GPT-2 like default: digits one by one, then GPT-2 regex.
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


class Tokenizer:
    """Text <-> token ids, chat templates and streaming decode.

    Attributes:
        eos_id: the primary end-of-sequence id (int) or None.
        bos_id: the beginning-of-sequence id (int) or None.
        chat_template: a Jinja2 chat template string or None (ChatML is used).
    """

    def __init__(self, hf: _HFTokenizer, eos_id: int | None = None,
                 bos_id: int | None = None, chat_template: str | None = None):
        self.hf = hf
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.chat_template = chat_template

    # ------------------------------------------------------------ builders
    @classmethod
    def from_gguf(cls, fields, source: str = "<gguf>") -> "Tokenizer":
        """Build from ``gguf.GGUFReader(path).fields`` (a dict name -> field).

        Reads ``tokenizer.ggml.{model,pre,tokens,merges,token_type,eos_token_id,
        bos_token_id}`` and ``tokenizer.chat_template`` (GGUF spec, llama.cpp
        converter conventions).  Only ``tokenizer.ggml.model == "gpt2"``
        (byte-level BPE) is supported.  Control tokens (token_type 3) become
        special added tokens, user-defined ones (4) plain added tokens.

        Raises:
            ModelError: tokenizer metadata missing or of an unsupported kind;
                ``source`` (the file name) is used in the message.
        """
        kind = _field(fields, "tokenizer.ggml.model")
        if kind is None or "tokenizer.ggml.tokens" not in fields:
            raise ModelError(f"{source}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens); "
                             "use a GGUF converted with its tokenizer or a Hugging Face directory")
        if kind != "gpt2":
            raise ModelError(f"{source}: tokenizer.ggml.model={kind!r} is not supported (only "
                             "'gpt2' byte-level BPE); load the Hugging Face directory with "
                             "tokenizer.json instead")
        tokens = _field(fields, "tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in _field(fields, "tokenizer.ggml.merges", [])]
        types = _field(fields, "tokenizer.ggml.token_type", [_TOKEN_NORMAL] * len(tokens))
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ModelError(f"{source}: tokenizer.ggml.tokens contains duplicate tokens; "
                             "re-convert the model or use its Hugging Face directory")
        hf = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        hf.pre_tokenizer = _pre_tokenizer(_field(fields, "tokenizer.ggml.pre", "gpt2"))
        hf.decoder = decoders.ByteLevel()
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if t == _TOKEN_CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED]
        hf.add_special_tokens(special)
        hf.add_tokens(user)
        eos, bos = (_field(fields, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "bos"))
        return cls(hf, eos_id=None if eos is None else int(eos),
                   bos_id=None if bos is None else int(bos),
                   chat_template=_field(fields, "tokenizer.chat_template"))

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
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (dicts with "role" and "content") to a prompt string.

        Uses the model's Jinja2 template (rendered like ``transformers`` does:
        sandboxed, ``trim_blocks``/``lstrip_blocks``) when the model has one and
        jinja2 is installed, otherwise plain ChatML::

            <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n
        """
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            ImmutableSandboxedEnvironment = None
        if not self.chat_template or ImmutableSandboxedEnvironment is None:
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

        def raise_exception(msg):
            raise ModelError(f"chat template error: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        name = lambda i: None if i is None else self.hf.id_to_token(i)  # noqa: E731
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=name(self.bos_id) or "", eos_token=name(self.eos_id) or "")


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
