"""The byte tokenizer, its Hugging Face twin from `hf_utils`, and `load_tokenizer`."""
import transformers
import pytest

from models.tokenizer import ByteTokenizer, load_tokenizer
from tests.hf_utils import make_hf_checkpoint

TEXTS = ["", "héllo", "hello , world .  x\n\n\ty", "日本語 🙂 ñ", "a<|end_of_text|>b <|reserved_300|>",
         "<|begin_of_text|>", "<|user|> not special"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 🙂"}]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("tok"), num_layers=1, hidden_size=16, intermediate_size=32,
                              num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def hf_tok(hf_dir):
    return transformers.AutoTokenizer.from_pretrained(hf_dir)


def test_byte_round_trip():
    tok = ByteTokenizer()
    text = "héllo 日本 🙂"
    ids = tok.encode(text)
    assert ids == [256] + list(text.encode("utf-8"))
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids + [257, 300]) == text
    assert tok.decode(ids + [257, 300], skip_special_tokens=False) == (
        "<|begin_of_text|>" + text + "<|end_of_text|><|reserved_300|>")
    assert (tok.vocab_size, len(tok), tok.bos_token_id, tok.eos_token_id) == (320, 320, 256, 257)


def test_byte_specials_and_invalid_utf8():
    tok = ByteTokenizer()
    # Special-token texts are their ids, as in HF tokenizers; so decode(skip=False) round-trips.
    ids = tok.encode("a<|end_of_text|>b<|reserved_319|>", add_special_tokens=False)
    assert ids == [97, 257, 98, 319]
    assert tok.encode(tok.decode(ids, skip_special_tokens=False), add_special_tokens=False) == ids
    assert tok.decode([0xE2, 0x82, 104, 0xFF]) == "\ufffdh\ufffd"  # a cut multi-byte character, a bad byte
    split = [0xC3, 257, 0xA9]  # "é" around a special token: joined when it is skipped, as HF does
    assert tok.decode(split) == "é"
    assert tok.decode(split, skip_special_tokens=False) == "\ufffd<|end_of_text|>\ufffd"
    for bad in (320, -1):
        with pytest.raises(ValueError, match=str(bad)):
            tok.decode([bad])
    with pytest.raises(ValueError, match="258"):
        ByteTokenizer(vocab_size=200)


def test_byte_chat_template():
    tok = ByteTokenizer()
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == "<|begin_of_text|><|system|>\nBe brief.\n<|user|>\nGrüße 🙂\n<|assistant|>\n"
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("<|assistant|>\n")
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=False)
    assert ids == tok.encode(text, add_special_tokens=False) and ids[0] == 256 and ids.count(256) == 1
    assert tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True) == {"input_ids": ids}


def test_hf_tokenizer_encodes_bytes(hf_tok):
    assert hf_tok.encode("héllo") == [256] + list("héllo".encode("utf-8"))
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, len(hf_tok)) == (256, 257, 320)


@pytest.mark.parametrize("text", TEXTS)
def test_hf_twin_matches_byte_tokenizer(hf_tok, text):
    """The engine treats both alike: same ids, same text, both ways, for specials and odd whitespace too."""
    tok = ByteTokenizer()
    for add in (True, False):
        assert hf_tok.encode(text, add_special_tokens=add) == tok.encode(text, add_special_tokens=add)
    ids = tok.encode(text) + [0xC3, 257, 0xA9, 0xE2, 0x82]
    for skip in (True, False):
        assert hf_tok.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_hf_twin_chat_template(hf_tok):
    tok = ByteTokenizer()
    for gen in (True, False):
        kw = dict(add_generation_prompt=gen, tokenize=False)
        assert hf_tok.apply_chat_template(MESSAGES, **kw) == tok.apply_chat_template(MESSAGES, **kw)
        kw = dict(add_generation_prompt=gen, tokenize=True, return_dict=False)
        assert hf_tok.apply_chat_template(MESSAGES, **kw) == tok.apply_chat_template(MESSAGES, **kw)
    for last in ("Grüße 🙂", ""):  # the last message left open, as transformers renders it; an empty one too
        msgs = MESSAGES[:-1] + [{"role": "assistant", "content": last}]
        kw = dict(add_generation_prompt=False, continue_final_message=True, tokenize=False)
        assert hf_tok.apply_chat_template(msgs, **kw) == tok.apply_chat_template(msgs, **kw)
    with pytest.raises(ValueError, match="fixed chat template"):
        tok.apply_chat_template(MESSAGES, chat_template="{{ messages }}")
    with pytest.raises(ValueError, match="cannot both be true"):
        tok.apply_chat_template(MESSAGES, add_generation_prompt=True, continue_final_message=True)


def test_load_tokenizer(hf_dir, tmp_path):
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    hf = load_tokenizer(hf_dir)
    assert isinstance(hf, transformers.PreTrainedTokenizerBase) and hf.encode("hé") == [256, 104, 195, 169]
    no_tokenizer = make_hf_checkpoint(tmp_path / "bare", num_layers=1, hidden_size=16, intermediate_size=32,
                                      num_heads=2, num_kv_heads=1, tokenizer=False)
    assert load_tokenizer(no_tokenizer) is None
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")
