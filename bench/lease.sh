#!/usr/bin/env bash
# One GPU lease as a background job, so no step is bound by a call's limit. Calls, back to back (the machine goes
# cold 30 s after a call, and a call sent beside a long local command waits for it: a lease was lost so, 2026-12-06;
# a carried path exists only during its call, so `stage` copies it to /tmp; reading a `wait`'s files here between two calls
# for a few minutes let the machine go cold mid-evaluation and lost a whole lease's setup, 2026-12-07e: the next `wait`
# first, what it brought back read while it runs or after `give_back`):
#   bash bench/lease.sh stage .gpu-kit/c01       # ... c07 (c01 carries install.sh), then .gpu-data
#   UNTIL_S=1380 bash bench/lease.sh start       # install and games start; the job waits for the model's pieces:
#   bash bench/lease.sh stage .gpu-model/m01     # ... m20; then the model, the rest of the expert plans and the lanes
#   bash bench/lease.sh wait 540                 # until the lanes are done or 540 s pass; results, logs and 4 shipped pieces to $OUT
#   bash bench/lease.sh send                     # 4 more shipped pieces (adapters come back in pieces of 14 MiB, their sha256 in results;
#                                                # ~6 s a call: a trainer.ckpt, 31 pieces, in 8 calls, under a minute)
#   bash bench/lease.sh stop                     # the learning run ends (SIGTERM: the update in flight ends and is saved, ~40 s
#                                                # on an H100) and ships that checkpoint (before 2026-12-07g: only the newest of
#                                                # every 2 updates; the update in flight was lost)
#                                                # (UNTIL_S counts from `start`, the device budget from the machine's start: leave
#                                                # the shipping's minutes and a margin; a second `start` skips the setup; the fit's
#                                                # Timer gets UNTIL less its start, LEARN_START_S=180, and one update, 100 s)
#   bash bench/lease.sh stage .gpu-adapters/R/pieces/adapter.part00 .gpu-adapters/R/adapter_config.json .gpu-adapters/R/adapter.sha256
#                                                # then part01, part02, before `start`: the warm start is that adapter, no sft
#   bash bench/lease.sh stage .gpu-cache            # before `start`, if an earlier lease shipped d_compile_cache.tgz (its pieces in .gpu-cache/): no engine compile
#   bash bench/lease.sh stage .gpu-resume/R/trainer.ckpt.part00 .gpu-resume/R/step .gpu-resume/R/trainer.ckpt.sha256   # step: step-000024
#                                                # then the other parts (4 a call), before `start`: the arm whose run folder R's
#                                                # name starts with (learn_stepN: GRPO, learn_gigpo_stepN: GiGPO) resumes from
#                                                # that checkpoint (--ckpt_path); an earlier lease shipped it as e_learn_step-N_trainer.ckpt
#   UPTO=20 LANES="warmstart learn learn:gigpo" bash bench/lease.sh start   # both arms, each up to update 20, one after the other
#   UPTO=40 LANES="warmstart learn:gigpo" bash bench/lease.sh start   # the arm carried on (GiGPO) alone; a second `start` on the
#                                                # same machine goes on from the newest checkpoint the first saved
#   bash bench/lease.sh stage .gpu-baseline         # before `start`: an earlier commit's alfrl/ for lane updateprof (old against new)
#   STAGED_LATE=1 ... bash bench/lease.sh start      # then the model's pieces, then the warm start, checkpoint and cache pieces while
#                                                # the model converts (~60 s), then `bash bench/lease.sh staged`: ~45 s of a lease saved
# .gpu-data holds json_2.1.1.tar.xz and, if made here, expert.jsonl.gz with its .skipped.json (`alfrl expert --config
# recipes/qwen15b_coder_h200.yaml --model.model_name .gpu-model --model.gguf_file qwen.gguf --trainer.accelerator cpu
# --out .gpu-data/expert.jsonl`, gzipped, the plain file moved out: 18 min on this 2-core CPU, 2026-12-07f); the lease plays
# the games it did not reach (all of them, ~5 min beside the conversion, when none were staged).
# LANES (default "warmstart evals fits learn"): warmstart: alfrl sft on every plan (adapter and plans shipped); evals: its
# 274-game evaluation with data.eval.deterministic true, false, true, compared by `alfrl report` (issue "Reproducible to
# the bit"); det_a alone ~4.5 min on an H100 (2026-12-07e: its batch-invariant engine compiles, 173 s to start, which the
# learning run's compile cache does not hold; then ~80 s of games); fits: 3-update fits of recipes/rl_qwen15b_grpo.yaml at 4 games x 8, 20 steps, data.rollout.deterministic true
# twice (rollouts and adapters hashed), false, and true with torch's deterministic algorithms, warn_only (FITS="..." picks); learn: the learning run of that recipe (issue "Learning at scale") until UNTIL_S seconds after `start`
# (ARM=gigpo: the GiGPO arm in its own folder; its last adapter shipped; with learneval in LANES it stops EVAL_RESERVE_S, default 400 (300 when learneval evaluates no warm start), earlier); learneval: that adapter's
# 274-game deterministic evaluation and, in the same process, the warm start's if this machine made it (records and summaries shipped; LEARNEVAL_WARMSTART=0: the adapter alone); sftspeed: alfrl sft's speed (SFTSPEED="recipe plain compiled", also expandable and rows4096 (the update's row size), SFTSPEED_STEPS=8; the way `profiled`: the recipe under Lightning's PyTorchProfiler, its table in results); sftrows: bench/sft_rows.py (a warm-start batch: attention loop, fused varlen, unpacked; ~2 min); updateprof: the learning run's update alone, profiled (~6 min a run); recipefit: 4 updates of recipes/qwen15b_coder_h200.yaml from the base model, as its earlier fits (~4 min); q35drift: the reference recipe on a random Qwen3.5-4B with CUDA graphs, 2 updates a variant (Q35DRIFT="graphs bf16state noprefix nosleep sepcore fulldecode piecewise eager"); probe: bench/stale_memory_probe.py or bench/sleep_probe.py on a random Qwen3.5-4B (PROBE, PROBE_VARIANTS, PROBE_LAYERS). SFT_STEPS=N: a shorter warm start; EVALS="det_a det_b": those evaluations only.
# DRY=1 runs the same lanes on this CPU with the tiny model (hf engine, 2 games a split) to check them before a lease.
set -uo pipefail
cd "${ALFRL_REPO:-$(dirname "$0")/..}"
REPO=$PWD
# on the checkout's disk (the run's files in one ignored folder that later calls keep)
W=${ALFRL_GPU_WORK:-$PWD/.gpu-work}
OUT=${OUT:-$W/out}
DRY=${DRY:-0}
LANES=${LANES:-warmstart evals fits learn}
mkdir -p "$W/logs" "$W/results" "$W/runs" "$OUT"
RUN=$W/runs
mkdir -p "$W/tmp"
# DRY=1: the games where `make data` put them (the caller's $ALFWORLD_DATA, else the Makefile's default), and the tiny
# model of this checkout; `start` hands both to the job, which runs from a copy without .cache
ALFWORLD_DATA_DRY=${ALFWORLD_DATA_DRY:-${ALFWORLD_DATA:-$HOME/.cache/alfworld}}
ALFRL_TINY_MODEL=${ALFRL_TINY_MODEL:-$PWD/.cache/tiny-model}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false ALFWORLD_DATA=$W/alfworld TMPDIR=$W/tmp   # each environment copies a library there
log() { echo "$(date +%T) $*" | tee -a "$W/logs/lease.log"; }
timed() {  # timed NAME CMD...: the command's output in logs/NAME.log, its rc and seconds in results/times.txt
  local name=$1 s rc; shift; s=$(date +%s)
  "$@" > "$W/logs/$name.log" 2>&1; rc=$?
  echo "$name rc=$rc seconds=$(( $(date +%s) - s ))" >> "$W/results/times.txt"; log "$name rc=$rc"; return $rc
}
if [ "$DRY" = 1 ]; then
  PY=${PY:-$REPO/.venv/bin/python}; export ALFWORLD_DATA=$ALFWORLD_DATA_DRY PYTHONPATH=$REPO
  TINY=$ALFRL_TINY_MODEL
  LEARN=recipes/tiny.yaml; SFT=recipes/sft_tiny.yaml; MODEL=(--model.model_name "$TINY"); H200FIT=$LEARN
  SFT_ARGS=(--trainer.max_steps 2 --trainer.accelerator cpu); EXPERT=$REPO/runs/tiny-expert.jsonl; SFT_PLAIN=(--model.attn_implementation sdpa)
  EVAL=(--limit-per-split 2 --data.env.num_workers 2); FIT=(--trainer.accelerator cpu --data.env.num_workers 2 --data.games_per_batch 2)
  SFTROWS=(--tokens-per-step 4000 --row-tokens 4000 --steps 2); UPDATEPROF=(--dry)
else
  PY=python3
  export PYTHONPATH=/tmp/site:$REPO NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export TRITON_CACHE_DIR=$W/cache/triton VLLM_CACHE_ROOT=$W/cache/vllm TORCHINDUCTOR_CACHE_DIR=$W/cache/inductor
  LEARN=recipes/rl_qwen15b_grpo.yaml; SFT=recipes/sft_qwen15b.yaml; MODEL=(--model.model_name "$W/qwen15b-coder-hf"); H200FIT=recipes/qwen15b_coder_h200.yaml
  SFT_ARGS=(${SFT_STEPS:+--trainer.max_steps $SFT_STEPS}); EXPERT=$W/expert.jsonl
  # recipes/sft_qwen15b.yaml has the RL update's packing and bf16 adapter matmuls (since 2026-12-07); its settings before:
  SFT_PLAIN=(--model.attn_implementation sdpa --model.adapter_dtype float32 --model.ppo.microbatch_tokens 4096)
  # alone on the GPU: 0.85 of it holds every game's KV cache (28 KiB a token, 274 x 12,000 tokens at most)
  EVAL=(--data.engine.gpu_memory_utilization 0.85 --data.env.num_workers 16); FIT=(--data.env.num_workers 16)
  SFTROWS=(); UPDATEPROF=(--lengths 4000 11000)   # the 50-step learning run's trajectories averaged ~7,000 tokens
fi
ALFRL=("$PY" -m alfrl.cli)
# the learning run's arm (issue "Learning at scale"): ARM=gigpo runs the GiGPO arm (recipes/rl_qwen15b_gigpo.yaml, the arm
# carried on after update 20) in runs/learn_gigpo; the default, GRPO (recipes/rl_qwen15b_grpo.yaml), in runs/learn. The lane
# `learn:gigpo` in LANES runs that arm whatever ARM says (LANES="warmstart learn learn:gigpo": both, one after the other).
# DRY=1: the tiny recipe with the GiGPO recipe's two advantage keys
LEARN0=$LEARN
set_arm() {
  ARM=${1:-}; LD=learn${ARM:+_$ARM}; ARM_ARGS=(); LEARN=$LEARN0
  case "$ARM" in
    "") ;;
    gigpo) if [ "$DRY" = 1 ]; then ARM_ARGS=(--data.advantage.estimator gigpo --data.advantage.norm mean_norm)
           else LEARN=recipes/rl_qwen15b_gigpo.yaml; fi ;;
    *) echo "ARM=$ARM: give gigpo, or nothing for GRPO" >&2; exit 2 ;;
  esac
}
ARM0=${ARM:-}; set_arm "$ARM0"
GGUF_SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046   # ../shared/gpu-offline/fetch-model.sh

setup() {  # the kit and the games; then, once every model piece is staged, the model converted beside the expert plans
  if [ "$DRY" = 1 ]; then
    [ -f "$EXPERT" ] || timed expert "${ALFRL[@]}" expert --config "$LEARN" "${MODEL[@]}" --trainer.accelerator cpu --limit 8 --out "$EXPERT" || return 1
    return 0
  fi
  timed install bash /tmp/wheel-stage/install.sh install /tmp/site || return 1
  rm -rf /tmp/wheel-stage
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
  } > "$W/results/machine.txt" 2>&1 || return 1
  timed games "${ALFRL[@]}" data prepare --data-dir "$W/alfworld" --archive /tmp/gpu-data/json_2.1.1.tar.xz || return 1
  # the plans the CPU made, if staged; without them (a checkout that lost .gpu-data/expert.jsonl.gz) the GPU box plays all
  # 3,553 below, ~5 min with 12 workers beside the GGUF's conversion
  if [ -f /tmp/gpu-data/expert.jsonl.gz ]; then
    gunzip -c /tmp/gpu-data/expert.jsonl.gz > "$EXPERT" && cp /tmp/gpu-data/expert.jsonl.skipped.json "$EXPERT.skipped.json" || return 1
  else log "no expert plans staged: all of them made here"; fi
  df -h /tmp "$W" > "$W/results/disk.txt" 2>&1
  local waited=0
  while [ "$(ls /tmp/model-stage/qwen.gguf.part* 2>/dev/null | wc -l)" -lt 20 ]; do
    sleep 2; waited=$(( waited + 2 )); [ "$waited" -lt 1200 ] || { log "the model's 20 pieces did not all arrive"; return 1; }
  done
  mkdir -p "$W/qwen15b-coder" && cat /tmp/model-stage/qwen.gguf.part* > "$W/qwen15b-coder/qwen.gguf" && rm -rf /tmp/model-stage || return 1
  [ "$(sha256sum < "$W/qwen15b-coder/qwen.gguf" | cut -d' ' -f1)" = "$GGUF_SHA" ] || { log "the GGUF's checksum does not match"; return 1; }
  # the expert plans the CPU did not reach (resumed: games already in the file are skipped), tokenized from the GGUF as there
  timed expert "${ALFRL[@]}" expert --config recipes/qwen15b_coder_h200.yaml --model.model_name "$W/qwen15b-coder" \
    --model.gguf_file qwen.gguf --trainer.accelerator cpu --data.env.num_workers 12 --out "$EXPERT" &
  local expert=$!
  timed convert "${ALFRL[@]}" convert-gguf "$W/qwen15b-coder" --gguf-file qwen.gguf --out "$W/qwen15b-coder-hf" || return 1
  wait $expert || return 1
  log "$(wc -l < "$EXPERT") expert trajectories"
}

await_staged() {  # STAGED_LATE=1 (given to `start`): the warm start, a checkpoint and the compile cache are staged after the model's
  # pieces, while the model converts (~60 s); the lanes begin once `bash bench/lease.sh staged` says they are all there
  [ "${STAGED_LATE:-0}" = 1 ] || return 0
  local waited=0
  until [ -f "$W/staged.done" ]; do
    sleep 2; waited=$(( waited + 2 )); [ "$waited" -lt 900 ] || { log "STAGED_LATE: no \`staged\` call in 900 s"; return 1; }
  done
  log "staged late: the lanes begin"
}

last_step() { [ -f "$1/last" ] && echo "$1/$(cat "$1/last")"; }   # a checkpoints/ folder's newest step (its file `last` names it)

ship() {  # ship FILE NAME: FILE in pieces of 14 MiB under ship/ (its sha256 in results/), for `wait` and `send` to bring back
  [ -f "$1" ] || { log "nothing to ship at $1"; return 1; }
  mkdir -p "$W/ship" && sha256sum "$1" | sed "s|  .*|  $2|" > "$W/results/$2.sha256" && split -b 14M -d -a 2 "$1" "$W/ship/$2.part" \
    && log "shipping $2: $(ls "$W/ship/$2".part* | wc -l) pieces"
}

warmstart() {  # the warm start: alfrl sft on every expert plan; its adapter shipped (the next lease starts from it)
  if [ -d /tmp/adapter-stage ]; then  # a warm start brought back by an earlier lease, staged in pieces: no alfrl sft
    local step=$RUN/sft/checkpoints/step-000030
    mkdir -p "$step/adapter" && cat /tmp/adapter-stage/adapter.part* > "$step/adapter/adapter_model.safetensors" \
      && cp /tmp/adapter-stage/adapter_config.json "$step/adapter/" && echo step-000030 > "$RUN/sft/checkpoints/last" || return 1
    [ "$(sha256sum < "$step/adapter/adapter_model.safetensors" | cut -d' ' -f1)" = "$(cat /tmp/adapter-stage/adapter.sha256)" ] \
      || { log "the staged warm start's checksum does not match"; return 1; }
    log "warm start: the staged adapter (no alfrl sft)"; return 0
  fi
  # the recipe (the RL update's packing and bf16 adapter matmuls); its earlier settings if that fails
  if ! timed sft "${ALFRL[@]}" sft --config "$SFT" "${MODEL[@]}" --data.expert_file "$EXPERT" --trainer.default_root_dir "$RUN/sft" \
      "${SFT_ARGS[@]}"; then
    rm -rf "$RUN/sft"
    timed sft_plain "${ALFRL[@]}" sft --config "$SFT" "${MODEL[@]}" --data.expert_file "$EXPERT" --trainer.default_root_dir "$RUN/sft" \
      "${SFT_ARGS[@]}" "${SFT_PLAIN[@]}" || return 1
  fi
  cp "$RUN/sft"/csv/version_0/metrics.csv "$W/results/sft.metrics.csv" 2>/dev/null
  cp "$EXPERT.skipped.json" "$W/results/"
  local staged=0; [ -f /tmp/gpu-data/expert.jsonl.gz ] && staged=$(gunzip -c /tmp/gpu-data/expert.jsonl.gz | wc -l)
  if [ "$(wc -l < "$EXPERT")" -gt "$staged" ]; then   # plans made on this machine (none or not all staged): back, for .gpu-data
    gzip -c "$EXPERT" > "$W/expert.jsonl.gz" && ship "$W/expert.jsonl.gz" a_expert.jsonl.gz
  fi
  local last; last=$(last_step "$RUN/sft/checkpoints") || return 1
  ship "$last/adapter/adapter_model.safetensors" b_sft_adapter.safetensors
  cp "$last/adapter/adapter_config.json" "$W/results/sft_adapter_config.json"
}

sftspeed() {  # issue "The reference recipe at full speed", item 3: alfrl sft as the recipe has it (the RL update's varlen rows
  # of 16K tokens and bf16 adapter), with its earlier settings (plain: sdpa, float32, 4K rows), and the recipe with compiled
  # layers; same plans, seed and steps (SFTSPEED_STEPS, default 8), no validation; each run's sft/mfu (6N) in
  # results/sftspeed_NAME.metrics.csv (expandable: the recipe with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, the learning run's)
  local name extra alloc
  for name in ${SFTSPEED:-recipe plain compiled}; do
    alloc=expandable_segments:False
    case $name in recipe) extra=() ;; plain) extra=("${SFT_PLAIN[@]}") ;; expandable) extra=(); alloc=expandable_segments:True ;;
      compiled) extra=(--model.compile_layers true); alloc=expandable_segments:True ;;
      rows4096) extra=(--model.ppo.microbatch_tokens 4096) ;;   # the H100 update's rows: ~2 expert plans a row instead of ~10
      profiled) extra=(--trainer.profiler.class_path lightning.pytorch.profilers.PyTorchProfiler   # steps 3-5 under
        --trainer.profiler.init_args.dirpath "$RUN/sftspeed_profiled/prof" --trainer.profiler.init_args.filename sft   # torch.profiler,
        --trainer.profiler.init_args.row_limit 60) ;;                                                                 # GPU time first
      *) log "sftspeed: no way named $name (recipe plain expandable compiled rows4096 profiled)"; continue ;; esac
    timed "sftspeed_$name" env PYTORCH_CUDA_ALLOC_CONF=$alloc "${ALFRL[@]}" sft --config "$SFT" "${MODEL[@]}" --data.expert_file "$EXPERT" "${SFT_ARGS[@]}" "${extra[@]}" \
      --trainer.max_steps "${SFTSPEED_STEPS:-8}" --trainer.limit_val_batches 0 --trainer.default_root_dir "$RUN/sftspeed_$name"
    cp "$RUN/sftspeed_$name"/csv/version_0/metrics.csv "$W/results/sftspeed_$name.metrics.csv" 2>/dev/null
    cp "$RUN/sftspeed_$name"/prof/*.txt "$W/results/sftspeed_${name}_profile.txt" 2>/dev/null   # the table only (the trace is large)
    rm -rf "$RUN/sftspeed_$name/checkpoints"
  done; true
}

evals() {  # the warm start's 274 games: deterministic, not, deterministic again (issue "Reproducible to the bit")
  local adapter=$RUN/sft/checkpoints/last
  for name in ${EVALS:-det_a nondet det_b}; do
    local extra=(); [ "$name" = nondet ] && extra=(--data.eval.deterministic false)
    timed "eval_$name" "${ALFRL[@]}" eval --config "$LEARN" "${MODEL[@]}" --adapter "$adapter" "${EVAL[@]}" "${extra[@]}" \
      --out "$RUN/$name.jsonl"
    cp "$RUN/$name.summary.json" "$W/results/" 2>/dev/null; grep -h "evaluation time\|in engine steps" "$W/logs/eval_$name.log" >> "$W/results/eval_times.txt"
  done
  (cd "$RUN" && sha256sum det_a.jsonl det_b.jsonl nondet.jsonl; cmp det_a.jsonl det_b.jsonl && echo "det_a = det_b, byte for byte") \
    > "$W/results/eval_compare.txt" 2>&1
  for name in det_a det_b nondet; do  # every record comes back (a few MB each)
    [ -f "$RUN/$name.jsonl" ] && gzip -c "$RUN/$name.jsonl" > "$W/$name.jsonl.gz" && ship "$W/$name.jsonl.gz" "c_warmstart_$name.jsonl.gz"
  done
  local names=(); for name in det_a det_b nondet; do [ -f "$RUN/$name.summary.json" ] && names+=("$name"); done
  timed report "${ALFRL[@]}" report $(for n in "${names[@]}"; do echo "$RUN/$n.jsonl"; done) --names "${names[@]}" --out "$W/results/report"
}

fits() {  # 3-update fits from the warm start (4 games x 8, 20 steps: the lease's time), the same seed, each in its own process:
  # FITS names them (default: deterministic twice, then not, then deterministic with torch's deterministic algorithms,
  # Lightning's trainer.deterministic); rollouts and adapters hashed, each fit's rollouts shipped as it ends
  for name in ${FITS:-fit_det_a fit_det_b fit_nondet fit_torchdet}; do
    local flag=true extra=(); [ "$name" = fit_nondet ] && flag=false
    [ "$name" = fit_torchdet ] && extra=(--trainer.deterministic warn)   # warn: an op without a deterministic kernel is named in the log, not fatal
    timed "$name" "${ALFRL[@]}" fit --config "$LEARN" "${MODEL[@]}" --model.init_adapter "$RUN/sft/checkpoints/last" "${FIT[@]}" \
      --data.games_per_batch 4 --data.rollout.max_episode_steps 20 --data.rollout.deterministic $flag --data.save_rollouts true \
      --trainer.max_steps 3 --checkpoint.save_every 3 --periodic_eval.every_n_steps 0 --trainer.default_root_dir "$RUN/$name" "${extra[@]}"
    cp "$RUN/$name"/csv/version_0/metrics.csv "$W/results/$name.metrics.csv" 2>/dev/null
    (cd "$RUN/$name" && sha256sum rollouts/* checkpoints/step-000003/adapter/* > "$W/results/$name.sha256" 2>/dev/null)
    [ -d "$RUN/$name/rollouts" ] && tar -czf "$W/$name.rollouts.tgz" -C "$RUN/$name" rollouts && ship "$W/$name.rollouts.tgz" "c_$name.rollouts.tgz"
  done
}

sftrows() {  # issue "The reference recipe at full speed", item 3: one warm-start batch's rows three ways (bench/sft_rows.py:
  # the per-sequence attention loop as alfrl sft runs it, torch's fused varlen attention, one sequence a row), same weights
  timed sftrows "$PY" bench/sft_rows.py --model "${MODEL[1]}" --expert "$EXPERT" --out "$W/results/sft_rows.json" "${SFTROWS[@]}" || true
}

updateprof() {  # is the learning run's update host-bound? (issues "The reference recipe at full speed" and "Learning at scale"):
  # bench/update_alone.py on random weights of the model's shape, 64 synthetic trajectories: the H100 learning recipes'
  # update (4,096-token budget: a trajectory a row, bf16 adapter; UPDATEPROF_VARIANTS names others), once more under
  # torch.profiler: its kernels' busy share of the wall clock (below 1: the GPU waited), and once under CUDA's sync debug
  # mode: how many of its calls waited for the GPU. 383 / 364 s a run on an H100 (2026-12-07f: the model made and saved,
  # a warm-up, the timed, profiled and sync-counted updates).
  # With a baseline staged (`stage .gpu-baseline`: an earlier commit's alfrl/, `git archive COMMIT alfrl | tar -x -C
  # .gpu-baseline`), the same first, with that alfrl, same samples and seeds: old against new on one machine
  local variants; read -ra variants <<< "${UPDATEPROF_VARIANTS:-varlen_rows4096_bf16}"   # (also: varlen_rows16384_bf16_compiled, the H200 recipe's)
  if [ -d "$W/baseline/alfrl" ]; then
    timed updateprof_baseline env PYTHONPATH="$W/baseline:$PYTHONPATH" "$PY" bench/update_alone.py --config "${MODEL[1]}" \
      "${UPDATEPROF[@]}" --variants "${variants[@]}" --profile "$W/results/updateprof_baseline_profile.txt" \
      --out "$W/results/updateprof_baseline.json" || true
  fi
  timed updateprof "$PY" bench/update_alone.py --config "${MODEL[1]}" "${UPDATEPROF[@]}" --variants "${variants[@]}" \
    --profile "$W/results/updateprof_profile.txt" --out "$W/results/updateprof.json" || true
}

recipefit() {  # issue "A core you would live in", item 6: 4 updates of recipes/qwen15b_coder_h200.yaml as it stands, from the
  # base model as its earlier fits ran (updates 1-4 on an H100, 2026-12-06a at 9ddd58c: steps 22.598-29.220 s, mean
  # 26.043 s; an H200, 2026-12-05a: 21.295-23.856 s over updates 1-5), same seed and games: its steps against theirs
  timed recipefit env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "${ALFRL[@]}" fit --config "$H200FIT" "${MODEL[@]}" \
    "${FIT[@]}" --trainer.max_steps 4 --checkpoint.save_every 4 --periodic_eval.every_n_steps 0 \
    --trainer.default_root_dir "$RUN/recipefit"
  cp "$RUN/recipefit"/csv/version_0/metrics.csv "$W/results/recipefit.metrics.csv" 2>/dev/null; true
}

random_q35() {  # random_q35 LAYERS: the folder of a random Qwen3.5-4B-structure checkpoint of LAYERS text layers (0: all 32;
  # the small shape in a dry run), made once on this machine
  local model=$W/random-q35-$1l depth=(--layers "$1") shape=qwen3.5-4b
  [ "$1" = 0 ] && depth=(); [ "$DRY" = 1 ] && shape=qwen3.5-small
  [ -d "$model" ] || timed "random_q35_$1l" "${ALFRL[@]}" random-model --shape "$shape" "${depth[@]}" --out "$model" >&2 || return 1
  echo "$model"
}

q35drift() {  # issue "The reference recipe at full speed", item 1: the reference recipe on a random Qwen3.5-4B-structure
  # checkpoint, 2 updates at the 2026-12-06 attempt's shape (2 games x 8, 10 steps, 100 tokens a turn, reward noise, the canary
  # at update 1), one process a variant of Q35DRIFT (default "graphs bf16state"): graphs = CUDA graphs, sleep mode, prefix
  # caching as the recipe has them; bf16state = the same with the Gated DeltaNet state in bf16 (what the checkpoint of
  # 2026-12-06 got from vLLM: its config lacked the released configs' mamba_ssm_dtype float32); noprefix = graphs without
  # prefix caching; nosleep = graphs without sleep mode; sepcore = graphs, the engine core in its own process (its own CUDA
  # context; no sleep mode, 0.4 of the GPU); fulldecode / piecewise = graphs of that vLLM cudagraph_mode only; eager. Each: engine/probe_drift (0.0 eager, 0.93-1.77 then), the
  # canary caught or not, the sampler-trainer log-prob gap; results/q35drift_<variant>.metrics.csv. Q35DRIFT_LAYERS=N: N layers;
  # Q35DRIFT_ARGS: more overrides for every variant (the reference shape, eager against graphs on one machine: "--data.games_per_batch
  # 8 --data.rollout.max_episode_steps 50 --data.rollout.max_assistant_tokens 1024"). Stage .gpu-extra first for Qwen3.5's
  # trainer-side kernels (else transformers' PyTorch fallback: the update 35.8-41.8 s at this shape, 2026-12-06).
  local model v extra
  model=$(random_q35 "${Q35DRIFT_LAYERS:-0}") || return 1
  # its loggers CSV only: SwanLab is not in the offline kit (a logger class that cannot be imported fails before an override)
  "$PY" -c "import sys, yaml; d = yaml.safe_load(open(sys.argv[1])); d['trainer']['logger'] = [{'class_path':
    'lightning.pytorch.loggers.CSVLogger', 'init_args': {'save_dir': '\${trainer.default_root_dir}', 'name': 'csv'}}]
yaml.safe_dump(d, open(sys.argv[2], 'w'), sort_keys=False)" recipes/qwen4b_80step.yaml "$W/q35.yaml" || return 1
  for v in ${Q35DRIFT:-graphs bf16state}; do
    extra=(--data.engine.enforce_eager false)   # every variant but eager runs CUDA graphs
    case $v in
      graphs) ;;
      bf16state) extra+=(--data.engine.vllm_args '{mamba_ssm_cache_dtype: bfloat16}') ;;
      noprefix) extra+=(--data.engine.prefix_caching false) ;;
      nosleep) extra+=(--data.engine.sleep_mode false) ;;
      sepcore) extra+=(--data.engine.separate_process true --data.engine.sleep_mode false --data.engine.gpu_memory_utilization 0.4) ;;
      fulldecode) extra+=(--data.engine.cudagraph_mode full_decode_only) ;;
      piecewise) extra+=(--data.engine.cudagraph_mode piecewise) ;;
      eager) extra=(--data.engine.enforce_eager true) ;;
      *) log "q35drift: unknown variant $v"; continue ;;
    esac
    [ "$DRY" = 1 ] && extra=(--data.engine.kind hf --data.engine.separate_weights true --trainer.accelerator cpu --data.group_size 2 \
      --data.env.num_workers 2)
    timed "q35drift_$v" timeout 900 "${ALFRL[@]}" fit --config "$W/q35.yaml" --model.model_name "$model" --data.games_per_batch 2 \
      --data.rollout.max_episode_steps 10 --data.rollout.max_assistant_tokens 100 --data.reward.noise 0.5 --weight_sync.canary_at_step 1 \
      --trainer.max_steps 2 --checkpoint.save_every 0 --progress_bar.refresh_rate 0 --trainer.default_root_dir "$RUN/q35drift_$v" "${extra[@]}" \
      ${Q35DRIFT_ARGS:-}
    cp "$RUN/q35drift_$v"/csv/version_0/metrics.csv "$W/results/q35drift_$v.metrics.csv" 2>/dev/null
    grep -h "canary\|probe log-probs moved\|WeightSync\|stopped:" "$W/logs/q35drift_$v.log" | tail -n 5 > "$W/results/q35drift_$v.lines.txt"
  done
}

probe() {  # bench/stale_memory_probe.py (PROBE=stale, the default: does the engine read GPU memory it freed?) or
  # bench/sleep_probe.py (PROBE=sleep: the engine's scores across sleeps) on a random Qwen3.5-4B of PROBE_LAYERS text layers
  # (default 4; 0: all 32), one process per variant of PROBE_VARIANTS ("ARGS;ARGS"; stale's default: graphs without sleep
  # mode, graphs with it, eager); results/<PROBE>_probe<i>.json
  local p=${PROBE:-stale} script=bench/stale_memory_probe.py default="--no-sleep-mode --decode 300 --turns 4;--decode 300 --turns 4;--eager --decode 300 --turns 4"
  [ "$p" = sleep ] && { script=bench/sleep_probe.py; default=--adapter; }
  local model v a i=0
  model=$(random_q35 "${PROBE_LAYERS:-4}") || return 1
  IFS=';' read -ra variants <<< "${PROBE_VARIANTS-$default}"
  for v in "${variants[@]}"; do
    read -ra a <<< "$v"; [ "$DRY" = 1 ] && a+=(--dry --probe-tokens 50 --decode 2)
    timed "${p}_probe$i" timeout 600 "$PY" "$script" --model "$model" --out "$W/results/${p}_probe$i.json" "${a[@]}"
    i=$((i + 1))
  done
}

learn() {  # the learning run, stopped by max_time (or at update UPTO); it goes on from its arm's newest checkpoint: one staged
  # by `stage .gpu-resume/${LD}_stepN/...` (the folder's name starts with the run's folder, learn_stepN or learn_gigpo_stepN),
  # used once, or else the one an earlier `start` on this machine saved in $RUN/$LD
  local reserve=0; case " $LANES " in *" learneval "*) reserve=${EVAL_RESERVE_S:-$(learneval_warmstart && echo 400 || echo 300)} ;; esac
  # Lightning's Timer counts from the start of training, not from the process's start (model, engine, CUDA graphs: 150-200 s,
  # LEARN_START_S; 2026-12-07d ran ~3 min past UNTIL without it), and one update and a save follow the time (100 s)
  local left=$(( ${UNTIL:-0} - $(date +%s) - 100 - ${LEARN_START_S:-180} - reserve ))
  [ "$left" -ge 150 ] || { log "$LD: $left s left, not started"; return 0; }
  [ -f "$W/stop" ] && { log "$LD: stopped before it began (\`stop\`)"; return 0; }
  local resume=() staged step=
  staged=$(ls -d /tmp/resume-stage/"${LD}"_step* 2>/dev/null | head -1)
  if [ -n "$staged" ]; then  # a checkpoint brought back by an earlier lease, written beside (never over) the run's files
    local name; name=$(tr -d '[:space:]' < "$staged/step") || return 1   # step-000024, or 24
    [[ "$name" =~ ^[0-9]+$ ]] && name=$(printf 'step-%06d' "$((10#$name))")
    [[ "$name" =~ ^step-[0-9]{6}$ ]] || { log "the staged checkpoint's step file says '$name': write step-NNNNNN (or N) there"; return 1; }
    step=$RUN/$LD/checkpoints/$name
    mkdir -p "$step" && cat "$staged"/trainer.ckpt.part* > "$W/tmp/staged.ckpt" || return 1
    [ "$(sha256sum < "$W/tmp/staged.ckpt" | cut -d' ' -f1)" = "$(cut -d' ' -f1 "$staged/trainer.ckpt.sha256")" ] \
      || { log "the staged checkpoint's checksum does not match (stage its pieces again)"; return 1; }
    mv "$W/tmp/staged.ckpt" "$step/trainer.ckpt" && basename "$step" > "$RUN/$LD/checkpoints/last" && rm -rf "$staged" || return 1
  elif step=$(last_step "$RUN/$LD/checkpoints" 2>/dev/null) && [ -f "$step/trainer.ckpt" ]; then
    log "$LD: no staged checkpoint; going on from this machine's"   # a second `start` (before 2026-12-07b it began again from the warm start)
  else
    step=
  fi
  if [ -n "$step" ]; then
    resume=(--ckpt_path "$step/trainer.ckpt"); log "$LD: resuming from $(basename "$step")"
    # Lightning's Timer goes on from the training time saved in the checkpoint (max_time counts over every resume: a
    # resumed arm stopped after 2 updates on 2026-12-07): this process's time is added to it
    local spent; spent=$("$PY" -c "import sys, torch; c = torch.load(sys.argv[1], map_location='cpu', weights_only=False)
print(int(c.get('callbacks', {}).get('Timer', {}).get('time_elapsed', {}).get('train', 0)))" "$step/trainer.ckpt") || spent=0
    log "$LD: ${spent} s of training time in the checkpoint"; left=$(( left + spent ))
  fi
  # the trainer's free memory in one piece (the recipe's header: 8,192-token rows ran out of memory on an H100 without it)
  timed "$LD" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "${ALFRL[@]}" fit --config "$LEARN" "${MODEL[@]}" \
    --model.init_adapter "$RUN/sft/checkpoints/last" "${FIT[@]}" "${resume[@]}" \
    --trainer.max_time "$(printf '00:%02d:%02d:%02d' $(( left / 3600 )) $(( left / 60 % 60 )) $(( left % 60 )))" \
    --trainer.default_root_dir "$RUN/$LD" "${ARM_ARGS[@]}" ${UPTO:+--trainer.max_steps $UPTO}
  cat "$RUN/$LD"/csv/version_*/metrics.csv > "$W/results/$LD.metrics.csv" 2>/dev/null
  [ -d "$RUN/$LD/evals" ] && tar -czf "$W/results/${LD}_evals.tgz" -C "$RUN/$LD" evals   # the periodic evaluations' games (alfrl report pairs them)
  local last; last=$(last_step "$RUN/$LD/checkpoints") && log "$LD: last checkpoint $last" || return 1
  cp "$last/adapter/adapter_config.json" "$W/results/${LD}_adapter_config.json" 2>/dev/null
  basename "$last" > "$W/results/${LD}_last_step"
  ship "$last/trainer.ckpt" "e_${LD}_$(basename "$last")_trainer.ckpt"   # the next lease resumes from it (the adapter is in it)
  ship "$last/adapter/adapter_model.safetensors" "f_${LD}_$(basename "$last")_adapter.safetensors" || true   # last: `send` brings it if time allows (a resumed run that made no update has none)
  ship_compile_cache
}

ship_compile_cache() {  # vLLM's, inductor's and Triton's caches after the first learning process, when none was staged and they
  # fit one staging call (56 MiB), shipped before the checkpoints (6 MB on 2026-12-07): the next lease stages them
  # (`stage .gpu-cache`) and its engines skip the compile (30.01 s
  # of a 75.45 s engine start on 2026-12-06h; 5.49 s of 28.24 s on a machine that had compiled, 2026-12-07)
  [ -f "$W/cache.staged" ] || [ -f "$W/cache.shipped" ] || [ "$DRY" = 1 ] && return 0
  touch "$W/cache.shipped"
  tar -czf "$W/compile_cache.tgz" -C "$W" cache 2>/dev/null || return 0
  local size; size=$(stat -c %s "$W/compile_cache.tgz")
  [ "$size" -le $(( 56 * 1024 * 1024 )) ] && ship "$W/compile_cache.tgz" d_compile_cache.tgz || log "compile cache: $size bytes, not shipped"; true
}

learneval_warmstart() {  # whether learneval evaluates the warm start too: one made on this machine (a staged one has its records)
  [ "${LEARNEVAL_WARMSTART:-1}" = 1 ] && [ ! -d /tmp/adapter-stage ] && [ "$LANES" != "${LANES/warmstart/}" ]
}

learneval() {  # the learning run's last adapter, the 274 games deterministic; with it, in the same process (one engine start,
  # ~90 s more of games), the warm start made on this machine (not one staged: its records exist), so the two pair exactly
  local last; last=$(last_step "$RUN/$LD/checkpoints") || { log "learneval: no learn checkpoint"; return 1; }
  local name=${LD}_$(basename "$last") adapters outs
  adapters=("$last"); outs=("$RUN/$name.jsonl")
  if learneval_warmstart && [ -e "$RUN/sft/checkpoints/last" ]; then
    adapters+=("$RUN/sft/checkpoints/last"); outs+=("$RUN/warmstart_det_a.jsonl")
  fi
  timed "eval_$name" "${ALFRL[@]}" eval --config "$LEARN" "${MODEL[@]}" --adapter "${adapters[@]}" "${EVAL[@]}" --out "${outs[@]}"
  local rc=$? out base
  grep -h "evaluation time\|in engine steps" "$W/logs/eval_$name.log" >> "$W/results/eval_times.txt"
  for out in "${outs[@]}"; do  # each file whose evaluation finished (the last adapter's first: the warm start's may not)
    base=$(basename "$out" .jsonl)
    [ -f "$RUN/$base.summary.json" ] || continue
    cp "$RUN/$base.summary.json" "$W/results/"
    gzip -c "$out" > "$W/$base.jsonl.gz" && ship "$W/$base.jsonl.gz" "c_$base.jsonl.gz"
  done
  return $rc
}

send() {  # up to 4 shipped pieces (56 MiB; $OUT takes 8 files, 64 MiB) into $OUT, first name first; each piece goes once
  local n=0 f
  for f in $(ls "$W/ship"/*.part* 2>/dev/null | sort); do
    [ "$n" -lt "${1:-4}" ] || break
    mv "$f" "$OUT/" && n=$(( n + 1 ))
  done
  echo "sent $n pieces; $(ls "$W/ship"/*.part* 2>/dev/null | wc -l) left"
}

pack() {  # results and the logs' ends into $OUT (8 files at most)
  tar -czf "$OUT/results.tgz" -C "$W" results 2>/dev/null
  for f in "$W"/logs/*.log; do tail -n 60 "$f" | cut -c1-400; done > "$OUT/logs_tail.txt"
  cp "$W/logs/lease.log" "$OUT/" 2>/dev/null; true
}

progress() {  # the learning runs' newest update and periodic evaluations, read from their CSV logs (what decides a `learneval`)
  local d
  for d in "$RUN"/learn*; do
    [ -d "$d/csv" ] || continue
    PYTHONPATH=${ALFRL_REPO:-$REPO}:${PYTHONPATH:-} "$PY" -c "import sys
from alfrl.curves import eval_rows, log_records
recs = log_records([sys.argv[1]]); steps = [int(float(r['step'])) for r in recs if r.get('step') not in (None, '')]
print(sys.argv[2] + ': update', max(steps) + 1 if steps else 0, ' '.join(
    f\"| eval at {r['update']}: {100 * r['success_rate']:.2f}%\" for r in eval_rows(recs)))" "$d" "$(basename "$d")" 2>/dev/null
  done; true
}

case "${1:-}" in
  stage)  # stage DIR: a kit chunk, a model piece or .gpu-data, copied to /tmp before the call ends
    case "$2" in
      *gpu-kit*) if [ -f "$2/install.sh" ]; then bash "$2/install.sh" stage "$2"; else bash /tmp/wheel-stage/install.sh stage "$2"; fi ;;
      *gpu-extra*) bash /tmp/wheel-stage/install.sh stage "$2" ;;   # after c01: wheels the kit lacks (bench/fetch_extra_wheels.sh), installed with it
      *gpu-model*) mkdir -p /tmp/model-stage && cp "$2"/qwen.gguf.part* /tmp/model-stage/ ;;
      *gpu-data*) mkdir -p /tmp/gpu-data && cp -r "$2"/. /tmp/gpu-data/ ;;
      *gpu-baseline*) mkdir -p "$W/baseline" && cp -r "$2"/. "$W/baseline/" ;;   # an earlier commit's alfrl/, for updateprof
      *gpu-adapters*) mkdir -p /tmp/adapter-stage && cp "${@:2}" /tmp/adapter-stage/ ;;  # stage PIECE [CONFIG SHA256]
      *gpu-cache*) mkdir -p "$W" && cat "$2"/*compile_cache.tgz.part* | tar -xz -C "$W" && touch "$W/cache.staged" ;;   # stage .gpu-cache (an earlier lease's d_compile_cache.tgz pieces)
      *gpu-resume*) local_dir=/tmp/resume-stage/$(basename "$(dirname "$2")")   # stage .gpu-resume/R/trainer.ckpt.partNN [R/step R/trainer.ckpt.sha256]
        mkdir -p "$local_dir" && cp "${@:2}" "$local_dir/" ;;
      *) echo "stage: give .gpu-kit/cNN, .gpu-extra, .gpu-model/mNN, .gpu-data, .gpu-baseline, .gpu-cache, .gpu-adapters/RUN/pieces/adapter.partNN [...] or .gpu-resume/RUN/..." >&2; exit 2 ;;
    esac && log "staged $2" ;;
  start)  # the job runs from a copy of the checkout: a later call's checkout (edited meanwhile) does not reach it
    rm -f "$W/done" "$W/stop" "$W/staged.done"; rm -rf "$W/repo" && mkdir -p "$W/repo" && tar -c --exclude=./.git --exclude='./.gpu-*' --exclude=./.venv --exclude=./.cache \
      --exclude=./runs . | tar -x -C "$W/repo" && cp "$0" "$W/lease.sh" || exit 1
    [ "$DRY" = 1 ] && ln -s "$REPO/.venv" "$W/repo/.venv"
    ALFRL_REPO=$W/repo ALFRL_GPU_WORK=$W ALFWORLD_DATA_DRY=$ALFWORLD_DATA_DRY ALFRL_TINY_MODEL=$ALFRL_TINY_MODEL LANES="$LANES" DRY=$DRY SFT_STEPS=${SFT_STEPS:-} EVALS="${EVALS:-}" FITS="${FITS:-}" ARM="${ARM:-}" UPTO=${UPTO:-} UPDATEPROF_VARIANTS="${UPDATEPROF_VARIANTS:-}" EVAL_RESERVE_S=${EVAL_RESERVE_S:-300} UNTIL=$(( $(date +%s) + ${UNTIL_S:-1380} )) \
      setsid nohup bash "$W/lease.sh" _run > "$W/logs/job.log" 2>&1 < /dev/null &
    log "started: $LANES" ;;
  _run)
    # a second `start` on a machine already set up (its wheels installed, the model converted) runs only the lanes
    if { [ -f "$W/setup.done" ] || { setup && touch "$W/setup.done"; }; } && await_staged; then for lane in $LANES; do
      case $lane in learn:*) set_arm "${lane#learn:}"; lane=learn ;; learn) set_arm "$ARM0" ;; esac
      "$lane" || log "$lane failed"
    done; fi
    touch "$W/done"; log "done" ;;
  stop)  # the running fit ends (SIGTERM: the update in flight, or its periodic evaluation, ends first and is saved); its lane ships that checkpoint
    touch "$W/stop"; pkill -TERM -f "[a]lfrl.cli fit" && log "stop: SIGTERM to the fit" ;;   # and no later learn lane starts
  staged) touch "$W/staged.done"; log "staged: every late piece is here" ;;   # with STAGED_LATE=1: the lanes may begin
  send) send "${2:-4}"; pack ;;
  wait)
    end=$(( $(date +%s) + ${2:-540} ))
    [ -f "$W/logs/job.log" ] || { echo "wait: nothing started on this machine (a fresh one?)" >&2; exit 1; }
    while [ "$(date +%s)" -lt "$end" ] && [ ! -f "$W/done" ]; do sleep 5; done
    send 4; pack; tail -n 20 "$W/logs/lease.log"; cat "$W/results/times.txt" 2>/dev/null
    progress
    [ -f "$W/done" ] && echo "all done" ;;
  *) sed -n 2,12p "$0"; exit 2 ;;
esac
