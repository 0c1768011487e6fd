#!/usr/bin/env bash
# Which commit broke the 1.5B recipe's second sync on the H200 (bench/leases/2026-12-02f.md: 146 of 147 probe log-probs NaN
# after the second update's push at 41d5387, clean at 050d7ce)? Two-update `alfrl fit` runs of a commit's own code and
# recipe, one after another, on the model and games `bench/gpu_campaign.sh start` prepared.
#
# Here, before the lease (the device gets no .git; a commit's tracked files are ~4 MB):
#   bash bench/gpu_bisect.sh pack 050d7ce 8989d1b ad4eaa0 ...    # -> .gpu-bisect/<commit>/ (git-ignored), one per commit
# On the device, after the kit, the model pieces and
#   PLAN=figures Q35_PART=0 FIG_BENCH=0 FIT_STEPS=0 GRAPH_TOKENS=0 bash bench/gpu_campaign.sh start   (games + model only):
#   bash bench/gpu_bisect.sh run 050d7ce ad4eaa0 HEAD             # carry .gpu-bisect (HEAD: this checkout); in the background
#   BISECT_EXTRA="--data.engine.enforce_eager true" bash bench/gpu_bisect.sh run HEAD     # overrides for every run
#   (a shorter run first: BISECT_EXTRA="--data.games_per_batch 2 --data.rollout.max_episode_steps 5" at HEAD; if it still
#   shows the NaN at the second sync, bisect with it: keys every commit since 050d7ce knows)
#   bash bench/gpu_bisect.sh wait 300                             # each run's outcome so far; logs and metrics into $OUT
# DRY=1 runs the same on the CPU with the tiny recipe (the HF engine: it checks the mechanics, not the fault).
set -uo pipefail
cd "${ALFRL_REPO:-$(dirname "$0")/..}"
REPO=$PWD
W=${ALFRL_GPU_WORK:-/tmp/alfrl}
OUT=${OUT:-$W/out}
B=$W/bisect
mkdir -p "$B" "$OUT"
if [ "${DRY:-0}" = 1 ]; then
  PY=${PY:-$REPO/.venv/bin/python}; RECIPE=recipes/tiny.yaml
  ARGS=(--trainer.accelerator cpu --data.env.num_workers 2 --data.games_per_batch 2 --model.model_name "${ALFRL_TINY_MODEL:-$REPO/.cache/tiny-model}")
  export ALFWORLD_DATA=${ALFWORLD_DATA:-$REPO/.cache/alfworld}
else
  PY=${PY:-python3}; RECIPE=recipes/qwen15b_coder_h200.yaml
  ARGS=(--trainer.accelerator gpu --data.env.num_workers 16 --data.engine.gpu_memory_utilization 0.4 --model.model_name "$REPO/.cache/qwen15b-coder-hf")
  export ALFWORLD_DATA=$REPO/.cache/alfworld TRITON_CACHE_DIR=$W/cache/triton VLLM_CACHE_ROOT=$W/cache/vllm TORCHINDUCTOR_CACHE_DIR=$W/cache/inductor
fi
export PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false

fit_at() {  # fit_at COMMIT: two updates of that commit's code (HEAD: this checkout), its log and metrics kept under $B
  local c=$1 dir
  dir=$([ "$c" = HEAD ] && echo "$REPO" || echo "$B/code/$c")
  [ -d "$dir/alfrl" ] || { echo "$c: no code (stage .gpu-bisect/$c)" > "$B/$c.outcome"; return 1; }
  local s; s=$(date +%s)
  read -ra extra <<< "${BISECT_EXTRA:-}"
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "${BISECT_TIMEOUT:-400}" "$PY" -m alfrl.cli fit --config $RECIPE "${ARGS[@]}" \
    --trainer.max_steps 2 --trainer.default_root_dir "$B/runs/$c" --checkpoint.save_every 0 --progress_bar.refresh_rate 0 \
    "${extra[@]}") > "$B/$c.log" 2>&1
  local rc=$?
  cp "$B/runs/$c"/csv/version_0/metrics.csv "$B/$c.metrics.csv" 2>/dev/null
  local what; what=$(grep -o "NonFiniteProbeError: .*\|WeightSyncError: .*\|max_steps=2. reached" "$B/$c.log" | tail -1)
  echo "$c rc=$rc $(( $(date +%s) - s ))s ${BISECT_EXTRA:-} ${what:-(see $c.log)}" > "$B/$c.outcome"
}

case "${1:-}" in
  pack)  # here: pack COMMIT... -> .gpu-bisect/<commit>/ (the commit's tracked files)
    shift
    for c in "$@"; do mkdir -p ".gpu-bisect/$c" && git archive "$c" | tar -x -C ".gpu-bisect/$c" && echo "$c: $(du -sh ".gpu-bisect/$c" | cut -f1)"; done ;;
  run)  # device: run COMMIT... (carry .gpu-bisect): copied to /tmp first (a carried path exists only during its call)
    shift
    for c in "$@"; do [ "$c" = HEAD ] || { mkdir -p "$B/code" && cp -r ".gpu-bisect/$c" "$B/code/$c"; }; done
    cp "$0" "$B/bisect.sh"
    ALFRL_REPO=$REPO BISECT_EXTRA="${BISECT_EXTRA:-}" setsid nohup bash "$B/bisect.sh" _run "$@" > "$B/job.log" 2>&1 < /dev/null &
    echo "bisect started: $*" ;;
  _run)
    shift
    while pgrep -f "alfrl.cl[i] " > /dev/null; do sleep 3; done   # alone on the GPU
    for c in "$@"; do fit_at "$c"; done
    touch "$B/done" ;;
  wait)  # wait N: until the runs end or N seconds pass; each outcome, and logs + metrics into $OUT
    end=$(( $(date +%s) + ${2:-300} ))
    while [ "$(date +%s)" -lt "$end" ] && [ ! -f "$B/done" ]; do sleep 5; done
    cat "$B"/*.outcome 2>/dev/null
    tar -czf "$OUT/bisect.tgz" -C "$B" $(cd "$B" && ls *.outcome *.log *.metrics.csv 2>/dev/null) 2>/dev/null
    [ -f "$B/done" ] && echo "all done" ;;
  *) echo "usage: bash bench/gpu_bisect.sh pack COMMIT... | run COMMIT... | wait N" >&2; exit 2 ;;
esac
