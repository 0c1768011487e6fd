#!/usr/bin/env bash
# Two-update `alfrl fit` runs of the 1.5B recipe on the H200, one after another, each at a commit's own code and recipe
# (or this checkout), with its own overrides and environment: for the engine fault of raw-results-2026-12-06:bench/leases/2026-12-02f.md and
# 2026-12-02g.md (NaN probe at the second sync, or a CUDA illegal memory access at the first probe scoring; at 050d7ce
# too, which had run clean on 2026-12-01, so not a regression of this repository's code since). Runs on the model and
# games `bench/gpu_campaign.sh start` prepared.
#
# Here, before the lease (the device gets no .git; a commit's tracked files are ~4 MB):
#   bash bench/gpu_bisect.sh pack 050d7ce 977bf1b ...           # -> .gpu-bisect/<commit>/ (git-ignored), one per commit
# On the device, after the kit, the model pieces and
#   PLAN=figures Q35_PART=0 FIG_BENCH=0 FIT_STEPS=0 GRAPH_TOKENS=0 bash bench/gpu_campaign.sh start   (games + model only):
#   bash bench/gpu_bisect.sh run HEAD 050d7ce                   # carry .gpu-bisect (HEAD: this checkout); in the background,
#                                                               # after start's model (stops at once where start never ran)
#   Each run is COMMIT or COMMIT@LABEL (one commit, several variants); per run (by LABEL, else COMMIT):
#     BISECT_EXTRA_<label>="--data.engine.enforce_eager true"     recipe overrides (keys that commit knows)
#     BISECT_ENV_<label>="-u VLLM_CACHE_ROOT VLLM_USE_V2_MODEL_RUNNER=0"   `env` arguments for its process
#     BISECT_BENCH_<label>="--phases ceiling runners"        bench/sampler_bench.py with these arguments instead of the fit
#     BISECT_SCRIPT_<label>="bench/lora_tune.py --rank 32 ..."  another script instead (no overrides; outcome: its last line)
#     BISECT_TIMEOUT_<label>=240                                  its own limit in seconds (else BISECT_TIMEOUT)
#     BISECT_MPS_<label>=1   under a CUDA MPS daemon of its own (started before, stopped after): the kernels of the trainer's
#                            process and vLLM's engine core process (`data.engine.separate_process`) run side by side
#                            instead of by time slices; its control log kept as <label>.mps.log
#   BISECT_EXTRA="..." applies to every run; BISECT_STEPS: updates per fit (2). E.g. the next lease's variants at HEAD:
#     BISECT_EXTRA_eager="--data.engine.enforce_eager true" BISECT_EXTRA_sync="--data.engine.async_scheduling false" \
#     BISECT_ENV_caches="-u VLLM_CACHE_ROOT -u TRITON_CACHE_DIR -u TORCHINDUCTOR_CACHE_DIR" BISECT_ENV_v1="VLLM_USE_V2_MODEL_RUNNER=0" \
#       bash bench/gpu_bisect.sh run HEAD@eager HEAD@sync HEAD@caches HEAD@v1
#   bash bench/gpu_bisect.sh wait 300                             # each run's outcome so far; logs and metrics into $OUT
#   A fit's outcome line ends with its updates' figures (bench/fit_table.py --line): read them there, during the lease.
#   The machine goes back 30 idle seconds after a call ends, and the runs with it: send the next `wait` in the same
#   batch as reading the last one's files (2026-12-03b, 2026-12-04d lost a fit each to reading first).
#   A bench run's limit must hold the engine's start: ~150 s on a fresh machine (2026-12-04d), before any phase.
# Each fit gets BISECT_TIMEOUT seconds (600: an eager fit's two updates took over 400 s), then SIGKILL 20 s after the
# SIGTERM (Lightning catches SIGTERM and its run went on, 2026-12-02h).
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

gpu_range() {  # gpu_range FILE: "SM MHz a-b, GPU C a-b, W a-b" over the samples where the GPU was busy (utilization > 0)
  [ -s "$1" ] || return 0
  awk -F', *' '$6 + 0 > 0 { n++; for (i = 2; i <= 5; i++) { if (n == 1 || $i + 0 < lo[i]) lo[i] = $i + 0; if (n == 1 || $i + 0 > hi[i]) hi[i] = $i + 0 } }
    END { if (n) printf "busy %d samples: SM MHz %d-%d, GPU C %d-%d, W %d-%d", n, lo[2], hi[2], lo[4], hi[4], lo[5], hi[5] }' "$1"
}

fit_at() {  # fit_at COMMIT[@LABEL]: two updates of that commit's code (HEAD: this checkout) with the run's overrides and
  # environment; its log and metrics kept under $B as LABEL (else COMMIT)
  local c=${1%%@*} label=${1#*@} dir
  dir=$([ "$c" = HEAD ] && echo "$REPO" || echo "$B/code/$c")
  [ -d "$dir/alfrl" ] || { echo "$label: no code (stage .gpu-bisect/$c)" > "$B/$label.outcome"; return 1; }
  local s; s=$(date +%s)
  local own="BISECT_EXTRA_$label" env_of="BISECT_ENV_$label" limit_of="BISECT_TIMEOUT_$label"
  read -ra extra <<< "${BISECT_EXTRA:-} ${!own:-}"
  read -ra envs <<< "${!env_of:-}"
  local mps_of="BISECT_MPS_$label" mps=""
  if [ "${!mps_of:-0}" = 1 ]; then  # this run's own MPS daemon; its clients (the trainer, vLLM's core) find it by the pipe folder
    mps=$B/mps-$label; mkdir -p "$mps"
    command -v nvidia-cuda-mps-control > /dev/null || { echo "$label: not run: no nvidia-cuda-mps-control on this machine" > "$B/$label.outcome"; return 1; }
    CUDA_MPS_PIPE_DIRECTORY=$mps CUDA_MPS_LOG_DIRECTORY=$mps nvidia-cuda-mps-control -d \
      || { echo "$label: not run: the MPS daemon did not start" > "$B/$label.outcome"; return 1; }
    envs+=("CUDA_MPS_PIPE_DIRECTORY=$mps" "CUDA_MPS_LOG_DIRECTORY=$mps")
  fi
  local bench_of="BISECT_BENCH_$label" script_of="BISECT_SCRIPT_$label" cmd
  if [ -n "${!script_of:-}" ]; then  # another script with these arguments (no recipe overrides), e.g. bench/lora_tune.py
    read -ra sargs <<< "${!script_of}"
    cmd=("$PY" "${sargs[@]}")
  elif [ -n "${!bench_of:-}" ]; then  # bench/sampler_bench.py with these arguments instead of a fit; the overrides after `--`
    read -ra bargs <<< "${!bench_of}"
    cmd=("$PY" bench/sampler_bench.py --recipe $RECIPE --out "$B/$label.json" "${bargs[@]}" -- "${ARGS[@]}" --trainer.logger false "${extra[@]}")
  else
    cmd=("$PY" -m alfrl.cli fit --config $RECIPE "${ARGS[@]}" --trainer.max_steps "${BISECT_STEPS:-2}" --checkpoint.save_every 0
         --trainer.default_root_dir "$B/runs/$label" --progress_bar.refresh_rate 0 "${extra[@]}")
  fi
  local smi=""  # the GPU's clocks, temperature and power every 2 s of the run (<label>.gpu.txt; the outcome line has their
  # range): the same replay's engine steps took 11% longer in the lease's last run than in its first (2026-12-04f)
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu --format=csv,noheader,nounits -l 2 \
      > "$B/$label.gpu.txt" 2>&1 & smi=$!
  fi
  (cd "$dir" && env "${envs[@]}" PYTHONPATH=/tmp/site:$dir timeout -k 20 "${!limit_of:-${BISECT_TIMEOUT:-600}}" "${cmd[@]}") > "$B/$label.log" 2>&1
  local rc=$?
  [ -n "$smi" ] && kill "$smi" 2> /dev/null
  if [ -n "$mps" ]; then  # stopped before the next run, which must not find it
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$mps nvidia-cuda-mps-control; sleep 2; cp "$mps/control.log" "$B/$label.mps.log" 2>/dev/null
  fi
  cp "$B/runs/$label"/csv/version_0/metrics.csv "$B/$label.metrics.csv" 2>/dev/null
  [ -n "${!script_of:-}" ] && { echo "$label ($c) rc=$rc $(( $(date +%s) - s ))s ${envs[*]} $(tail -1 "$B/$label.log")" > "$B/$label.outcome"; return; }
  local what; what=$(grep -ao "TrainerMemoryError: .*\|NonFiniteProbeError: .*\|WeightSyncError: .*\|CUDA error: [a-z ]*\|max_steps=[0-9]*. reached\|^phase [a-z]*: .*" "$B/$label.log" | tail -1)
  [ -f "$B/$label.json" ] && what="$what $("$PY" -c 'import json,sys; r=json.load(open(sys.argv[1]))["phases"]
for k,v in sorted(r.get("runners",{}).items()):
  if isinstance(v,dict) and "seconds" in v: print(k, round(v["seconds"],2), "s", v["engine_steps"], "steps", v["generated_tokens"], "tok, half ended",
    round(v.get("ended_seconds",{}).get("p50",0),2), "s, longest", v.get("completion_tokens",{}).get("max"), "tok;", end=" ")
for u in r.get("update",{}).get("runs",[]):
  if "error" in u: print(u["variant"], "failed:", u["error"].strip().splitlines()[-1].split(":")[0].split(".")[-1] + ";", end=" ")
  else: print(u["variant"], round(u["seconds"],2), "s", round(100*u["mfu_6n"],1), "%;", end=" ")
for n,d in r.get("decode",{}).items():
  if isinstance(d,dict) and "runs" in d: print(n, "rows ms/step", *[x["requests"] + " " + format(x["ms_per_token_step"], ".3f") for x in d["runs"]], end="; ")
for u in r.get("step",{}).get("runs",[]): print("step", u["mode"], int(1000*u["step_seconds"])/1000, "s, replay", int(1000*u["replay_seconds"])/1000,
  "tail", u["tail_steps"], "x", int(1000*u["tail_step_ms"])/1000, "ms, after", int(1000*u["update_after_replay_seconds"])/1000, end="; ")
for m in ("alone", "beside_resets"):
  p=r.get("pushes",{}).get(m,[])
  if p: print("pushes", m, "load s", *[int(1000*x.get("sync/load_seconds",-1))/1000 for x in p], end="; ")
c=r.get("ceiling",{}); print("ceiling", round(c["seconds"],2) if "seconds" in c else c.get("error","-")[-80:])' "$B/$label.json" 2>&1 | tail -1)"
  [ -f "$B/$label.metrics.csv" ] && what="$what; $(PYTHONPATH=/tmp/site:$REPO "$PY" "$REPO/bench/fit_table.py" --line "$B/$label.metrics.csv" 2>&1 | tail -1)"
  local sms; sms=$(grep -ao "alfrl: CUDA MPS: this process may use [0-9a-zA-Z]* SMs ([a-z_]* [0-9a-zA-Z]*)" "$B/$label.log" | head -1)
  local gpu; gpu=$(gpu_range "$B/$label.gpu.txt")
  echo "$label ($c) rc=$rc $(( $(date +%s) - s ))s ${envs[*]} ${extra[*]} ${what:-(see $label.log)}${sms:+ [${sms#alfrl: }]}${gpu:+ [$gpu]}" > "$B/$label.outcome"
}

case "${1:-}" in
  pack)  # here: pack COMMIT... -> .gpu-bisect/<commit>/ (the commit's tracked files)
    shift
    for c in "$@"; do mkdir -p ".gpu-bisect/$c" && git archive "$c" | tar -x -C ".gpu-bisect/$c" && echo "$c: $(du -sh ".gpu-bisect/$c" | cut -f1)"; done ;;
  run)  # device: run COMMIT... (carry .gpu-bisect): copied to /tmp first (a carried path exists only during its call)
    shift  # the runs wait for gpu_campaign.sh start's model; a machine where it never started (a fresh one) stops here
    [ "${DRY:-0}" = 1 ] || [ -f "$W/logs/start.log" ] || { echo "run: no model on this machine (a fresh one?): stage the kit and the model, then gpu_campaign.sh start" >&2; exit 1; }
    for run in "$@"; do c=${run%%@*}; [ "$c" = HEAD ] || [ -d "$B/code/$c" ] || { mkdir -p "$B/code" && cp -r ".gpu-bisect/$c" "$B/code/$c"; }; done
    cp "$0" "$B/bisect.sh"; rm -f "$B/done"
    for v in "${!BISECT_EXTRA_@}" "${!BISECT_ENV_@}" "${!BISECT_BENCH_@}" "${!BISECT_SCRIPT_@}" "${!BISECT_TIMEOUT_@}" "${!BISECT_MPS_@}"; do export "$v"; done
    ALFRL_REPO=$REPO BISECT_EXTRA="${BISECT_EXTRA:-}" setsid nohup bash "$B/bisect.sh" _run "$@" > "$B/job.log" 2>&1 < /dev/null &
    echo "bisect started: $*" ;;
  _run)
    shift
    while pgrep -f "alfrl.cl[i] " > /dev/null; do sleep 3; done   # alone on the GPU
    while [ "${DRY:-0}" != 1 ] && [ ! -f "$W/model.done" ]; do   # the converted model (gpu_campaign.sh start)
      [ -f "$W/model.failed" ] && { echo "no model: gpu_campaign.sh start failed (its logs: $W/logs)" > "$B/model.outcome"; touch "$B/done"; exit 1; }; sleep 2; done
    cp "$W/results/machine.txt" "$B/" 2>/dev/null   # the GPU, its driver, torch, transformers (gpu_campaign.sh install)
    cp "$REPO/.cache/qwen15b-coder-hf/config.json" "$B/model_config.json" 2>/dev/null   # the converted model's config, as transformers wrote it
    for run in "$@"; do fit_at "$run"; done
    touch "$B/done" ;;
  wait)  # wait N: until the runs end or N seconds pass; each outcome, and logs + metrics into $OUT
    # a machine where no run started (it went back between calls: a fresh one) has nothing to wait for (2026-12-03d: 400 s lost)
    [ -f "$B/job.log" ] || { echo "wait: no bisect run on this machine (a fresh one?): stage the kit and the model, start, run again" >&2; exit 1; }
    end=$(( $(date +%s) + ${2:-300} ))
    while [ "$(date +%s)" -lt "$end" ] && [ ! -f "$B/done" ]; do sleep 5; done
    cat "$B"/*.outcome 2>/dev/null
    # *.json.gz: a bench run's saved turns (--save-turns $B/turns.json.gz) come back, for the same work on a later lease
    tar -czf "$OUT/bisect.tgz" -C "$B" $(cd "$B" && ls *.outcome *.log *.metrics.csv *.json *.json.gz *.txt 2>/dev/null) 2>/dev/null
    [ -f "$B/done" ] && echo "all done" ;;
  *) echo "usage: bash bench/gpu_bisect.sh pack COMMIT... | run COMMIT[@LABEL]... | wait N" >&2; exit 2 ;;
esac
