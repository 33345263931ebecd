"""The toy teacher's processor, built offline: a byte-level BPE tokenizer with the Llama 3 special tokens and
pre-tokenizer, the Llama 3.2 Vision chat template, and Mllama's image processor at one 64 x 64 tile.

It mirrors the real model's processor, so that every stage drives the toy and the 11B model the same way:
- the specials keep their Llama 3 strings (ids 0-10 here instead of 128000-128010), BOS is prepended by the
  tokenizer, the end of a turn is ``<|eot_id|>``, padding is ``<|finetune_right_pad_id|>``;
- ``<|image|>`` is added after training, so it is the last id and equals the language model's vocabulary
  size: it never appears in ``lm_head`` (labels must mask it), as with id 128256 in the 11B model.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import MllamaImageProcessorPil, MllamaProcessor, PreTrainedTokenizerFast

from pipeline.toy.draw import IMAGE_SIZE

CHAT_TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")

# Llama 3 special tokens, in the order (and spelling) of the real vocabulary.
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
BOS, EOS_TEXT, PAD, EOM, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|eom_id|>", "<|eot_id|>"
IMAGE_TOKEN = "<|image|>"

# The Llama 3 pre-tokenizer split (tiktoken's cl100k-style pattern).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# CLIP normalisation, as in the real Mllama image processor.
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on ``corpus`` (deterministic for a given corpus order)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def build_processor(corpus: Iterable[str], vocab_size: int = 2048, image_size: int = IMAGE_SIZE) -> MllamaProcessor:
    """The complete processor: tokenizer trained on ``corpus``, chat template, image processor."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(corpus, vocab_size),
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        padding_side="left",
        model_max_length=512,
    )
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    if tok.convert_tokens_to_ids(IMAGE_TOKEN) != len(tok) - 1:
        raise RuntimeError("the image token must be the last id")
    image_processor = MllamaImageProcessorPil(
        size={"height": image_size, "width": image_size},
        max_image_tiles=1,
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
    )
    return MllamaProcessor(image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE_FILE.read_text())


def text_vocab_size(processor: MllamaProcessor) -> int:
    """Size of the language model's vocabulary: every id but the image token (which is the last)."""
    return len(processor.tokenizer) - 1
