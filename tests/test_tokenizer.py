"""Tests for engine.tokenizer on the real SmolLM2 GGUF vocabulary."""
import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tokenizer import StreamDecoder, Tokenizer
from engine.weights import default_model_path


@pytest.fixture(scope="module")
def fields():
    return gguf.GGUFReader(default_model_path()).fields


@pytest.fixture(scope="module")
def tok(fields):
    return Tokenizer.from_gguf(fields)


PARIS = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34, 216]

TEXTS = [
    "The capital of France is",
    "  leading spaces,\ttabs\tand trailing   ",
    "line one\nline two\r\n\n\nend",
    "Punctuation!? ... (brackets) [x] {y} <tag> 'quotes' \"double\" -- a/b\\c @#$%^&*",
    "emoji 😀🤖👍🏽 and a family 👩‍👩‍👧‍👦 zwj",
    "multibyte: café naïve Ωμέγα Москва 日本語テキスト 한국어 العربية עברית",
    "numbers 3.14159, 2024-01-22, 1,000,000",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


def test_known_ids(tok):
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.decode(PARIS) == " Paris.\n\nThe answer is: 2018-01-22 "


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids_and_no_bos(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("<|im_start|>assistant\n")[0] == 1
    assert tok.encode("") == []
    assert tok.encode("Hi")[0] not in (0, 1, 2)                # no BOS added
    assert tok.eos_id == 2 and tok.bos_id == 1 and tok.vocab_size == 49152
    assert tok.decode([1, 2], skip_special=True) == ""


def test_digits_split_one_by_one(tok):
    ids = tok.encode("12345")
    assert len(ids) == 5 and [tok.decode([i]) for i in ids] == list("12345")


def test_stream_decoder_emoji_split_over_tokens(tok):
    ids = tok.encode("😀")
    assert len(ids) >= 2                                     # 4 UTF-8 bytes, several tokens
    assert all("\ufffd" in tok.decode([i]) for i in ids)      # no token alone is a character
    sd = tok.stream_decoder()
    pieces = [sd.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "😀"
    assert sd.flush() == ""


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_concatenation(tok, text):
    ids = tok.encode(text)
    sd = StreamDecoder(tok)
    pieces = [sd.push(i) for i in ids] + [sd.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_flushes_invalid_tail(tok):
    ids = tok.encode("ok 😀")[:-1]                            # cut inside the emoji
    sd = tok.stream_decoder()
    text = "".join(sd.push(i) for i in ids)
    assert text == "ok" and "\ufffd" not in text
    assert text + sd.flush() == tok.decode(ids)


# SmolLM2's byte-level vocabulary lacks the byte tokens 0x04 0x06 0x13 0x14 0x16 0x1d
# (and 0xf1 0xf2, lead bytes of U+40000..U+BFFFF, plus bytes never valid in UTF-8);
# such characters are dropped by encode, exactly as with the model's own tokenizer.json.
MISSING_BYTES = "\x04\x06\x13\x14\x16\x1d"


def test_vocabulary_gaps_are_dropped(tok):
    assert tok.decode(tok.encode("a\x04b")) == "ab"
    assert tok.decode(tok.encode("\U00040000")) == "\ufffd" * 3


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="\ufffd" + MISSING_BYTES,
                                      blacklist_categories=("Cs",), max_codepoint=0x3FFFF),
               max_size=40))
def test_roundtrip_and_stream_property(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    sd = tok.stream_decoder()
    pieces = [sd.push(i) for i in ids] + [sd.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_chat_template_from_gguf(tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(msgs) == (           # no system prompt the messages do not hold
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, default_system=True) == (       # the template verbatim
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}] + msgs
    out = tok.apply_chat_template(with_system, add_generation_prompt=False)
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    assert tok.encode(out).count(1) == 2 and tok.encode(out).count(2) == 2


_HEADER = "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|start_header_id|>system<|end_header_id|>" \
          "\n\nDefault prompt.<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m['role'] }}" \
          "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}" \
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
_ELSE = "{% if messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n" \
        "{% else %}<|im_start|>system\nYou are Qwen.<|im_end|>\n{% endif %}{% for m in messages %}" \
        "{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}" \
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
_REFUSES = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" \
           "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
_PLAIN = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("template, want, injected", [
    (_HEADER, "<|endoftext|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n", "Default prompt."),
    (_ELSE, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "You are Qwen."),
    (_REFUSES, "<start_of_turn>user\nhi<end_of_turn>\n", None),
    (_PLAIN, "<|endoftext|>[user]hi", None),
    ("X{{ messages[0]['content'] }}", "Xhi", None),        # only the first message: no block added
])
def test_chat_template_adds_no_default_system_prompt(tok, template, want, injected):
    """A system block that a template adds on its own is left out, whatever its form, the BOS
    text kept; templates that add none (or refuse system messages) render as they are."""
    t = Tokenizer(tok.hf, eos_id=2, bos_id=0, chat_template=template)
    assert t.apply_chat_template(MSGS) == want
    verbatim = t.apply_chat_template(MSGS, default_system=True)
    assert (injected in verbatim) if injected else verbatim == want
    if template != _REFUSES:
        with_system = t.apply_chat_template([{"role": "system", "content": "Be brief."}] + MSGS)
        assert "Be brief." in with_system and "Default prompt." not in with_system


def test_chat_template_chatml_fallback(tok):
    plain = Tokenizer(tok.hf, eos_id=2)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert plain.apply_chat_template(msgs) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_save_and_from_file(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    tok2 = Tokenizer.from_file(str(path), eos_id=2)
    for text in TEXTS:
        assert tok2.encode(text) == tok.encode(text)
    assert tok2.decode(PARIS) == tok.decode(PARIS)
    assert tok2.eos_id == 2


def test_from_file_errors(tmp_path):
    from engine.errors import ModelError
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ModelError, match="tokenizer.json"):
        Tokenizer.from_file(str(bad))


class _Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt2", "smollm"])
def test_pre_tokenizer_variants(fields, pre):
    fake = {k: _Field(f.contents()) for k, f in fields.items() if k.startswith("tokenizer.")}
    fake["tokenizer.ggml.pre"] = _Field(pre)
    t = Tokenizer.from_gguf(fake)
    text = "Hello world's 12345 <|im_end|> 😀\n\n  x"
    assert t.decode(t.encode(text)) == text
    pieces = [p for p, _ in t.hf.pre_tokenizer.pre_tokenize_str("ab 12345")]
    assert pieces == {"llama-bpe": ["ab", "Ġ", "123", "45"]}.get(pre, ["ab", "Ġ", *"12345"])


def test_from_gguf_rejects_sentencepiece():
    from engine.errors import ModelError
    with pytest.raises(ModelError, match="not supported"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": _Field("llama"),
                             "tokenizer.ggml.tokens": _Field(["a"])}, source="m.gguf")


# --------------------------------------------------------------------------- adversarial inputs
MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template, needles", [
    ("{% for m in messages %}{{ m.content }}", ["syntax error at line 1", "endfor"]),
    ("{{ messages[0]['content'] | nosuchfilter }}", ["syntax error", "nosuchfilter"]),
    ("{{ 1 / 0 }}", ["failed while rendering", "ZeroDivisionError"]),
    ("{{ messages[3]['content'].upper() }}", ["failed while rendering", "UndefinedError"]),
    ("{{ ''.__class__.__mro__ }}", ["failed while rendering", "SecurityError"]),
    ("{{ raise_exception('Roles must\nalternate') }}", ["refused the conversation", "Roles must alternate"]),
    (42, ["must be a string", "got 42 (int)"]),
    ({"default": "x"}, ["must be a string", "got {'default': 'x'} (dict)"]),
    ([{"name": "rag", "template": "x"}], ["without a usable 'default' entry"]),
])
def test_chat_template_errors_are_one_line_model_errors(tok, template, needles):
    from engine.errors import ModelError
    t = Tokenizer(tok.hf, eos_id=2, chat_template=template,
                  chat_template_source="/m/tokenizer_config.json (key 'chat_template')")
    with pytest.raises(ModelError) as e:
        t.apply_chat_template(MSGS)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("/m/tokenizer_config.json (key 'chat_template'): "), msg
    assert "fix the template or run without --chat" in msg
    for n in needles:
        assert n in msg, msg


def test_chat_template_source_from_gguf(fields):
    fake = {k: _Field(f.contents()) for k, f in fields.items() if k.startswith("tokenizer.")}
    fake["tokenizer.chat_template"] = _Field("{% if %}")
    t = Tokenizer.from_gguf(fake, source="m.gguf")
    from engine.errors import ModelError
    with pytest.raises(ModelError, match=r"^m\.gguf \(GGUF key tokenizer\.chat_template\): chat template syntax"):
        t.apply_chat_template(MSGS)


def tiny_fields(**override):
    f = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
         "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab"], "tokenizer.ggml.token_type": [3, 1, 1, 1],
         "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 0}
    f.update(override)
    return {k: _Field(v) for k, v in f.items() if v is not None}


def test_tiny_fields_build_a_working_tokenizer():
    t = Tokenizer.from_gguf(tiny_fields())
    assert t.encode("ab<s>b") == [3, 0, 2] and t.eos_id == 0


class _BadUtf8Field:
    def contents(self):
        return str(b"caf\xff", encoding="utf-8")


@pytest.mark.parametrize("override, needles", [
    ({"tokenizer.ggml.merges": None}, ["tokenizer.ggml.merges is missing", "needs its merges"]),
    ({"tokenizer.ggml.merges": "a b"}, ["tokenizer.ggml.merges", "array of strings", "a str"]),
    ({"tokenizer.ggml.merges": [1, 2]}, ["tokenizer.ggml.merges", "not all strings"]),
    ({"tokenizer.ggml.merges": ["a  b"]}, ["tokenizer.ggml.merges is malformed", "entry 0 'a  b'"]),
    ({"tokenizer.ggml.merges": ["a b", "a b c"]}, ["entry 1 'a b c'", "one space"]),
    ({"tokenizer.ggml.merges": ["ab b"]}, ["entry 0 'ab b'", "'abb'", "not in tokenizer.ggml.tokens"]),
    ({"tokenizer.ggml.tokens": ["<s>", "a", 3, "ab"]}, ["tokenizer.ggml.tokens", "not all strings"]),
    ({"tokenizer.ggml.tokens": []}, ["tokenizer.ggml.tokens", "empty"]),
    ({"tokenizer.ggml.token_type": [3, 1, "x", 1]}, ["tokenizer.ggml.token_type", "4 integers"]),
    ({"tokenizer.ggml.token_type": [3, 1, 1]}, ["tokenizer.ggml.token_type", "got 3 integers"]),
    ({"tokenizer.ggml.eos_token_id": 4}, ["tokenizer.ggml.eos_token_id", "0..3", "got 4"]),
    ({"tokenizer.ggml.bos_token_id": "1"}, ["tokenizer.ggml.bos_token_id", "'1'"]),
    ({"tokenizer.ggml.pre": "deepseek-llm"}, ["tokenizer.ggml.pre='deepseek-llm'", "not supported"]),
])
def test_from_gguf_rejects_malformed_metadata(override, needles):
    from engine.errors import ModelError
    with pytest.raises(ModelError) as e:
        Tokenizer.from_gguf(tiny_fields(**override), source="m.gguf")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("m.gguf: "), msg
    for n in needles:
        assert n in msg, msg


def test_from_gguf_non_utf8_string():
    from engine.errors import ModelError
    fields = tiny_fields()
    fields["tokenizer.chat_template"] = _BadUtf8Field()
    with pytest.raises(ModelError, match=r"^m\.gguf: GGUF metadata key tokenizer\.chat_template is not valid UTF-8"):
        Tokenizer.from_gguf(fields, source="m.gguf")
