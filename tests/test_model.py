"""Our Llama-family model and ModelRunner against transformers, through the paged KV path."""
from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

import pagedq.engine.loader as loader
from pagedq.engine.config import EngineConfig
from pagedq.engine.layers.rotary import rope_params
from pagedq.engine.model_runner import ModelRunner
from pagedq.engine.models import get_model_class
from pagedq.engine.piecewise import SIZES, piece_sizes
from tests.model_fixtures import (
    TINY_ARCHS,
    TINY_VOCAB,
    BlockPool,
    finish_step,
    hf_choices,
    load_hf,
    new_seq,
    schedule,
)

# fixtures tiny_model_dir, smollm2_runner (session-scoped: SmolLM2 loads once), smollm2_hf

BS = 8  # small blocks: short prompts still span several blocks
PROMPT = random.Random(0).choices(range(TINY_VOCAB), k=45)


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny(request, tiny_model_dir):
    folder = tiny_model_dir(request.param)
    runner = ModelRunner(str(folder), EngineConfig(device="cpu", dtype="float32",
                                                   block_size=BS, num_kv_blocks=64))
    return runner, load_hf(folder)


def all_logits(runner, batch) -> torch.Tensor:
    """Logits of EVERY token computed in the batch (execute returns sampling rows only)."""
    ids, pos, meta, _ = runner.prepare(batch)
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(ids, pos, meta))


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def close(a, b):
    assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_tiny_prefill_matches_hf(tiny):
    runner, hf = tiny
    ref = hf_logits(hf, PROMPT)
    seq = new_seq(PROMPT)
    batch = schedule(BlockPool(64, seed=1), BS, (seq, len(PROMPT)))
    close(all_logits(runner, batch), ref)
    close(runner.execute(batch), ref[-1:])


def test_tiny_chunked_prefill_scrambled_blocks(tiny):
    runner, hf = tiny
    pool, seq, rows = BlockPool(64, seed=2), new_seq(PROMPT), []
    for n in (5, 11, 1, 16, 12):  # chunks straddle block boundaries
        batch = schedule(pool, BS, (seq, n))
        rows.append(all_logits(runner, batch))
        finish_step(batch)
    assert sorted(seq.block_table) != seq.block_table
    close(torch.cat(rows), hf_logits(hf, PROMPT))


def test_tiny_token_by_token_decode(tiny):
    """Prefill 3 tokens, then feed the rest one per step as if each had been sampled."""
    runner, hf = tiny
    ref = hf_logits(hf, PROMPT)
    pool, seq = BlockPool(64, seed=3), new_seq(PROMPT[:3])
    batch = schedule(pool, BS, (seq, 3))
    close(runner.execute(batch), ref[2:3])
    finish_step(batch)
    for i in range(3, len(PROMPT)):
        seq.append_token(PROMPT[i])
        batch = schedule(pool, BS, (seq, 1))
        _, pos, meta, _ = runner.prepare(batch)
        assert meta.is_decode_only and pos.tolist() == [i]
        close(runner.execute(batch), ref[i:i + 1])
        finish_step(batch)


def test_tiny_mixed_batch_reads_blocks_written_this_step(tiny):
    """A prefill, a decode and a sequence whose cached prefix is written by another sequence
    of the same step (batch.py: all K/V are stored before attention reads)."""
    runner, hf = tiny
    prefix, pool = PROMPT[:16], BlockPool(64, seed=4)
    a, b, c = new_seq(prefix + [7], "a"), new_seq(prefix + [9, 11], "b"), new_seq(PROMPT, "c")
    warm = schedule(pool, BS, (c, len(PROMPT) - 1))
    runner.execute(warm)
    finish_step(warm)
    pool.grow(a, a.num_tokens, BS)
    b.block_table = a.block_table[:2]  # the 16 shared prefix tokens = 2 full blocks
    b.num_computed_tokens = 16
    batch = schedule(pool, BS, (a, a.num_tokens), (b, 2), (c, 1))
    got = all_logits(runner, batch)
    close(got[:17], hf_logits(hf, a.token_ids))
    close(got[17:19], hf_logits(hf, b.token_ids)[-2:])
    close(got[19:], hf_logits(hf, PROMPT)[-1:])
    close(runner.execute(batch), got[[16, 18, 19]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_matches_eager_and_hf(tiny_model_dir):
    """Triton kernels + CUDA graphs (3 decoding seqs replayed in the size-4 graph) against
    the eager path and transformers on CPU, float32."""
    folder = tiny_model_dir("Qwen3ForCausalLM")
    runners = [ModelRunner(str(folder), EngineConfig(
        device="cuda", dtype="float32", block_size=BS, num_kv_blocks=64, max_num_seqs=8,
        use_triton=True, enforce_eager=eager)) for eager in (False, True)]
    assert sorted(runners[0].graphs) == [1, 2, 4, 8] and not runners[1].graphs
    ref = hf_logits(load_hf(folder), PROMPT)
    for r in runners:
        pool, seqs = BlockPool(64, seed=6), [new_seq(PROMPT[:k], str(k)) for k in (5, 9, 20)]
        batch = schedule(pool, BS, *[(s, s.num_tokens) for s in seqs])
        r.execute(batch)
        finish_step(batch)
        for _ in range(6):
            for s in seqs:
                s.append_token(PROMPT[s.num_tokens])
            batch = schedule(pool, BS, *[(s, 1) for s in seqs])
            got = r.execute(batch).cpu()
            close(got, ref[[s.num_tokens - 1 for s in seqs]])
            finish_step(batch)


def test_attention_split_hook_is_where_pieces_are_cut(tiny):
    """engine/piecewise.py cuts the model at ``meta.split``: it is called once per layer, in
    layer order, with that layer's rotated q (its K/V already stored), and what it returns
    is taken as that layer's attention output."""
    runner, hf = tiny
    batch = schedule(BlockPool(64, seed=5), BS, (new_seq(PROMPT), len(PROMPT)))
    ids, pos, meta, _ = runner.prepare(batch)
    seen = []

    def split(attn, q):
        seen.append(attn)
        assert q.shape == (len(PROMPT), attn.num_heads, attn.head_dim)
        return attn.attend(q, meta)

    meta.split = split
    with torch.inference_mode():
        got = runner.model.compute_logits(runner.model(ids, pos, meta))
    assert seen == runner.model.attention_layers()
    close(got, hf_logits(hf, PROMPT))


def test_piecewise_sizes_cover_every_step_up_to_the_limit_once():
    assert piece_sizes(64) == [64] and piece_sizes(100) == [64, 100]
    assert piece_sizes(2048)[-2:] == [1536, 2048]
    big = piece_sizes(16384)  # larger steps run eagerly
    assert big[-1] == 8192 and len(set(big)) == len(big) == len(SIZES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_piecewise_graphs_for_steps_that_prefill(tiny_model_dir):
    """Steps that prefill replay the model in pieces between eager attention calls
    (engine/piecewise.py), padded up to a captured size: chunked prefills mixed with
    decodes, against transformers on CPU, float32."""
    folder = tiny_model_dir("Qwen3ForCausalLM")
    runner = ModelRunner(str(folder), EngineConfig(
        device="cuda", dtype="float32", block_size=BS, num_kv_blocks=128, max_num_seqs=8,
        max_num_batched_tokens=256, use_triton=True))
    pw = runner.piecewise
    assert pw is not None and pw.sizes == [64, 128, 256]
    steps = []
    run = pw.run
    pw.run = lambda ids, pos, meta: (steps.append(ids.shape[0]), run(ids, pos, meta))[1]
    hf = load_hf(folder)
    long = random.Random(7).choices(range(TINY_VOCAB), k=200)
    ref_a, ref_b = hf_logits(hf, PROMPT), hf_logits(hf, long)
    pool = BlockPool(128, seed=8)
    a, b = new_seq(PROMPT[:40], "a"), new_seq(long, "b")
    batch = schedule(pool, BS, (a, 40), (b, 100))  # 140 tokens, replayed at 256
    close(runner.execute(batch).cpu(), ref_a[39:40])
    finish_step(batch)
    for chunk in (60, 40):  # a decodes while b's prompt goes on; b's last chunk samples
        a.append_token(PROMPT[a.num_tokens])
        batch = schedule(pool, BS, (a, 1), (b, chunk))
        want = [ref_a[a.num_tokens - 1]] + ([ref_b[-1]] if chunk == 40 else [])
        close(runner.execute(batch).cpu(), torch.stack(want))
        finish_step(batch)
    c = new_seq(PROMPT[:7], "c")  # a 7-token prompt beside a decode: 8 tokens, at 64
    a.append_token(PROMPT[a.num_tokens])
    batch = schedule(pool, BS, (a, 1), (c, 7))
    close(runner.execute(batch).cpu(), torch.stack([ref_a[a.num_tokens - 1], ref_a[6]]))
    assert steps == [140, 61, 41, 8]


def test_runner_limits_and_cpu_kv_sizing(tiny_model_dir):
    folder = str(tiny_model_dir("LlamaForCausalLM"))
    with pytest.raises(ValueError, match="exceeds the model's context length 256"):
        ModelRunner(folder, EngineConfig(device="cpu", max_model_len=100_000))
    r = ModelRunner(folder, EngineConfig(device="cpu", kv_cache_memory_gb=0.001))
    assert r.num_kv_blocks == int(0.001 * 2**30) // r.block_bytes()
    assert r.kv_cache.shape == (2, 2, r.num_kv_blocks, 16, 2, 16)
    assert (r.max_model_len, r.vocab_size, r.eos_token_ids) == (256, TINY_VOCAB, {256})
    assert r.tokenizer.decode(r.tokenizer("héllo")["input_ids"]) == "héllo"


def test_rope_params_transformers_4_and_5_styles():
    l3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert rope_params(SimpleNamespace(rope_theta=5e5, rope_scaling=l3)) == (5e5, l3)
    assert rope_params(SimpleNamespace(rope_theta=1e4, rope_scaling=None)) == (1e4, None)
    assert rope_params(SimpleNamespace(rope_parameters={"rope_type": "default",
                                                        "rope_theta": 1e6})) == (1e6, None)
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        rope_params(SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        get_model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    assert get_model_class(SimpleNamespace(architectures=None, model_type="qwen3")).qk_norm
    from safetensors.torch import save_file
    from transformers import GPT2Config
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]) \
        .save_pretrained(tmp_path)
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel"):
        ModelRunner(str(tmp_path), EngineConfig(device="cpu"))


def test_smollm2_logits_match_hf(smollm2_runner, smollm2_hf):
    r = smollm2_runner
    ids = r.tokenizer("The capital of France is")["input_ids"]
    batch = schedule(BlockPool(r.num_kv_blocks), r.block_size, (new_seq(ids), len(ids)))
    assert_close(r.execute(batch)[0], hf_logits(smollm2_hf, ids)[-1], atol=1e-3, rtol=1e-3)


def test_smollm2_greedy_batch_matches_hf_greedy(smollm2_runner, smollm2_hf):
    """3 prompts of different lengths in one batch, one joining late, prompts chunked at 16
    tokens: mixed prefill/decode steps. Token for token equal to HF greedy decoding (each
    token, EOS included, is transformers' argmax after the ones before it)."""
    r, tok, max_new = smollm2_runner, smollm2_runner.tokenizer, 20
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                     "France?"}], tokenize=False, add_generation_prompt=True)
    texts = [chat, "Once upon a time", "The three primary colors are red, yellow and blue. "
             "Mixing red and yellow gives orange, and mixing blue and yellow gives"]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert len({len(p) for p in prompts}) == 3
    seqs = [new_seq(p, f"p{i}") for i, p in enumerate(prompts)]
    start = {seqs[0]: 0, seqs[1]: 0, seqs[2]: 2}
    pool, done, step = BlockPool(r.num_kv_blocks, seed=5), set(), 0
    while len(done) < len(seqs):
        live = [s for s in seqs if start[s] <= step and s not in done]
        batch = schedule(pool, r.block_size,
                         *[(s, min(16, s.num_tokens - s.num_computed_tokens)) for s in live])
        samplers = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        logits = r.execute(batch)
        assert logits.shape == (len(samplers), r.vocab_size) and logits.dtype == torch.float32
        finish_step(batch)
        for s, t in zip(samplers, logits.argmax(-1).tolist(), strict=True):
            s.append_token(t)
            if t in r.eos_token_ids or s.num_output_tokens == max_new:
                done.add(s)
        step += 1
    for p, s in zip(prompts, seqs, strict=True):
        assert s.output_token_ids == hf_choices(smollm2_hf, p, s.output_token_ids)
    assert "Paris" in tok.decode(seqs[0].output_token_ids)


def test_resolve_model_errors(tmp_path):
    with pytest.raises(ValueError, match="never downloaded"):
        loader.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="no config.json"):
        loader.resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        loader.resolve_model(tmp_path)
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        loader.resolve_model(tmp_path / "w.bin")
    src = loader.resolve_model("smollm2")
    assert src.kind == "gguf" and src.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_second_smollm2_load_hits_cache(smollm2_runner, monkeypatch):
    def no_dequantize(*a):
        raise AssertionError("dequantized again")
    monkeypatch.setattr(loader, "_write_gguf_cache", no_dequantize)
    folder, cached = loader.ensure_gguf_cache(loader.resolve_model("smollm2").path)
    assert cached and (folder / "model.safetensors").is_file()
    cfg, weights, tok = loader.load_model_files(loader.resolve_model("smollm2"))
    assert cfg.architectures == ["LlamaForCausalLM"] and tok is not None
    assert dict(weights)["model.norm.weight"].dtype == torch.float32


def test_gguf_cache_written_once_and_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDQ_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def slow_write(path, out):
        calls.append(out)
        threading.Event().wait(0.2)
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(loader, "_write_gguf_cache", slow_write)
    results = []
    threads = [threading.Thread(target=lambda: results.append(loader.ensure_gguf_cache(gguf)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = loader.gguf_cache_dir(gguf)
    assert final.parent == tmp_path / "cache" / "models" and final.name.startswith("m-4-")
    assert len(calls) == 1 and sorted(c for _, c in results) == [False, True, True, True]
    assert {d for d, _ in results} == {final} and (final / "config.json").is_file()
    assert not list(final.parent.glob(".tmp-*"))

    def failing_write(path, out):
        raise RuntimeError("disk full")
    monkeypatch.setattr(loader, "_write_gguf_cache", failing_write)
    gguf.write_bytes(b"GGUF2")  # new size and mtime: a new cache key
    with pytest.raises(RuntimeError, match="disk full"):
        loader.ensure_gguf_cache(gguf)
    assert not loader.gguf_cache_dir(gguf).exists() and not list(final.parent.glob(".tmp-*"))
