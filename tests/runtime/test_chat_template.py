"""`LLM.chat`: conversations rendered with the checkpoint's chat template (or one given), as
Hugging Face's `apply_chat_template` renders them, then generated."""

import json

import pytest

from tokenspeed import LLM, SamplingParams
from tokenspeed.model.hf_writer import save_checkpoint
from tokenspeed.runtime import RequestError
from tokenspeed.runtime.chat_template import encode_rendered, find_chat_template, render
from tokenspeed.runtime.tokenizer import load_tokenizer

from .conftest import tiny_model
from .test_tokenizer import _tiktoken_dir

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<s>", "<|im_start|>", "<|im_end|>"]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name three caches."},
]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _checkpoint(root, template=TEMPLATE, jinja=None):
    """The tiny model with a byte-level BPE tokenizer.json (its special tokens among the ids)
    and a tokenizer_config.json holding the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    save_checkpoint(tiny_model(), root)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
    )
    tok.train_from_iterator(["Name three caches. Be brief. user system assistant"] * 20, trainer)
    tok.save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "<|im_end|>",
    }
    if template is not None:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (root / "chat_template.jinja").write_text(jinja)
    return root


def _llm(model="tiny"):
    return LLM(model=str(model), dtype="float32", max_model_len=256, page_size=16, device="cpu")


def test_chat_renders_the_checkpoints_template_and_generates(tmp_path):
    llm = _llm(_checkpoint(tmp_path))
    (out,) = llm.chat(CHAT, GREEDY, use_tqdm=False)
    want = (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nName three caches.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert out.prompt == want
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(want)
    specials = [tok.encode(s)[0] for s in SPECIALS]
    assert all(len(tok.encode(s)) == 1 for s in SPECIALS)  # one id each, in the prompt
    assert out.prompt_token_ids[0] == specials[0]
    assert out.prompt_token_ids.count(specials[1]) == 3
    (plain,) = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert out.token_ids == plain.token_ids and len(out.token_ids) == 4
    # Without the generation prompt; a batch of conversations gives one output each.
    outs = llm.chat([CHAT, CHAT[1:]], GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert [o.prompt for o in outs] == [
        want.removesuffix("<|im_start|>assistant\n"),
        "<s><|im_start|>user\nName three caches.<|im_end|>\n",
    ]


def test_chat_renders_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    root = _checkpoint(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(root))
    text = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = theirs(text, add_special_tokens=False)["input_ids"]
    (out,) = _llm(root).chat(CHAT, GREEDY, use_tqdm=False)
    assert out.prompt == text and out.prompt_token_ids == ids


def test_a_chat_template_file_wins_over_tokenizer_config(tmp_path):
    root = _checkpoint(tmp_path, jinja="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert find_chat_template(root).startswith("{% for m")
    (out,) = _llm(root).chat(CHAT, GREEDY, use_tqdm=False)
    assert out.prompt == "[Be brief.][Name three caches.]"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert find_chat_template(root) == "D"


def test_a_model_without_a_template_needs_one_passed():
    llm = _llm()
    with pytest.raises(RequestError, match="has no chat template.*chat_template="):
        llm.chat(CHAT, GREEDY, use_tqdm=False)
    (out,) = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    want = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nName three caches.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert out.prompt == want  # no bos_token for a preset: it renders as nothing
    assert out.prompt_token_ids == llm.tokenizer.encode(want)
    assert len(out.token_ids) == 4


def test_an_explicit_template_overrides_the_checkpoints(tmp_path):
    llm = _llm(_checkpoint(tmp_path))
    (out,) = llm.chat(CHAT[1:], GREEDY, use_tqdm=False, chat_template="{{ messages[0].role }}")
    assert out.prompt == "user"
    file = tmp_path / "other.jinja"
    file.write_text("{{ bos_token }}{{ greeting }}")
    kwargs = {"greeting": "hey"}
    (out,) = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=str(file))  # a file name
    assert out.prompt == "<s>"
    outs = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=file, chat_template_kwargs=kwargs)
    assert outs[0].prompt == "<s>hey"


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty list"),
        ({"role": "user", "content": "hi"}, "a conversation"),
        ("hi", "a conversation .* got str"),
        ([{"content": "hi"}], "conversation 0, message 0: a message is a dict with a 'role'"),
        ([[{"role": "user", "content": "hi"}], []], "conversation 1 is empty"),
        ([[{"role": "user", "content": "hi"}], ["hi"]], "conversation 1, message 0"),
    ],
)
def test_malformed_conversations_are_refused(messages, message):
    with pytest.raises(RequestError, match=message):
        _llm().chat(messages, GREEDY, chat_template=TEMPLATE)


def test_template_errors_are_request_errors():
    llm = _llm()
    failing = "{{ raise_exception('only user turns, please') }}"
    with pytest.raises(RequestError, match="conversation 0: .*only user turns, please"):
        llm.chat(CHAT, GREEDY, chat_template=failing)
    with pytest.raises(RequestError, match="does not compile"):
        llm.chat(CHAT, GREEDY, chat_template="{% for %}")
    # The sandbox refuses what Hugging Face's refuses.
    with pytest.raises(RequestError, match="conversation 0"):
        llm.chat(CHAT, GREEDY, chat_template="{{ messages.__class__.__mro__ }}")
    assert not llm.engine.has_unfinished()


def test_hugging_face_template_helpers_render():
    template = (
        "{% generation %}{{ messages[0] | tojson }}{% endgeneration %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}!{% endfor %}"
    )
    text = render(template, [{"role": "user", "content": "é"}, {"role": "x", "content": ""}])
    assert text == '{"role": "user", "content": "é"}!'


def test_tiktoken_chat_prompts_encode_their_special_tokens(tmp_path):
    """Kimi's tiktoken tokenizer reads special tokens in a rendered chat prompt as themselves
    (its own `encode` allows them), where a plain prompt's text never becomes one."""
    root, base = _tiktoken_dir(tmp_path)
    tok = load_tokenizer(root)
    assert encode_rendered(tok, "[BOS]agents") == [base, *tok.encode("agents")]
    assert base not in tok.encode("[BOS]agents")
