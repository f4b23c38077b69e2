"""Prompt data: tokenizers (HF tokenizer.json, sentencepiece), verl-format datasets, DP sampler."""

from hybridflow.data.dataset import PromptDataset, PromptItem
from hybridflow.data.sampler import PromptSampler
from hybridflow.data.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece

__all__ = ["PromptDataset", "PromptItem", "PromptSampler", "Tokenizer", "load_tokenizer", "train_sentencepiece"]
