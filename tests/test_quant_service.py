"""Quantized models served by real `pagedq worker` processes through Redis, and the
``quantization`` setting at the command line: the ready line says how the weights are held,
answers equal the dequantized model's, an unsupported checkpoint is one line and exit 78."""
from __future__ import annotations

import json
import time

import pytest

from pagedq.engine import LLMEngine, SamplingParams
from pagedq.producer import Client
from tests import quant_writers as qw
from tests.test_cli_worker import DEAD, config_error, pagedq
from tests.test_quant_models import tiny_wide
from tests.worker_proc import WorkerProc

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def ready_line(w: WorkerProc) -> str:
    return next(line for line in w.log(tail=None).splitlines()
                if line.startswith("pagedq: ready in "))


def answer(client: Client, max_tokens: int, **job) -> str:
    rec = client.result(client.submit(max_tokens=max_tokens, temperature=0.0, **job),
                        timeout=600)
    assert rec.status == "finished", rec
    return rec.text


@pytest.fixture(scope="module")
def awq_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("awq")
    src = tiny_wide("LlamaForCausalLM", d / "src")
    qw.write_awq(src, d / "tiny-awq", d / "dense", group=64)
    return d / "tiny-awq", d / "dense"


def test_smollm2_gguf_served_by_a_worker(shared_redis_server):
    """The bundled Q4_1 GGUF on the CPU in float32 (dequantized at load, by pagedq's reader)
    and in bfloat16 (kept quantized, dequantized per GEMM): each answers as the model
    dequantized to float by transformers does (quantization none) in the same dtype."""
    prefix = f"q{time.time_ns()}"
    f32 = WorkerProc(shared_redis_server.url, prefix, extra=["--max-num-seqs", "4"])
    bf16 = WorkerProc(shared_redis_server.url, prefix, extra=[
        "--served-name", "smol-bf16", "--dtype", "bfloat16", "--max-num-seqs", "4",
        "--kv-cache-memory-gb", "0.25"])
    try:
        for w in (f32.start(wait=False), bf16.start(wait=False)):  # both load at once
            w.wait_ready(300)
        line = ready_line(f32)
        assert "model smollm2 on cpu, float32, gguf Q4_1 x210, Q8_0 x1, dequantized at load " \
               "(float32 CPU)" in line, line
        assert "model smol-bf16 on cpu, bfloat16, gguf Q4_1 x210, Q8_0 x1, kept quantized" in \
            ready_line(bf16)
        with Client(shared_redis_server.url, prefix=prefix, model="smollm2") as c:
            assert answer(c, 16, messages=CHAT) == "The capital of France is Paris."
        with Client(shared_redis_server.url, prefix=prefix, model="smol-bf16") as c:
            got = answer(c, 8, prompt="The capital of France is")
    finally:
        f32.stop()
        bf16.stop()
    ref = LLMEngine("smollm2", device="cpu", dtype="bfloat16", quantization="none",
                    num_kv_blocks=32)
    want = ref.generate(["The capital of France is"], SamplingParams(max_tokens=8,
                                                                       temperature=0.0),
                        use_tqdm=False)[0].text
    assert got == want and got.strip(), (got, want)


def test_awq_checkpoint_served_by_a_worker(shared_redis_server, awq_dirs):
    quant, dense = awq_dirs
    prefix = f"qa{time.time_ns()}"
    w = WorkerProc(shared_redis_server.url, prefix, model=str(quant),
                   extra=["--dtype", "bfloat16", "--max-num-seqs", "4"]).start()
    try:
        assert "model tiny-awq on cpu, bfloat16, awq int4 g64 (gemm), kept quantized" in \
            ready_line(w)
        with Client(shared_redis_server.url, prefix=prefix, model="tiny-awq") as c:
            got = answer(c, 12, prompt="hello there", ignore_eos=True)
    finally:
        w.stop()
    ref = LLMEngine(str(dense), device="cpu", dtype="bfloat16", num_kv_blocks=32)
    want = ref.generate(["hello there"], SamplingParams(max_tokens=12, temperature=0.0,
                                                        ignore_eos=True), use_tqdm=False)
    assert got == want[0].text


def test_unsupported_quantization_exits_78_with_one_line(tmp_path, tiny_model_dir):
    folder = tmp_path / "bnb"
    folder.mkdir()
    for f in tiny_model_dir("LlamaForCausalLM").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    line = config_error(pagedq("worker", "--redis-url", DEAD, "--model", str(folder)))
    assert line.startswith("pagedq: --model: ") and "bitsandbytes" in line, line
    gguf = qw.write_gguf(tiny_model_dir("LlamaForCausalLM"), tmp_path / "k.gguf", "Q5_1")
    line = config_error(pagedq("worker", "--redis-url", DEAD, "--model", str(gguf)))
    assert "Q5_1" in line and "--quantization none" in line, line
    line = config_error(pagedq("worker", "--redis-url", DEAD, "--quantization", "gptq"))
    assert line.startswith("pagedq: --quantization: ") and "GGUF file" in line, line
    line = config_error(pagedq("worker", "--redis-url", DEAD, env={
        "PAGEDQ_QUANTIZATION": "int3"}))
    assert "PAGEDQ_QUANTIZATION" in line and "int3" in line and "gguf" in line, line
    r = pagedq("worker", "--quantization", "int3")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_pagedq_config_shows_the_setting(tmp_path):
    r = pagedq("config", "--json", "--quantization", "gptq")
    got = json.loads(r.stdout)["settings"]["model.quantization"]
    assert got == {"value": "gptq", "source": "flag", "env": "PAGEDQ_QUANTIZATION",
                   "flag": "--quantization"}, got
    f = tmp_path / "w.yaml"
    f.write_text("model:\n  quantization: none\n")
    got = json.loads(pagedq("config", "--json", "--config", str(f)).stdout)["settings"]
    assert got["model.quantization"]["value"] == "none"
    assert got["model.quantization"]["source"] == "file"
