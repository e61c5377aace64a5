#!/usr/bin/env bash
# The GPU path's checks in one run, on a CUDA host whose python3 has torch, triton, transformers, gguf,
# redis and prometheus_client (the pure-Python ones may come on PYTHONPATH, which the script keeps):
# the gpu-marked tests, bench.kernels --device cuda, and bench.engine --device cuda on two random
# checkpoints (no model hub needed): SmolLM2-135M's shapes with its tokenizer, and Llama-3-8B's
# shapes (32 layers, 4096 hidden, 8 KV heads of 128) with the same 49k vocabulary. Weights are
# random bf16: decode speed does not depend on their values.
#
#     bench/gpu_check.sh OUT_DIR SMOLLM2_FILES_DIR
#
# SMOLLM2_FILES_DIR holds the bundled model's config.json and tokenizer files (a converted
# checkpoint's directory under ~/.cache/splitserve/models). Each step has its own time limit;
# OUT_DIR gets the benches' JSON and one log.txt of every step's output and exit status. A step
# that fails does not stop the next. STEPS="name ..." runs only the steps named (pytest_gpu,
# kernels, checkpoints, engine_smollm2, engine_llama8b).
set -u
out=${1:?usage: bench/gpu_check.sh OUT_DIR SMOLLM2_FILES_DIR}
files=${2:?usage: bench/gpu_check.sh OUT_DIR SMOLLM2_FILES_DIR}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$out"
ckpt=$(mktemp -d)

step() {  # step NAME SECONDS COMMAND...: run it with a limit, its output appended to OUT_DIR/log.txt
    local name=$1 limit=$2; shift 2
    [[ -z ${STEPS:-} || " $STEPS " == *" $name "* ]] || return 0
    local start=$SECONDS
    echo "=== $name" >>"$out/log.txt"
    timeout "$limit" "$@" >>"$out/log.txt" 2>&1
    echo "=== $name: exit $? after $((SECONDS - start)) s (limit $limit s)" | tee -a "$out/log.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } >"$out/log.txt" 2>&1

step pytest_gpu 120 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/engine/test_device_path.py tests/unit/engine/test_launch_budget.py \
    tests/unit/engine/test_triton_attention.py tests/unit/engine/test_paged_prefill.py tests/unit/engine/test_fused_norm.py tests/unit/engine/test_rope_kv.py \
    tests/unit/engine/test_gpu_tiers.py tests/unit/engine/test_parallel_device.py tests/unit/engine/test_device_sampler.py
step kernels 60 python3 -m bench.kernels --device cuda --json "$out/kernels.json"

step checkpoints 40 python3 - "$files" "$ckpt" <<'EOF'
import json, shutil, sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

files, root = Path(sys.argv[1]), Path(sys.argv[2])
smollm2 = json.loads((files / "config.json").read_text())
llama8b = {**smollm2, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0, "tie_word_embeddings": False}
for name, config in (("smollm2-shapes", smollm2), ("llama8b-shapes", llama8b)):
    out = root / name
    out.mkdir()
    config = transformers.LlamaConfig(**{**config, "torch_dtype": "bfloat16"})
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {k: (torch.ones(s, dtype=torch.bfloat16) if k.endswith("norm.weight") else
                   (torch.randn(s, device="cuda", generator=g) * 0.02).to(torch.bfloat16).cpu()) for k, s in shapes.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(files / f, out / f)
    print(name, sum(t.numel() for t in tensors.values()) / 1e9, "B parameters")
EOF

common=(--device cuda --dtype bfloat16 --weights bf16 --kv-dtype fp8_e4m3 --seed 0)
step engine_smollm2 120 python3 -m bench.engine --model "$ckpt/smollm2-shapes" "${common[@]}" --num-requests 8 --concurrency 1 8 \
    --prompt-len 32 512 --output-len 16 64 --probe-len 512 128 --roofline-context 1024 --json "$out/engine_smollm2.json"
step engine_llama8b 180 python3 -m bench.engine --model "$ckpt/llama8b-shapes" "${common[@]}" --systems splitserve --num-requests 32 \
    --concurrency 1 8 32 --prompt-len 32 256 --output-len 8 32 --probe-len 512 64 --roofline-context 1024 --kv-cache-bytes $((16 << 30)) \
    --json "$out/engine_llama8b.json"
rm -rf "$ckpt"
