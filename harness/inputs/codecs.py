"""Text codecs: bytes for the tiny presets, a chat template for real tokenizers (the end of a
turn is found by probing the template, never by a family's name)."""

from __future__ import annotations


class ByteCodec:
    """Byte-level codec for random-weight models: ids 0-255 are bytes, then 4 specials."""

    BOS, EOS, USER, ASSISTANT = 256, 257, 258, 259
    vocab_size = 260

    def __init__(self) -> None:
        self.eos_ids = frozenset({self.EOS})

    def prompt_ids(self, text: str) -> list[int]:
        """A one-turn chat prompt: BOS, USER, the UTF-8 bytes, ASSISTANT."""
        return [self.BOS, self.USER, *text.encode("utf-8"), self.ASSISTANT]

    def decode(self, ids) -> str:
        data = bytes(i for i in ids if i < 256)
        extra = "".join(f"<{i}>" for i in ids if i >= 260)
        return data.decode("utf-8", errors="replace") + extra


_TURN_PROBE = "kvfid-end-of-turn-probe"


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """The token that closes an assistant turn in the chat template (SmolLM2: `<|im_end|>`), read
    by rendering a probe turn; the tokenizer's own eos where there is no template or no special
    token follows the turn. The loader's eos is not enough: transformers 5.17 reads SmolLM2's
    GGUF eos as id 1, 5.24 as id 2 (`<|im_end|>`), which changes where generations stop."""
    if tokenizer.chat_template:
        turn = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _TURN_PROBE}]
        text = tokenizer.apply_chat_template(turn, tokenize=False)
        if isinstance(text, str) and _TURN_PROBE in text:
            after = tokenizer(text.split(_TURN_PROBE, 1)[1], add_special_tokens=False)["input_ids"]
            special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
            if after and after[0] in special:
                return frozenset({int(after[0])})
    eos = tokenizer.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else list(eos or []))


class ChatCodec:
    """A Hugging Face tokenizer with its chat template (one user turn, generation prompt)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = end_of_turn_ids(tokenizer)

    def prompt_ids(self, text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        if self.tokenizer.chat_template:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True)
            ids = out["input_ids"] if hasattr(out, "keys") else out
        else:
            ids = self.tokenizer(text)["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
