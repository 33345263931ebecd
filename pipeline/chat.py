"""The two prompt templates of SPEC section 5: the chat template (one user turn, ending with the assistant header)
and the plain template. For Mllama (a processor) the user turn carries one image and the plain template is
``<|image|>{prompt}`` after BOS; for a text-only model (a tokenizer) the turn is text only and the plain template
is the prompt after whatever the tokenizer itself puts before a text."""

from __future__ import annotations


def is_text_only(processor) -> bool:
    """A text-only model's tokenizer, not Mllama's processor (which carries an image processor)."""
    return not hasattr(processor, "image_processor")


def tokenizer_of(processor):
    """The tokenizer behind a processor (a text-only model's tokenizer is its own)."""
    return processor if is_text_only(processor) else processor.tokenizer


def chat_prompt(processor, user_text: str) -> str:
    """The chat-template prompt for one user turn (with one image for Mllama), ending with the assistant header."""
    if is_text_only(processor):
        messages = [{"role": "user", "content": user_text}]
    else:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": user_text}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def plain_prompt(processor, user_text: str) -> str:
    """The plain (non-chat) template: ``<|image|>{prompt}`` after BOS for Mllama; for a text-only model the
    prompt after the tokenizer's own prefix (its BOS, if it adds one), then a newline."""
    if is_text_only(processor):
        prefix = processor.decode(processor("")["input_ids"])
        return f"{prefix}{user_text}\n"
    return f"{processor.tokenizer.bos_token}{processor.image_token}{user_text}"
