#!/usr/bin/env bash
# The GPU figures of issue 4 in one go (run from the repo root on the H200 machine; OUT is
# the folder for JSON results). What each line measures is in bench/*.py's docstrings.
#   bash bench/h200.sh [tests] [gputests] [main] [ablations] [profile] [kernels] [service] [openloop]
#                      [prefill] [rediscost] [guided] [round3] [quanttests] [quant]
# (round3: bench/round3.py, issue 28's one call: every decode variant at workload 1's batch
# sizes, workload 1 with the best ones, the shared-prefix A/B; ~6-7 min on an empty Triton
# cache; run `bash bench/old_trees.sh` in a checkout first so that .whl/trees holds the old
# engines it compares)
# (gputests: under 5 min, three pytest runs in turn; give it a call of its own)
# (quant: under 5 min on an empty Triton cache, which it clears first: the W4A16 GEMM
# sweep, then bf16 and int4 Llama-3.1-8B engines decoding; quanttests: the quantized GEMM
# and engine tests on the GPU, a few minutes of compiles; give each a call of its own)
# (openloop: 301 s on the H200, closed run and worker start included: give it a call of its
# own or little beside it; it draws its PNGs where matplotlib is, else python bench/plot.py JSON)
set -u
OUT=${OUT:-/tmp/pagedq-bench}
mkdir -p "$OUT"
steps=${*:-tests main ablations profile}
off() { timeout 300 python3 bench/offline.py --out "$OUT" "$@" 2>&1 | grep -E "tok/s|Error" | tail -2; }
for s in $steps; do
  case $s in
    tests) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py \
             tests/test_gpu_engine.py tests/test_model.py tests/test_sampler.py 2>&1 | tail -4 ;;
    gputests) # the CUDA cases of every test file with any, one group after another (run
              # concurrently, one group shrank the other's free memory and the engine-after-engine
              # test's KV-size check failed); the first with -m gpu: some of its files' CPU tests
              # need what the GPU machine lacks (the bundled SmolLM2; CPU tensors for Triton). H200
              # (2026-12-03): 49, 69 and 10 passed in 151, 112 and 2 s. Logs under $OUT
              grp() { local name=$1 limit=$2; shift 2; local log=$OUT/gputests-$name.log
                      timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rs "$@" > "$log" 2>&1
                      echo "$name rc=$?" >> "$log"; tail -3 "$log"; grep -E "^(FAILED|ERROR)" "$log" | head -20; }
              grp gpu 280 -m gpu tests/test_kernels.py tests/test_decode_variants.py \
                tests/test_kv_fp8.py tests/test_gpu_engine.py tests/test_model.py tests/test_gpu_metrics.py
              grp quant 200 tests/test_quant_kernels.py tests/test_quant_gpu.py
              grp sampler 100 tests/test_sampler.py -k "cuda or grammar or logit_bias" ;;
    main) rm -rf ~/.triton/cache  # first process on an empty Triton cache, as on a new machine
          off --num-seqs 256; off --num-seqs 256 --kv-cache-dtype fp8
          off --num-seqs 256 --kv-cache-dtype fp8_e5m2; off --num-seqs 256 --kv-cache-dtype int8
          off --shape llama-3.2-1b --num-seqs 128; off --shape llama-3.1-8b --num-seqs 32 ;;
    ablations) for a in "" "--enforce-eager" "--no-async" "--disable rms_norm,fused_add_rms_norm" \
                 "--disable qk_norm_rope_store,apply_rotary" "--disable silu_and_mul" \
                 "--disable gumbel_argmax" "--disable qk_norm_rope_store" \
                 "--disable decode_order" "--disable piecewise_graphs"; do
                 off --num-seqs 64 $a; done ;;
    profile) timeout 300 python3 bench/profile_steps.py --top 12 --out "$OUT" 2>&1 | grep -v -i warn | tail -16 ;;
    kernels) timeout 300 python3 bench/attention.py --quick --fp8-sweep --out "$OUT" 2>&1 | tail -24 ;;
    service) export PAGEDQ_REDIS_SERVER=${PAGEDQ_REDIS_SERVER:-$PWD/.whl/redis-server}
             off_json="$OUT/offline-qwen3-0.6b-256.json"  # from `main`, if it ran before
             reuse=(); [ -f "$off_json" ] && reuse=(--offline-json "$off_json")
             echo "service, default settings (PAGEDQ_COALESCE_MS=10):"
             timeout 300 python3 bench/service.py --num-seqs 256 "${reuse[@]}" 2>&1 | tail -2
             echo "service, PAGEDQ_COALESCE_MS=0 (an event per job per step):"
             PAGEDQ_COALESCE_MS=0 timeout 300 python3 bench/service.py --num-seqs 256 \
               "${reuse[@]}" 2>&1 | tail -2 ;;
    openloop) export PAGEDQ_REDIS_SERVER=${PAGEDQ_REDIS_SERVER:-$PWD/.whl/redis-server}
              timeout 580 python3 bench/service.py --rate auto --duration 30 --settle 5 \
                --out "$OUT" 2>&1 | grep -v -i warn | tail -12 ;;
    round3) PYTHONUNBUFFERED=1 timeout 590 python3 bench/round3.py --prefix --out "$OUT" 2>&1 \
              | grep -v -i warn ;;
    prefill) timeout 300 python3 bench/prefill.py --out "$OUT" 2>&1 | grep -v -i warn | tail -6 ;;
    guided) # tok/s of workload 1 with 0%, 10% and 100% guided rows (needs llguidance, carried
            # in .whl/); async (the default) then synchronous: what guided rows cost each way
            # and a tokenizer: .whl/smollm2-tokenizer/ (bench/guided.py says how to make it)
            tok=(--tokenizer .whl/smollm2-tokenizer)
            timeout 300 python3 bench/guided.py engine "${tok[@]}" --json "$OUT/guided.json" \
              2>&1 | tail -7
            timeout 300 python3 bench/guided.py engine "${tok[@]}" --no-async \
              --json "$OUT/guided-sync.json" 2>&1 | tail -7 ;;
    quanttests) timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py \
                  tests/test_quant_gpu.py 2>&1 | tail -6 ;;  # the GEMM and engine on the GPU
    quant) rm -rf ~/.triton/cache  # its budget includes compiling every config once
           timeout 580 python3 bench/quant.py --out "$OUT" 2>&1 | grep -v -i warn | tail -60 ;;
    rediscost) export PAGEDQ_REDIS_SERVER=${PAGEDQ_REDIS_SERVER:-$PWD/.whl/redis-server}
               # no GPU used: 1 redis-server vs a 3-master cluster (6 partitions), generators
               # 3x for the cluster; about 1.5 minutes
               timeout 580 python3 bench/redis_cost.py --target both --workers 2 --readers 2 \
                 --duration 15 --out "$OUT" 2>&1 | grep -v -i warn | tail -12 ;;
  esac
done
