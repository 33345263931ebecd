"""The two prompt templates of SPEC section 5, for any Mllama processor: the chat template (one image and
one user turn, ending with the assistant header) and the plain ``<|image|>{prompt}`` template."""

from __future__ import annotations


def chat_prompt(processor, user_text: str) -> str:
    """The chat-template prompt for one image and one user turn, ending with the assistant header."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": user_text}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def plain_prompt(processor, user_text: str) -> str:
    """The plain (non-chat) template: ``<|image|>{prompt}``, after BOS as the processor would place it."""
    return f"{processor.tokenizer.bos_token}{processor.image_token}{user_text}"
