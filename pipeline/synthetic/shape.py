"""Llama 3.2 11B Vision's shape as data: the Mllama config of any depth at its widths (:class:`Size`,
:func:`skeleton_config`), its Llama 3 special-token ids, and a processor for such a vocabulary (a small byte-level
BPE padded to the 11B's 128,256 ids, Mllama's image processor and the Llama 3.2 Vision chat template). Used by the
skeleton benchmark (``pipeline/bench/skeleton_11b.py``) and by the synthetic 11B Vision (:mod:`pipeline.synthetic.vision`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Size:
    """Shape of a skeleton. The defaults are the 11B's widths with few layers (``PRESETS['full']``)."""
    vocab_size: int = 128256                # text vocabulary; the image token takes the next id (128256)
    text_hidden: int = 4096
    text_intermediate: int = 14336
    text_heads: int = 32
    text_kv_heads: int = 8
    text_layers: int = 3
    cross_attention_layers: list[int] = field(default_factory=lambda: [1])
    vision_hidden: int = 1280
    vision_intermediate: int = 5120
    vision_heads: int = 16
    vision_layers: int = 2
    vision_global_layers: int = 1
    # which local layers' outputs feed the projector (5 of them: 1280 x (1 + 5) = 7680 wide, as in the 11B;
    # indices into the local layers' outputs, so below vision_layers)
    intermediate_layers_indices: list[int] = field(default_factory=lambda: [0, 0, 1, 1, 1])
    image_size: int = 560
    patch_size: int = 14
    max_num_tiles: int = 4


ASPECT_RATIOS = [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]


def skeleton_config(s: Size):
    """The ``MllamaConfig`` of a skeleton: Llama 3 special-token ids at the top of the vocabulary (128000... for
    the full vocabulary), the image token right after it, llama3 RoPE scaling as in the 11B."""
    from transformers import MllamaConfig, MllamaTextConfig, MllamaVisionConfig

    ratios = [r for r in ASPECT_RATIOS if r[0] * r[1] <= s.max_num_tiles]
    vision = MllamaVisionConfig(
        hidden_size=s.vision_hidden, num_hidden_layers=s.vision_layers, num_global_layers=s.vision_global_layers,
        attention_heads=s.vision_heads, intermediate_size=s.vision_intermediate,
        intermediate_layers_indices=list(s.intermediate_layers_indices),
        vision_output_dim=s.vision_hidden * (1 + len(s.intermediate_layers_indices)),
        image_size=s.image_size, patch_size=s.patch_size, max_num_tiles=s.max_num_tiles,
        supported_aspect_ratios=ratios)
    specials = special_ids(s.vocab_size)
    text = MllamaTextConfig(
        vocab_size=s.vocab_size, hidden_size=s.text_hidden, num_hidden_layers=s.text_layers,
        cross_attention_layers=list(s.cross_attention_layers), num_attention_heads=s.text_heads,
        num_key_value_heads=s.text_kv_heads, intermediate_size=s.text_intermediate,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=specials["<|begin_of_text|>"],
        eos_token_id=[specials["<|end_of_text|>"], specials["<|eom_id|>"], specials["<|eot_id|>"]],
        pad_token_id=specials["<|finetune_right_pad_id|>"])
    return MllamaConfig(vision_config=vision, text_config=text, image_token_index=s.vocab_size)


def full_11b_config():
    """Llama 3.2 11B Vision as ``MllamaConfig`` defaults give it, with the released model's 560-pixel tiles
    (the defaults say 448)."""
    from transformers import MllamaConfig

    config = MllamaConfig()
    config.vision_config.image_size = 560
    return config


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer and processor
# ----------------------------------------------------------------------------------------------------------------

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]


def special_ids(vocab_size: int) -> dict[str, int]:
    """Llama 3's 256 special tokens occupy the last 256 ids of the text vocabulary (128000-128255 in the 11B);
    a vocabulary below 512 keeps only the 11 named ones."""
    n = 256 if vocab_size >= 512 else len(LLAMA3_SPECIALS)
    base = vocab_size - n
    names = LLAMA3_SPECIALS + [f"<|reserved_special_token_{k}|>" for k in range(3, 3 + n - len(LLAMA3_SPECIALS))]
    return {name: base + i for i, name in enumerate(names)}


CORPUS_WORDS = ("the a an image picture photo shows of in on with and is are red green blue yellow black white "
                "small large circle square triangle dog cat car tree house sky water person people table chart "
                "document text title number one two three four five left right top bottom center describe what "
                "how many where which color shape answer question detail please briefly").split()


def corpus(n: int = 3000, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(CORPUS_WORDS) for _ in range(rng.randint(4, 16))) + rng.choice([".", "?", "!"])
            for _ in range(n)]


def build_processor(s: Size, bpe_vocab: int = 1024):
    """A Mllama processor for a skeleton of vocabulary ``s.vocab_size`` (the toy's builder cannot do it: its
    vocabulary is a BPE trainer's target, which a small corpus never reaches, and it puts the specials at ids 0-10).

    A byte-level BPE with the Llama 3 pre-tokenizer is trained on a small corpus (``bpe_vocab`` ids); unused
    filler tokens (``<|skeleton_filler_N|>``, never produced: no merge leads to them) pad the vocabulary up to the
    Llama 3 specials at its top; ``<|image|>`` is added last, so its id is ``s.vocab_size`` as in the 11B. The
    image processor is Mllama's at ``s.image_size`` pixels and ``s.max_num_tiles`` tiles; the chat template is
    the toy's (the Llama 3.2 Vision template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import MllamaImageProcessorPil, MllamaProcessor, PreTrainedTokenizerFast

    from pipeline.toy.processor import CHAT_TEMPLATE_FILE, IMAGE_MEAN, IMAGE_STD, LLAMA3_SPLIT

    specials = special_ids(s.vocab_size)
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre
    bpe_vocab = min(bpe_vocab, min(specials.values()))
    trained.train_from_iterator(corpus(), trainer=trainers.BpeTrainer(
        vocab_size=bpe_vocab, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    spec = json.loads(trained.to_str())
    vocab = dict(spec["model"]["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    n_trained = len(vocab)
    for i in range(n_trained, min(specials.values())):
        vocab[f"<|skeleton_filler_{i}|>"] = i
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, specials[bos])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>",
                                   pad_token="<|finetune_right_pad_id|>", padding_side="left", model_max_length=131072)
    fast.add_special_tokens({"additional_special_tokens": [*specials, "<|image|>"]})   # the specials keep their ids
    image_id = fast.convert_tokens_to_ids("<|image|>")
    if image_id != s.vocab_size:
        raise RuntimeError(f"the image token has id {image_id}, expected {s.vocab_size}")
    image_processor = MllamaImageProcessorPil(size={"height": s.image_size, "width": s.image_size},
                                              max_image_tiles=s.max_num_tiles, image_mean=IMAGE_MEAN,
                                              image_std=IMAGE_STD)
    processor = MllamaProcessor(image_processor=image_processor, tokenizer=fast,
                                chat_template=CHAT_TEMPLATE_FILE.read_text())
    processor.n_trained_tokens = n_trained
    return processor
