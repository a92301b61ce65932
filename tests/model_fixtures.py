"""Model helpers for tests: tiny random HF checkpoints, the real SmolLM2 runner, hand-made
batches.

Tiny models (2 layers, hidden 64, vocab 512) are built by transformers from a config and
saved with save_pretrained, so they go through the same loader as real checkpoints. Each
gets its own tiny tokenizer: byte-level BPE with no merges (256 byte tokens + 2 special
tokens), so ANY text encodes to ids < 512 and no other model has to be loaded first.

Test modules get the fixtures with ``pytest_plugins = ["tests.model_fixtures"]``;
session-scoped fixtures then load once per test session (per xdist worker). PYTEST_DONT_REWRITE
(no asserts here; test modules import helpers before pytest_plugins registers the module).
"""
from __future__ import annotations

import inspect
import random
from pathlib import Path

import pytest
import torch

from pagedq.engine.batch import ScheduledBatch
from pagedq.engine.config import EngineConfig
from pagedq.engine.sampling_params import SamplingParams
from pagedq.engine.sequence import Sequence

TINY_VOCAB = 512
TINY_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _tiny_config(arch: str):
    import transformers
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=256, eos_token_id=256,
              pad_token_id=257, architectures=[arch])
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "LlamaForCausalLM":  # tied embeddings, Llama-3 rope scaling
        kw.update(tie_word_embeddings=True)
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}
    elif arch == "MistralForCausalLM":  # untied, no sliding window
        kw.update(tie_word_embeddings=False, sliding_window=None)
    elif arch == "Qwen2ForCausalLM":  # untied, q/k/v bias
        kw.update(tie_word_embeddings=False)
    elif arch == "Qwen3ForCausalLM":  # tied, q/k norm, head_dim != hidden / heads
        kw.update(tie_word_embeddings=True, head_dim=32)
    if "rope_parameters" in inspect.signature(cls.__init__).parameters:  # transformers 5.x
        kw["rope_parameters"] = rope
    else:  # transformers 4.x
        kw["rope_theta"] = rope.pop("rope_theta")
        kw["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    return cls(**kw)


def tiny_tokenizer():
    """Byte-level BPE without merges: ids 0..255 are the bytes, 256 eos, 257 pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet(), key=ord))}
    vocab.update({"<|endoftext|>": 256, "<|pad|>": 257})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>",
                                   pad_token="<|pad|>")


def make_tiny_model(arch: str, folder: Path, seed: int = 0) -> Path:
    """Save a random tiny ``arch`` checkpoint (float32 safetensors + tokenizer) in folder."""
    import transformers
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(_tiny_config(arch)).float().eval()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return Path(folder)


def make_tiny_chat_model(folder: Path) -> Path:
    """make_tiny_model's Llama with a minimal chat template (for chat requests)."""
    make_tiny_model("LlamaForCausalLM", folder)
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(folder)
    return folder


def load_hf(folder: Path):
    """The transformers reference model from a folder, float32, eval."""
    from transformers import AutoModelForCausalLM

    from pagedq.engine.loader import quiet_transformers
    with quiet_transformers():
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def hf_choices(hf, ids: list[int], out: list[int]) -> list[int]:
    """transformers' greedy choice after ids + out[:i] for every i, from ONE causal forward
    over ids + out[:-1] (a row's logits see only the tokens before it). Equal to out iff
    out is transformers' greedy continuation of ids (by induction on i), at one pass of
    the model per prompt instead of one per generated token."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1:]
    return logits.argmax(-1).tolist()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: arch name -> folder of a tiny random checkpoint (built once per session)."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(arch))
        return made[arch]
    return get


@pytest.fixture(scope="session")
def smollm2_runner():
    """The real SmolLM2-135M through ModelRunner, float32 on CPU, loaded once per session."""
    from pagedq.engine.model_runner import ModelRunner
    return ModelRunner("smollm2", EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128,
                                               max_model_len=1024))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_runner):
    """transformers' LlamaForCausalLM on the same cached (dequantized) weights, float32."""
    from pagedq.engine.loader import hf_folder
    return load_hf(hf_folder(smollm2_runner.source))


class BlockPool:
    """Hands out distinct block ids in a scrambled order (the runner must not care)."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, seq: Sequence, num_tokens: int, block_size: int) -> None:
        """Extend seq.block_table to cover num_tokens tokens."""
        while len(seq.block_table) * block_size < num_tokens:
            seq.block_table.append(self.free.pop())


def new_seq(token_ids: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(token_ids), SamplingParams(temperature=0.0))


def schedule(pool: BlockPool, block_size: int, *items: tuple[Sequence, int]) -> ScheduledBatch:
    """A batch computing n new tokens of each (seq, n), blocks allocated from pool."""
    batch = ScheduledBatch()
    for seq, n in items:
        pool.grow(seq, seq.num_computed_tokens + n, block_size)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
    return batch


def finish_step(batch: ScheduledBatch) -> None:
    """What the engine does after execute: advance num_computed_tokens."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
