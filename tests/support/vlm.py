"""A tiny vision-language model built in the tests: Idefics3 (a SigLIP-style vision tower, a pixel-shuffle
connector and the tiny Llama of ``tests.support.models``), random weights, saved with its processor (the PIL image
processor: vLLM's CPU build has no torchvision) and a chat template. Its outputs are noise; the code paths are the
real ones: vLLM's chat handler places the image tokens and its processor turns each image into pixel values.

Why Idefics3: of vLLM 0.32's vision-language models, LLaVA, Qwen2-VL, Qwen2.5-VL, Gemma 3 and LFM2-VL import
transformers' fast image processors, which need torchvision (not installable beside torch 2.13.0+cpu); Idefics3,
SmolVLM, PaliGemma, BLIP-2 and Phi-3-vision do not.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.models import _CORPUS, CHAT_TEMPLATE

IMAGE_SIZE = 64  # pixels a side the processor resizes to; 16-pixel patches, scale factor 2: 4 image tokens
PATCH = 16
IMAGE_TOKENS = 4
SPECIAL = ["<s>", "</s>", "<unk>", "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]


def build_tiny_vlm(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    specials = SPECIAL + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(list(_CORPUS) * 20, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=specials[3:],
    )
    hf.chat_template = CHAT_TEMPLATE
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=False
    )
    Idefics3Processor(
        image_processor=images, tokenizer=hf, image_seq_len=IMAGE_TOKENS, chat_template=CHAT_TEMPLATE
    ).save_pretrained(out)
    text = LlamaConfig(
        vocab_size=len(hf),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        pad_token_id=hf.eos_token_id,
        tie_word_embeddings=True,
    )
    vision = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": IMAGE_SIZE, "patch_size": PATCH}  # fmt: skip
    config = Idefics3Config(
        vision_config=vision,
        text_config=text.to_dict(),
        scale_factor=2,
        image_token_id=hf.convert_tokens_to_ids("<image>"),
        pad_token_id=hf.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(out)
    return out
