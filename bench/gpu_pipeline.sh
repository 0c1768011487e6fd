#!/usr/bin/env bash
# One GPU session for the real-model run (recipes/qwen15b_coder_h200.yaml) and the random-Qwen3-4B
# benchmarks, as background jobs on an nvidia-h200-x2 machine, so no step is bound by a call's limit.
#
# The device tool sends one chunk per call; the calls, back to back:
#   bash bench/gpu_pipeline.sh stage-kit .gpu-kit/c01            # ... c06, one call each
#   bash bench/gpu_pipeline.sh stage-kit .gpu-kit/c07 && bash bench/gpu_pipeline.sh stage-model .gpu-model/m20 \
#     && bash bench/gpu_pipeline.sh setup                          # carry c07, m20, .whl, .gpu-data; setup runs on
#   bash bench/gpu_pipeline.sh stage-model .gpu-model/m01          # ... m18, one call each
#   bash bench/gpu_pipeline.sh stage-model .gpu-model/m19 && bash bench/gpu_pipeline.sh model
#   bash bench/gpu_pipeline.sh wait 540                            # again until it says "all done"; packs $OUT
#
# Lane B (GPU 1, starts when setup is done): the 8 x 8 rollout of the random Qwen3-4B at the 12,000-token
# budget (issue 3), the base model's 274-game evals in both action formats, the random model's 274-game
# eval (issue 5). Lane A (GPU 0, starts when the model has arrived): GGUF -> HF folder, `alfrl fit` for
# 2 updates, `alfrl fit --ckpt_path .../last` for as many more as the deadline allows, the trained
# adapter's 274-game eval, `alfrl report` (base vs trained, training curves).
#
# DRY=1 runs the same script on a CPU with the tiny model (HF engine, 2 games per split) to check it.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
W=${ALFRL_GPU_WORK:-/tmp/alfrl}
OUT=${OUT:-$W/out}
DRY=${DRY:-0}
BUDGET_S=${BUDGET_S:-1470}          # seconds from the first staging call to the end of all work
mkdir -p "$W/logs" "$W/results" "$OUT"
export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "$DRY" = 1 ]; then
  export ALFWORLD_DATA=${ALFWORLD_DATA:-$REPO/.cache}
  PY=${PY:-$REPO/.venv/bin/python}
  RECIPE=recipes/tiny.yaml
  MODEL_OVERRIDES=(--model.model_name "${ALFRL_TINY_MODEL:-$REPO/.cache/tiny-model}")
  ENGINE_TRAIN=(--data.env.num_workers 2)
  ENGINE_EVAL=(--data.env.num_workers 2 --limit-per-split 2)
  FIT_EXTRA=(--data.games_per_batch 2)
  MAX_MORE=1
else
  export ALFWORLD_DATA=$REPO/.cache/alfworld
  PY=${PY:-python3}
  RECIPE=recipes/qwen15b_coder_h200.yaml
  MODEL_OVERRIDES=()
  ENGINE_TRAIN=(--data.env.num_workers 16)
  ENGINE_EVAL=(--data.env.num_workers 16 --data.engine.gpu_memory_utilization 0.85)
  FIT_EXTRA=()
  MAX_MORE=30
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then  # one GPU: both lanes share it, no random-4B benchmarks
    ONE_GPU=1 GPU_A=0 GPU_B=0
    ENGINE_TRAIN=(--data.env.num_workers 8 --data.engine.gpu_memory_utilization 0.3)
    ENGINE_EVAL=(--data.env.num_workers 8 --data.engine.gpu_memory_utilization 0.45)
  fi
fi
ONE_GPU=${ONE_GPU:-0}
ALFRL=("$PY" -m alfrl.cli)
RUN=$W/runs/qwen15b
[ -f "$W/t0" ] || date +%s > "$W/t0"
T0=$(cat "$W/t0")
DEADLINE=$((T0 + BUDGET_S))

log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$W/logs/pipeline.log"; }
timed() {  # timed NAME CMD...: run, log its wall seconds into results/times.txt
  local name=$1; shift
  local s=$(date +%s)
  log "start $name"
  "$@" > "$W/logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$(( $(date +%s) - s ))" >> "$W/results/times.txt"
  log "end $name rc=$rc ($(( $(date +%s) - s ))s)"
  return $rc
}
wait_for() { while [ ! -f "$W/$1" ]; do [ "$(date +%s)" -ge "$DEADLINE" ] && return 1; sleep 2; done; }

base_eval() {  # base_eval FORMAT
  timed "eval_base_$1" "${ALFRL[@]}" eval --config $RECIPE "${MODEL_OVERRIDES[@]}" "${ENGINE_EVAL[@]}" \
    --data.rollout.action_format "$1" --out "$RUN/base_$1.jsonl"
  cp "$RUN/base_$1.summary.json" "$W/results/" 2>/dev/null
}

lane_b() {
  [ "$DRY" = 1 ] || export CUDA_VISIBLE_DEVICES=$GPU_B
  if [ "$DRY" != 1 ] && [ "$ONE_GPU" != 1 ]; then
    timed bench_rollout_random4b "$PY" bench/gpu_bench.py --model .cache/random-qwen3-4b --data-dir .cache/alfworld \
      --out "$W/results/bench_rollout_random4b.json" --skip update eval --gpu-memory-utilization 0.85 --enforce-eager \
      --completion-tokens 100
  fi
  wait_for model.ready || { log "lane B: no model before the deadline"; return; }
  base_eval action_tag
  touch "$W/base_action_tag.done"
  base_eval tool_call
  if [ "$DRY" != 1 ] && [ "$ONE_GPU" != 1 ]; then
    timed bench_eval_random4b "$PY" bench/gpu_bench.py --model .cache/random-qwen3-4b --data-dir .cache/alfworld \
      --out "$W/results/bench_eval_random4b.json" --eval-out "$W/runs/eval_random4b.jsonl" --skip rollout update \
      --gpu-memory-utilization 0.85 --enforce-eager --eval-completion-tokens 32 --eval-games-per-chunk 69
  fi
}

steps_left() {  # how many more updates fit before the trained eval must start
  "$PY" - "$RUN" "$DEADLINE" "$W/results/times.txt" "$MAX_MORE" <<'PY'
import csv, glob, re, sys, time
run, deadline, times = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = [r for f in glob.glob(f"{run}/csv/version_*/metrics.csv") for r in csv.DictReader(open(f)) if r.get("rollout/seconds")]
cols = ["rollout/seconds", "train/old_logprob_seconds", "train/update_seconds", "sync/seconds"]
step = max(sum(float(r.get(c) or 0) for c in cols) for r in rows) * 1.15 + 5 if rows else 120.0
evals = [int(m.group(1)) for line in open(times) if (m := re.match(r"eval_base_action_tag rc=0 seconds=(\d+)", line))]
eval_s = (evals[0] * 1.15 if evals else 360) + 30
start_s = 75  # trainer load + engine start + checkpoint load
print(max(1, min(int(sys.argv[4]), int((deadline - time.time() - eval_s - start_s) // step))))
PY
}

lane_a() {
  [ "$DRY" = 1 ] || export CUDA_VISIBLE_DEVICES=$GPU_A
  if [ "$DRY" != 1 ]; then
    wait_for setup.done || return
    mkdir -p .cache/qwen15b-coder
    cat /tmp/model-stage/qwen.gguf.part* > .cache/qwen15b-coder/qwen.gguf
    sha=$(sha256sum .cache/qwen15b-coder/qwen.gguf | cut -d' ' -f1)
    [ "$sha" = cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 ] || { log "GGUF checksum mismatch: $sha"; return 1; }
    timed convert_gguf "${ALFRL[@]}" convert-gguf .cache/qwen15b-coder --gguf-file qwen.gguf --out .cache/qwen15b-coder-hf || return 1
  fi
  touch "$W/model.ready"
  local common=(--config $RECIPE "${MODEL_OVERRIDES[@]}" "${ENGINE_TRAIN[@]}" "${FIT_EXTRA[@]}"
                --trainer.default_root_dir "$RUN" --progress_bar.refresh_rate 0)
  timed fit_1 "${ALFRL[@]}" fit "${common[@]}" --trainer.max_steps 2 || return 1
  local more; more=$(steps_left)
  log "lane A: $more more updates fit before the deadline"
  timed fit_2_resumed "${ALFRL[@]}" fit "${common[@]}" --trainer.max_steps $((2 + more)) --ckpt_path "$RUN/checkpoints/last"
  timed eval_trained "${ALFRL[@]}" eval --config $RECIPE "${MODEL_OVERRIDES[@]}" "${ENGINE_EVAL[@]}" \
    --adapter "$RUN/checkpoints/last" --out "$RUN/trained_action_tag.jsonl"
  cp "$RUN/trained_action_tag.summary.json" "$W/results/" 2>/dev/null
  # wait for the other format's baseline (lane B) as long as the deadline allows, then report
  while [ ! -f "$RUN/base_tool_call.summary.json" ] && [ "$(date +%s)" -lt "$DEADLINE" ]; do sleep 5; done
  local files=("$RUN/base_action_tag.jsonl" "$RUN/trained_action_tag.jsonl") names=(base trained)
  [ -f "$RUN/base_tool_call.summary.json" ] && { files+=("$RUN/base_tool_call.jsonl"); names+=(base_tool_call); }
  timed report "${ALFRL[@]}" report "${files[@]}" --names "${names[@]}" --out "$W/results/report" --train-log "$RUN"
}

pack() {  # results (small) and the trajectories (gzipped) into $OUT
  cp "$W/logs/pipeline.log" "$OUT/" 2>/dev/null
  for v in "$RUN"/csv/version_*; do [ -f "$v/metrics.csv" ] && cp "$v/metrics.csv" "$W/results/metrics_$(basename "$v").csv"; done
  tar -czf "$OUT/results.tgz" -C "$W" results logs 2>/dev/null
  for f in "$RUN"/*.jsonl; do [ -f "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
  ls -la "$OUT"
}

case "${1:-}" in
  stage-kit)
    bash bench/gpu_session.sh stage "$2" && log "staged $2" ;;
  stage-model)
    mkdir -p /tmp/model-stage && cp "$2"/qwen.gguf.part* /tmp/model-stage/ && log "staged $2 ($(ls /tmp/model-stage | wc -l) parts)" ;;
  setup)  # in the background: install, games, random model; then lane B
    setsid nohup bash "$0" _setup > "$W/logs/setup_and_lane_b.log" 2>&1 < /dev/null &
    log "setup started" ;;
  _setup)
    s=$(date +%s)
    if [ "$DRY" != 1 ]; then
      bash bench/gpu_session.sh install > "$W/logs/install.log" 2>&1 || { log "install failed"; touch "$W/lane_b.done"; exit 1; }
      GPU_B=${GPU_B:-1}
      [ "$ONE_GPU" = 1 ] || CUDA_VISIBLE_DEVICES=$GPU_B "$PY" bench/random_model.py --shape qwen3-4b --out .cache/random-qwen3-4b >> "$W/logs/install.log" 2>&1
      nvidia-smi --query-gpu=index,name,memory.total --format=csv >> "$W/logs/install.log"
    fi
    echo "setup rc=0 seconds=$(( $(date +%s) - s ))" >> "$W/results/times.txt"
    touch "$W/setup.done"; log "setup done"
    GPU_B=${GPU_B:-1} lane_b; touch "$W/lane_b.done"; log "lane B done" ;;
  model)
    setsid nohup bash "$0" _lane_a > "$W/logs/lane_a.log" 2>&1 < /dev/null &
    log "lane A started" ;;
  _lane_a)
    GPU_A=${GPU_A:-0} lane_a; touch "$W/lane_a.done"; log "lane A done" ;;
  wait)  # wait N: until both lanes are done or N seconds pass; then pack what there is
    end=$(( $(date +%s) + ${2:-540} ))
    while [ "$(date +%s)" -lt "$end" ] && ! { [ -f "$W/lane_a.done" ] && [ -f "$W/lane_b.done" ]; }; do sleep 5; done
    pack > /dev/null
    tail -n 40 "$W/logs/pipeline.log"; cat "$W/results/times.txt" 2>/dev/null
    for f in "$W"/logs/fit_*.log "$W"/logs/eval_*.log "$W"/logs/bench_*.log; do
      [ -f "$f" ] && { echo "== $f"; grep -v "it/s\]\|^INFO\|^(EngineCore\|^DEBUG" "$f" | tail -n 6; }; done
    { [ -f "$W/lane_a.done" ] && [ -f "$W/lane_b.done" ]; } && echo "all done" ;;
  *) sed -n 2,20p "$0"; exit 2 ;;
esac
