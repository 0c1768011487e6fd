#!/usr/bin/env bash
# One H200 session for the learning run (issue "Learning you can see") and the Sampler's and the
# weight sync's figures (issues "Fast rollouts", "The RL step is exactly right"), as background jobs so
# no step is bound by a call's limit.
#
# Calls, back to back (the device tool sends one chunk per call):
#   bash bench/gpu_campaign.sh stage .gpu-kit/c01            # ... c06 (c01 carries install.sh); .gpu-extra: Qwen3.5's GDN kernels
#   bash bench/gpu_campaign.sh stage .gpu-kit/c07 && bash bench/gpu_campaign.sh install   # the kit, in the background
#   bash bench/gpu_campaign.sh stage .gpu-model/m01          # ... m19
#   bash bench/gpu_campaign.sh stage .gpu-model/m20 && bash bench/gpu_campaign.sh start     # carry m20 and .gpu-data
#   bash bench/gpu_campaign.sh wait 540                      # again until it says "all done"; packs $OUT
#   bash bench/gpu_campaign.sh send rl 0; ... send rl 1; send sft 0; send sft 1   # the adapters (bf16, 5 pieces each), once RL ended
#   bash bench/gpu_campaign.sh bench && bash bench/gpu_campaign.sh wait 540 bench   # if time is left: the GPU alone
# Between calls the machine waits 30 s, then goes back with everything on it: decide before the first call. Keep a `wait`
# call going while reading what came back: a pause of over 30 s lost a running evaluation with its machine (2026-12-02).
# PLAN=figures (given to `start`) runs the figures lane instead of the learning run: every benchmark alone (the
# Sampler's, the update's variants, two `alfrl fit` steps, a staged adapter's 274-game evaluation with a profiled
# window, once as vLLM captures CUDA graphs by default and once with GRAPH_TOKENS=2048: 0 skips it), then the reference
# recipe on a random Qwen3.5-4B-structure checkpoint (one update) and its evaluation. BENCH_EXTRA adds recipe overrides
# to the Sampler's benchmark (e.g. --data.engine.cudagraph_max_tokens=2048); FIT_STEPS=0 skips the two `alfrl fit` steps.
# The seventh lease (2026-12-01) ran out during the Qwen3.5 update: with the second evaluation the lane needs more than
# one lease; order what matters first (Q35_FIRST=1 runs the Qwen3.5 part first; GRAPH_TOKENS=0, FIT_STEPS=0, FIG_BENCH=0
# shorten it, Q35_PART=0 leaves the Qwen3.5 part out; ROLLOUT_PAIR=1 adds the rollout with vLLM's default graphs and the recipe's, last). With Q35_FIRST=1
# `start` needs no model piece: stage the kit, .gpu-extra, the adapter, then `start` (carry .gpu-data), then m01..m20
# while the Qwen3.5 part runs (the 1.5B part waits for the 20th piece).
# The compilers' caches come back with `caches 0`, `caches 1`, ... (4 pieces a call); here `cache-pieces DIR` lays
# them out as .gpu-cache/k01.., staged before a later lease's `start`, which restores them.
# An adapter brought back from an earlier lease (.gpu-adapter/p1, p2: pieces of a tar of a/ with the
# adapter's two files), evaluated beside the rest (stage before `start`):
#   bash bench/gpu_campaign.sh stage .gpu-adapter/p1; bash bench/gpu_campaign.sh stage .gpu-adapter/p2
#   bash bench/gpu_campaign.sh eval-adapter rl10      # -> runs/rl10.jsonl once the model is converted
# An RL run continued from its checkpoint brought back with `pieces` (issue "Learning you can see": --ckpt_path across
# leases). Here, before the lease: bash bench/gpu_campaign.sh resume-pieces DIR/step-000010 (-> .gpu-resume/r01..r08);
# on the device, before `start`: stage .gpu-resume/r01 ... r08; then RESUME=1 RL_STEPS=<updates in all> ... start:
# no warm start, no SFT evaluation; the run goes on from the checkpoint's step, then its adapter's evaluation alone.
#
# The learning job, after the GGUF became a Hugging Face folder:
#   base:  the base model's 274-game evaluation (0.22 of the GPU, at most 70 games at once) beside
#   sft:   alfrl sft on the expert plans (.gpu-data/expert_qwen15b_all.jsonl.gz, every training game); then
#   rl:    alfrl fit from the SFT adapter (as many updates as the deadline allows, every one saved)
#          beside the SFT adapter's evaluation (as the base's); then the RL adapter's evaluation
#          (0.5 of the GPU, every game at once), then alfrl report (paired tests, curves).
# The bench job (alone on the GPU): bench/sampler_bench.py, the sync's gaps, responses and decode speed,
# LoRA-served then merged; then the engine ceiling, round vs async rollouts and the update's MFU.
#
# Qwen3.5 (2026-12-02: NaN after a wake-up with CUDA graphs, piecewise ones and no prefix caching too; without sleep mode an
# illegal memory access): its recipes run eager, and the full eager step, its checkpoint's evaluation and the first probe ran
# in the fifth lease (bench/README.md; ~1,000 s of device time in all). Again, after the kit and .gpu-extra are staged:
#   PLAN=figures Q35_FIRST=1 FIG_BENCH=0 FIT_STEPS=0 GRAPH_TOKENS=0 PROBE_AFTER=1 bash bench/gpu_campaign.sh start   # carry .gpu-data
#   bash bench/gpu_campaign.sh wait 540 q35; ... bash bench/gpu_campaign.sh wait 400 probe
# bench/stale_memory_probe.py alone (does the engine read memory it freed? ~60 s a run once installed): `probe`, then
# `wait 400 probe` -> results/stale_probe0.json (CUDA graphs, no sleep mode), 1 (graphs, sleep mode), 2 (eager), each decoding
# 4 turns of 300 tokens over its cached prefix first (PROBE=sleep runs bench/sleep_probe.py instead; PROBE_VARIANTS="ARGS;ARGS"
# sets the runs, one process each; PROBE_LAYERS=0 probes the whole 4B checkpoint instead of 4 layers).
#
# The Qwen3.5 part again with other engine settings (after `start`): Q35_EXTRA="--data.engine.enforce_eager true" bash
# bench/gpu_campaign.sh q35; bash bench/gpu_campaign.sh wait 540 q35 (each earlier fit's logs kept as *_tryN.log).
# DRY=1 runs the same script on a CPU with the tiny model (HF engine, 2 games per split) to check it.
set -uo pipefail
cd "${ALFRL_REPO:-$(dirname "$0")/..}"
REPO=$PWD
W=${ALFRL_GPU_WORK:-/tmp/alfrl}
OUT=${OUT:-$W/out}
DRY=${DRY:-0}
BUDGET_S=${BUDGET_S:-1500}          # seconds from the first call to the end of all work
PLAN=${PLAN:-learn}                 # learn: the learning run (+ `bench` after it); figures: every benchmark alone, one after another
mkdir -p "$W/logs" "$W/results" "$OUT"
export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RUN=$W/runs
if [ "$DRY" != 1 ]; then
  # the compilers' caches in one folder, so `caches` can bring them back and a later lease's `start` restore them
  # (2026-12-01, Qwen3.5 on a fresh machine: torch.compile 63 s and a 89 s warm-up in the engine's start, then ~99 s of
  # flash-linear-attention autotuning in the first update; vLLM keeps Triton's autotuning results on disk)
  export TRITON_CACHE_DIR=$W/cache/triton VLLM_CACHE_ROOT=$W/cache/vllm TORCHINDUCTOR_CACHE_DIR=$W/cache/inductor
fi
if [ "$DRY" = 1 ]; then
  export ALFWORLD_DATA=${ALFWORLD_DATA:-$REPO/.cache/alfworld}
  PY=${PY:-$REPO/.venv/bin/python}
  RL=recipes/tiny.yaml; SFT=recipes/sft_tiny.yaml
  MODEL=(--model.model_name "${ALFRL_TINY_MODEL:-$REPO/.cache/tiny-model}")
  EXPERT=${EXPERT:-$REPO/runs/tiny-expert.jsonl}
  SYNC=(--games 1 --dry --phases sync -- --data.engine.separate_weights=true --data.env.num_workers=2 --trainer.logger=false
        "--model.model_name=${ALFRL_TINY_MODEL:-$REPO/.cache/tiny-model}")
  BENCH=(--games 2 --dry --phases runners update -- --data.engine.separate_weights=true --data.env.num_workers=2 --trainer.logger=false
         "--model.model_name=${ALFRL_TINY_MODEL:-$REPO/.cache/tiny-model}")
  MERGED=(--games 1 --dry --phases sync -- --data.engine.weight_sync=merged --data.engine.separate_weights=true --data.env.num_workers=2
          --trainer.logger=false "--model.model_name=${ALFRL_TINY_MODEL:-$REPO/.cache/tiny-model}")
  BENCH_OVERRIDES=(-- --data.engine.separate_weights=true --data.env.num_workers=2 --trainer.logger=false
                   "--model.model_name=${ALFRL_TINY_MODEL:-$REPO/.cache/tiny-model}")
  TRAIN=(--data.env.num_workers 2 --data.games_per_batch 2)
  EVAL_SIDE=(--data.env.num_workers 2 --limit-per-split 2 --data.eval.max_live_games 1)
  EVAL_ALONE=(--data.env.num_workers 2 --limit-per-split 2)
  PROFILE_DEFAULT=3:4
  EVAL_BENCH=(--dry -- --data.env.num_workers=2 --data.eval.limit_per_split=2 --trainer.logger=false "--model.model_name=${ALFRL_TINY_MODEL:-$REPO/.cache/tiny-model}")
  SFT_ARGS=(--trainer.max_steps 4); MAX_STEPS=2; STEP_S=40; EVAL_S=60
  Q35_MODEL=.cache/random-qwen3.5-small; Q35_SHAPE=qwen3.5-small
  Q35_ARGS=(--data.engine.kind hf --data.engine.separate_weights true --trainer.accelerator cpu --data.games_per_batch 1 --data.group_size 2
            --data.rollout.max_episode_steps 2 --data.env.num_workers 2)
  Q35_EVAL=(--data.engine.kind hf --trainer.accelerator cpu --data.eval.max_episode_steps 2 --data.env.num_workers 2)
  T_BENCH=600; T_MERGED=300; T_EVAL=300; T_Q35=600; T_Q35_EVAL=300; T_FIT=600
  FIT_ARGS=(--trainer.accelerator cpu --data.env.num_workers 2 --data.games_per_batch 2)
else
  export ALFWORLD_DATA=$REPO/.cache/alfworld
  PY=${PY:-python3}
  RL=recipes/qwen15b_coder_h200.yaml; SFT=recipes/sft_qwen15b.yaml
  MODEL=()
  EXPERT=$W/expert_qwen15b.jsonl       # from .gpu-data/${EXPERT_GZ:-expert_qwen15b_all.jsonl.gz}
  SYNC=(--games 2 --phases sync -- --data.engine.gpu_memory_utilization=0.4 --data.env.num_workers=4 --trainer.logger=false)
  MERGED=(--games 2 --phases sync -- --data.engine.weight_sync=merged --data.engine.separate_process=false --data.engine.gpu_memory_utilization=0.4 --data.env.num_workers=4 --trainer.logger=false)
  GRAPHS=--data.engine.enforce_eager=false   # evaluations and benchmarks with CUDA graphs (the recipe's setting again since 2026-12-03a)
  BENCH=(--phases ceiling runners update -- $GRAPHS --data.engine.gpu_memory_utilization=0.4 --data.env.num_workers=16 --trainer.logger=false)
  BENCH_OVERRIDES=(-- $GRAPHS --data.engine.gpu_memory_utilization=0.4 --data.env.num_workers=16 --trainer.logger=false)
  # 64 trajectories of at most 8,192 tokens need 15 GiB of KV cache (28 KiB per token): 0.2 of the GPU holds them
  # kv_cache_gib: engines started beside other GPU processes get a fixed KV cache instead of a profiled one
  # (2026-12-01: an evaluation started beside the RL run profiled a cache too small for its games and thrashed)
  TRAIN=(--data.env.num_workers 8 --data.engine.gpu_memory_utilization 0.2 --data.engine.kv_cache_gib 16)
  # beside training: at most 70 games at once (70 x 12,000 tokens fit in 0.22 of the GPU); all 274 at 0.3 thrashed (2026-12-01)
  EVAL_SIDE=($GRAPHS --data.env.num_workers 6 --data.engine.gpu_memory_utilization 0.22 --data.engine.kv_cache_gib 24 --data.eval.max_live_games 70)
  # alone: 0.75 of the GPU holds ~3.5 M tokens of KV cache (28 KiB each), 274 x 12,000 = 3.3 M at most
  EVAL_ALONE=($GRAPHS --data.env.num_workers 16 --data.engine.gpu_memory_utilization 0.75)
  PROFILE_DEFAULT=1000:40   # the eval's 3,292 steps (2026-12-01): steps 1,000-1,079 are mid-run, ~150 games live
  EVAL_BENCH=(-- $GRAPHS --data.env.num_workers=16 --data.engine.gpu_memory_utilization=0.75 --trainer.logger=false)
  # SFT_STEPS: the warm start's updates of 64K tokens instead of the recipe's 30 (7.3 s each on the H200, 2026-12-01;
  # a pass over every training game's walkthroughs is ~105 steps); with every game's walkthroughs, 0.05 held out
  # would be ~180 trajectories scored at every check: 0.02 (the recipe's), checked twice
  SFT_ARGS=(${SFT_STEPS:+--trainer.max_steps "$SFT_STEPS" --trainer.val_check_interval $(( SFT_STEPS / 2 )) --data.validation_fraction 0.02})
  MAX_STEPS=20; STEP_S=45; EVAL_S=${EVAL_S:-240}
  # the figures lane: the reference recipe on a random Qwen3.5-4B-structure checkpoint (random weights never
  # stop on their own: completions run to a fixed 100 tokens, so trajectories reach the 12,000-token budget)
  Q35_MODEL=.cache/random-qwen3.5-4b; Q35_SHAPE=qwen3.5-4b
  Q35_ARGS=(--trainer.accelerator gpu); Q35_EVAL=(--trainer.accelerator gpu)
  T_BENCH=${T_BENCH:-900}; T_MERGED=240; T_EVAL=420; T_Q35=${T_Q35:-1200}; T_Q35_EVAL=${T_Q35_EVAL:-420}; T_FIT=${T_FIT:-420}
  FIT_ARGS=(--trainer.accelerator gpu --data.env.num_workers 16 --data.engine.gpu_memory_utilization 0.4)
fi
Q35=recipes/qwen4b_80step.yaml

ALFRL=("$PY" -m alfrl.cli)
RL_LR=${RL_LR:-2.0e-5}                 # 1e-5 (the recipe's): no trend in 9 updates (fourth lease); 2e-5: +4.01 points in 10 (fifth, results/qwen15b_warmstart)
# the invalid-action penalty of the RL run from the warm start: 0.1 (the reference's) made the 1.5B model walk
# between receptacles instead of doing the task (results/qwen15b_warmstart/README.md), so 0.02: a win (+1) outweighs it
RL_INVALID_PENALTY=${RL_INVALID_PENALTY:-0.02}
[ -f "$W/t0" ] || date +%s > "$W/t0"
T0=$(cat "$W/t0")
DEADLINE=$((T0 + BUDGET_S))

log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$W/logs/campaign.log"; }
timed() {  # timed NAME CMD...: run it, its output in logs/NAME.log, its wall seconds in results/times.txt
  local name=$1; shift
  local s; s=$(date +%s)
  log "start $name"
  "$@" > "$W/logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$(( $(date +%s) - s )) start=+$(( s - T0 ))s" >> "$W/results/times.txt"
  log "end $name rc=$rc ($(( $(date +%s) - s ))s)"
  return $rc
}
eval_run() {  # eval_run NAME side|alone [--adapter DIR]
  local name=$1 how=$2; shift 2
  local -n how_args=$([ "$how" = side ] && echo EVAL_SIDE || echo EVAL_ALONE)
  timed "eval_$name" timeout "${EVAL_TIMEOUT:-7200}" "${ALFRL[@]}" eval --config $RL "${MODEL[@]}" "${how_args[@]}" --trainer.accelerator "$ACCEL" --out "$RUN/$name.jsonl" "$@"
}
ACCEL=$([ "$DRY" = 1 ] && echo cpu || echo gpu)

bench_lane() {  # alone on the GPU: the two sync modes side by side first, then the Sampler's speed
  timed bench_sync_lora "$PY" bench/sampler_bench.py --recipe $RL --out "$W/results/sampler_bench_sync_lora.json" "${SYNC[@]}"
  timed bench_sync_merged "$PY" bench/sampler_bench.py --recipe $RL --out "$W/results/sampler_bench_sync_merged.json" "${MERGED[@]}"
  timed bench "$PY" bench/sampler_bench.py --recipe $RL --out "$W/results/sampler_bench.json" "${BENCH[@]}"
}

figures_lane() {  # every figure alone on the GPU, one after another; a phase that fails or overruns does not stop the next
  # Q35_FIRST=1: the Qwen3.5 part first (the seventh lease ran out during it, after the 1.5B figures)
  if [ "${Q35_FIRST:-0}" = 1 ]; then q35_figures; figures_15b; else figures_15b; [ "${Q35_PART:-1}" = 0 ] || q35_figures; fi
}

model_15b() {  # the staged GGUF (MODEL_PARTS pieces, staged before `start` or while the Qwen3.5 part runs) -> a Hugging Face folder
  while [ "$(ls /tmp/model-stage/qwen.gguf.part* 2>/dev/null | wc -l)" -lt "${MODEL_PARTS:-20}" ]; do sleep 2; done
  sleep 2   # the last piece's copy has ended (its call returned) before the next check
  mkdir -p .cache/qwen15b-coder
  cat /tmp/model-stage/qwen.gguf.part* > .cache/qwen15b-coder/qwen.gguf
  local sha; sha=$(sha256sum .cache/qwen15b-coder/qwen.gguf | cut -d' ' -f1)
  [ "$sha" = cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 ] || { log "GGUF checksum mismatch: $sha"; touch "$W/model.failed"; return 1; }
  timed convert_gguf "${ALFRL[@]}" convert-gguf .cache/qwen15b-coder --gguf-file qwen.gguf --out .cache/qwen15b-coder-hf || { touch "$W/model.failed"; return 1; }
  gunzip -c "/tmp/gpu-data/${EXPERT_GZ:-expert_qwen15b_all.jsonl.gz}" > "$EXPERT"
  touch "$W/model.done"
}

figures_15b() {  # the Sampler, the update's variants, the recipe's step, a staged adapter's evaluation (Qwen2.5-1.5B)
  while [ ! -f "$W/model.done" ]; do [ -f "$W/model.failed" ] && { log "no 1.5B model: its figures skipped"; return 1; }; sleep 2; done
  local fig_bench=(--phases ceiling runners replay update --profile-update --profile-rollout 1000:40 "${BENCH_OVERRIDES[@]}" ${BENCH_EXTRA:-})   # BENCH_EXTRA: recipe overrides
  [ "$DRY" = 1 ] && fig_bench=(--games 2 --dry --phases runners update --profile-update --profile-rollout 3:4 "${BENCH_OVERRIDES[@]}")
  [ "${FIG_BENCH:-1}" = 1 ] && timed bench_lora timeout $T_BENCH "$PY" bench/sampler_bench.py --recipe $RL --out "$W/results/sampler_bench_lora.json" "${fig_bench[@]}"
  [ "${MERGED_BENCH:-0}" = 1 ] && timed bench_merged timeout $T_MERGED "$PY" bench/sampler_bench.py --recipe $RL --out "$W/results/sampler_bench_merged.json" "${MERGED[@]}"
  # the 1.5B recipe's step measured as `alfrl fit` runs it (rollout, update, sync), alone: 2 updates, timings in its CSV
  # (more overrides for it: FIT_EXTRA, or $W/fit_extra, read when the fit starts: written by a call while the benchmark runs)
  [ "${FIT_STEPS:-2}" -gt 0 ] && timed fit_15b timeout $T_FIT "${ALFRL[@]}" fit --config $RL "${MODEL[@]}" "${FIT_ARGS[@]}" \
    --trainer.max_steps "${FIT_STEPS:-2}" --trainer.default_root_dir "$RUN/fit_15b" --checkpoint.save_every 0 --progress_bar.refresh_rate 0 \
    ${FIT_EXTRA:-} $(cat "$W/fit_extra" 2>/dev/null)
  # a brought-back adapter's 274-game evaluation alone (the Sampler's evaluate, as `alfrl eval`), a window of its
  # engine steps profiled (torch.profiler, then cProfile): where an engine step's time goes
  if ls /tmp/adapter-stage/*.part* > /dev/null 2>&1; then
    mkdir -p "$RUN/adapter" && cat /tmp/adapter-stage/*.part* | tar -xf - -C "$RUN/adapter" || return 1
    # GRAPH_FIRST=1: the CUDA-graph variant first (what a short lease must not miss), vLLM's default second
    if [ "${GRAPH_FIRST:-0}" = 1 ]; then eval_graphs; eval_default; else eval_default; eval_graphs; fi
  fi
  [ "${ROLLOUT_PAIR:-0}" = 1 ] && rollout_pair
}

rollout_pair() {  # ROLLOUT_PAIR=1: the engine alone and the asynchronous Sampler (8 x 8 x 20, seed 7) with vLLM's default CUDA
  # graphs, then with the recipe's (2,048 tokens since 2026-12-02), one process each
  local pair=(--phases ceiling runners replay --schedules async "${BENCH_OVERRIDES[@]}")
  [ "$DRY" = 1 ] && pair=(--games 2 --dry --phases runners --schedules async "${BENCH_OVERRIDES[@]}")
  timed rollout_default timeout $T_BENCH "$PY" bench/sampler_bench.py --recipe $RL --out "$W/results/rollout_default.json" "${pair[@]}" \
    --data.engine.cudagraph_max_tokens=null
  timed rollout_graphs timeout $T_BENCH "$PY" bench/sampler_bench.py --recipe $RL --out "$W/results/rollout_graphs.json" "${pair[@]}"
}

eval_default() {  # a brought-back adapter's 274-game evaluation alone with vLLM's default CUDA graphs (the 1.5B recipes say
  # 2,048 since 2026-12-02)
  adapter_eval eval_adapter --data.engine.cudagraph_max_tokens=null
}

eval_graphs() {  # the same evaluation with engine steps of up to GRAPH_TOKENS tokens replayed as CUDA graphs (vLLM's default:
  # 512; 2026-12-01: most evaluation steps were larger and ran op by op, the GPU busy 21% of the time); 0 skips it.
  # EVAL_EXTRA: more overrides for this one, e.g. --data.engine.max_num_batched_tokens=2048 (no step larger than its graphs:
  # 2026-12-02, 12 of the 40 profiled steps still ran op by op with graphs up to 2,048 tokens)
  [ "${GRAPH_TOKENS:-2048}" -gt 0 ] || return 0
  adapter_eval eval_adapter_graphs "--data.engine.cudagraph_max_tokens=${GRAPH_TOKENS:-2048}" ${EVAL_EXTRA:-}
}

adapter_eval() {  # adapter_eval NAME OVERRIDES...: the staged adapter's 274-game evaluation (the Sampler's evaluate, as `alfrl
  # eval`) alone, a window of its engine steps profiled (torch.profiler, then cProfile): where an engine step's time goes
  local name=$1; shift
  timed "$name" timeout $T_EVAL "$PY" bench/sampler_bench.py --recipe $RL --out "$W/results/$name.json" \
    --eval-out "$RUN/${name/eval_adapter/adapter_eval}.jsonl" --phases eval --adapter "$RUN/adapter/a" \
    --profile-steps "${PROFILE_STEPS:-$PROFILE_DEFAULT}" "${EVAL_BENCH[@]}" "$@"
}

restore_caches() {  # an earlier lease's compiler caches (`caches`, staged from .gpu-cache), checked, once per machine
  ls /tmp/cache-stage/caches.tgz.part* > /dev/null 2>&1 && [ ! -f "$W/cache.restored" ] || return 0
  if [ "$(cat /tmp/cache-stage/caches.tgz.part* | sha256sum | cut -d' ' -f1)" = "$(cat /tmp/cache-stage/caches.tgz.sha256)" ]; then
    mkdir -p "$W/cache" && cat /tmp/cache-stage/caches.tgz.part* | tar -xzf - -C "$W/cache" && touch "$W/cache.restored" \
      && log "compiler caches restored ($(du -sh "$W/cache" | cut -f1))"
  else log "compiler caches not restored: checksum mismatch (stage every .gpu-cache folder)"; fi
}

q35_recipe() {  # the reference recipe as it is, its loggers CSV only: SwanLab is not in the offline kit, and a recipe naming a
  # logger class that cannot be imported fails before any --trainer.logger override applies (2026-12-01)
  while [ ! -f "$W/q35model.done" ]; do sleep 2; done
  "$PY" -c "import sys, yaml; d = yaml.safe_load(open('$Q35')); d['trainer']['logger'] = [{'class_path': 'lightning.pytorch.loggers.CSVLogger',
    'init_args': {'save_dir': '\${trainer.default_root_dir}', 'name': 'csv'}}]; yaml.safe_dump(d, open('$W/q35.yaml', 'w'), sort_keys=False)"
}

q35_fit_run() {  # q35_fit_run NAME ROOT [OVERRIDES...]: one update of the reference recipe on the random checkpoint
  local name=$1 root=$2; shift 2
  timed "$name" timeout $T_Q35 "${ALFRL[@]}" fit --config "$W/q35.yaml" --model.model_name $Q35_MODEL "${Q35_ARGS[@]}" --trainer.max_steps 1 \
    --trainer.default_root_dir "$root" --data.rollout.max_assistant_tokens 100 \
    --weight_sync.canary_at_step 1 --checkpoint.save_every 1 --progress_bar.refresh_rate 0 "$@"
}

q35_figures() {  # the reference recipe on the random Qwen3.5-4B-structure checkpoint: one update, then its evaluation
  q35_recipe
  local try q35_extra
  # Q35_EXTRA: more recipe overrides for the fit and its evaluation, e.g. "--data.engine.cudagraph_mode piecewise"
  read -ra q35_extra <<< "${Q35_EXTRA:-}"
  for try in 1 2; do
    # reward noise (Q35_REWARD_NOISE, default 0.5): random weights give every trajectory of a group the same reward, so
    # without it nothing trains and the canary has nothing to catch (2026-12-02: 8 of 8 groups equal in a 10-step rollout)
    q35_fit_run q35_fit "$RUN/q35" --data.reward.noise "${Q35_REWARD_NOISE:-0.5}" "${q35_extra[@]}" && break
    # 2026-12-02: 1 of 3 engine starts of this checkpoint on a fresh H200 died at the first prefill with a CUDA illegal
    # instruction (a process cannot go on after one); started again once, the first log kept
    grep -q "illegal instruction" "$W/logs/q35_fit.log" && [ "$try" = 1 ] || break
    mv "$W/logs/q35_fit.log" "$W/logs/q35_fit_illegal_instruction.log"; rm -rf "$RUN/q35"; log "q35_fit: CUDA illegal instruction, started again"
  done
  # a few games, Q35_EVAL_STEPS (default 5) environment steps each: eager decoding of 4 sequences ran at 30-45 tokens/s
  timed q35_eval timeout $T_Q35_EVAL "${ALFRL[@]}" eval --config "$W/q35.yaml" --model.model_name $Q35_MODEL "${Q35_EVAL[@]}" --limit-per-split 2 \
    --data.eval.max_assistant_tokens 100 --data.eval.max_episode_steps "${Q35_EVAL_STEPS:-5}" --adapter "$RUN/q35/checkpoints/last" \
    --out "$RUN/q35_eval.jsonl" "${q35_extra[@]}"
  touch "$W/q35.done"   # `wait N q35` ends here (the 1.5B part of `start` may still wait for its model)
  [ "${PROBE_AFTER:-0}" = 1 ] && probe_lane   # PROBE_AFTER=1: then bench/stale_memory_probe.py (`wait N probe`)
}

probe_lane() {  # PROBE=stale (bench/stale_memory_probe.py, the default) or sleep (bench/sleep_probe.py) on a 4-layer Qwen3.5-4B,
  # one process per variant of PROBE_VARIANTS ("ARGS;ARGS"; default for stale: CUDA graphs without, then with sleep mode, then
  # --eager; for sleep: --adapter); results/<PROBE>_probe<i>.json
  local p=${PROBE:-stale} script=bench/stale_memory_probe.py default="--no-sleep-mode --decode 300 --turns 4;--decode 300 --turns 4;--eager --decode 300 --turns 4" v a i=0
  [ "$p" = sleep ] && { script=bench/sleep_probe.py; default=--adapter; }
  # PROBE_LAYERS (default 4): the checkpoint's text layers; 0 = the whole random Qwen3.5-4B ($Q35_MODEL: the 4-layer one never
  # reproduced the NaN or the fault, 2026-12-02; its engine's first start compiles for ~200 s)
  local layers=${PROBE_LAYERS:-4}; local model="$W/q35-${layers}layers" depth=(--layers "$layers")
  [ "$layers" = 0 ] && { model=$Q35_MODEL; depth=(); }
  [ -d "$model" ] || timed "random_q35_${layers}layers" "${ALFRL[@]}" random-model --shape "$Q35_SHAPE" "${depth[@]}" --out "$model" || return 1
  IFS=';' read -ra variants <<< "${PROBE_VARIANTS-$default}"
  for v in "${variants[@]}"; do
    read -ra a <<< "$v"; [ "$DRY" = 1 ] && a+=(--dry --probe-tokens 50 --decode 2)
    timed "${p}_probe$i" timeout 600 "$PY" "$script" --model "$model" --out "$W/results/${p}_probe$i.json" "${a[@]}"
    i=$((i + 1))
  done
  touch "$W/probe.done"; log "probe done"
}

rl_fit() {  # rl_fit STEPS MAX_SECONDS [ARGS...]: the RL run into $RUN/rl, a checkpoint after every update
  local steps=$1 max_s=$2; shift 2
  timed rl env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "${ALFRL[@]}" fit --config $RL "${MODEL[@]}" "${TRAIN[@]}" --trainer.accelerator "$ACCEL" \
    --model.optim.lr "$RL_LR" --data.reward.invalid_penalty "$RL_INVALID_PENALTY" --trainer.default_root_dir "$RUN/rl" --trainer.max_steps "$steps" \
    --trainer.max_time "$(printf '00:%02d:%02d:%02d' $((max_s / 3600)) $((max_s % 3600 / 60)) $((max_s % 60)))" \
    --checkpoint.save_every 1 --progress_bar.refresh_rate 0 "$@"
}

learn_lane() {
  # BASE_EVAL=0: the base model's evaluation is known (0/274 on 2026-12-01, results/qwen15b_warmstart) and its GPU time is spared
  [ "${BASE_EVAL:-1}" = 1 ] && { ( eval_run base side; touch "$W/base.done" ) & }
  timed sft env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "${ALFRL[@]}" sft --config $SFT "${MODEL[@]}" --data.expert_file "$EXPERT" --trainer.default_root_dir "$RUN/sft" \
    --trainer.accelerator "$ACCEL" --progress_bar.refresh_rate 0 "${SFT_ARGS[@]}" || { wait; return 1; }
  adapter_pieces sft &   # bf16 pieces of the warm start, ready to be sent back from now on
  ( eval_run sft side --adapter "$RUN/sft/checkpoints/last"; touch "$W/sft_eval.done" ) &
  local left=$(( DEADLINE - $(date +%s) - EVAL_S ))   # keep time for the last evaluation
  local steps=$(( left / STEP_S )); [ $steps -gt $MAX_STEPS ] && steps=$MAX_STEPS; [ $steps -lt 1 ] && steps=1
  [ -n "${RL_STEPS:-}" ] && steps=$RL_STEPS   # a fixed count (the deadline's max_time still stops it)
  log "RL: $steps updates (max_time $left s)"
  rl_fit "$steps" "$left" --model.init_adapter "$RUN/sft/checkpoints/last"
  adapter_pieces rl   # ready to be brought back (`send`) whatever happens to the last evaluation
  wait   # the base and SFT evaluations: the last one gets the GPU's memory
  eval_run rl alone --adapter "$RUN/rl/checkpoints/last"
  report
}

resume_lane() {  # RESUME=1: the RL run goes on from the staged checkpoint (no warm start, no SFT evaluation)
  local steps=${RL_STEPS:?RESUME=1 needs RL_STEPS: the number of updates in all, counted from the first update}
  local done_s; done_s=$(cut -d' ' -f1 "$RUN/resume/elapsed_step")
  local left=$(( DEADLINE - $(date +%s) - EVAL_S ))   # max_time counts the checkpoint's trained seconds too
  local total=$(( left + done_s ))
  log "RL resumed at step $(cut -d' ' -f2 "$RUN/resume/elapsed_step") ($done_s s trained): up to $steps updates in all ($left s here)"
  rl_fit "$steps" "$total" --ckpt_path "$RUN/resume/trainer.ckpt"
  adapter_pieces rl
  eval_run rl alone --adapter "$RUN/rl/checkpoints/last"
  report
}

report() {
  local runs=() names=()
  for n in base sft rl; do [ -f "$RUN/$n.jsonl" ] && { runs+=("$RUN/$n.jsonl"); names+=("$n"); }; done
  timed report "${ALFRL[@]}" report "${runs[@]}" --names "${names[@]}" --out "$W/results/report" --train-log "$RUN/rl" --html
}

pack() {  # results (small) and the trajectories (gzipped) into $OUT
  local p d v f
  cp "$W/logs/campaign.log" "$W/results/" 2>/dev/null
  for p in "$RUN"/{sft,rl,fit_15b,q35,q35_try*}; do d=$(basename "$p")
    for v in "$p"/csv/version_*; do [ -f "$v/metrics.csv" ] && cp "$v/metrics.csv" "$W/results/${d}_metrics_$(basename "$v").csv"; done; done
  tar -czf "$OUT/results.tgz" -C "$W" results logs 2>/dev/null
  for f in "$RUN"/*.jsonl; do [ -f "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
  ls -la "$OUT"
}

adapter_pieces() {  # adapter_pieces RUN_NAME: its last adapter in bf16 (half the fp32 checkpoint's bytes), tarred as a/, in 15 MiB pieces
  local d="$RUN/$1/checkpoints" p="$W/send_$1"
  [ -f "$d/last" ] || { log "no checkpoint of $1 to send"; return 1; }
  rm -rf "$p" && mkdir -p "$p/a" && cp "$d/$(cat "$d/last")/adapter/adapter_config.json" "$p/a/" || return 1
  "$PY" -c "import sys, torch; from safetensors.torch import load_file, save_file
t = load_file(sys.argv[1]); save_file({k: v.to(torch.bfloat16) for k, v in t.items()}, sys.argv[2])" \
    "$d/$(cat "$d/last")/adapter/adapter_model.safetensors" "$p/a/adapter_model.safetensors" || return 1
  tar -cf - -C "$p" a | split -b 15M -d -a 2 - "$p/$1_adapter.tar.part" && rm -rf "$p/a"
  (cd "$p" && sha256sum ./*.part* > "$1_adapter.sha256")
  log "adapter of $1 ($(cat "$d/last")) in $(ls "$p"/*.part* | wc -l) pieces: send $1 0, send $1 1, ..."
}

four_pieces() {  # four_pieces DIR K: pieces 4K..4K+3 of DIR into $OUT (8 files and 64 MiB come back per call)
  ls "$1"/*.part* | sed -n "$(( $2 * 4 + 1 )),$(( $2 * 4 + 4 ))p" | xargs -r -I{} cp {} "$OUT/"
}

send() {  # send RUN_NAME K: pieces 4K..4K+3 of adapter_pieces (and the checksums) into $OUT; run alone in its call
  four_pieces "$W/send_$1" "$2" && cp "$W/send_$1/$1_adapter.sha256" "$OUT/"; ls "$OUT"
}

pieces() {  # pieces RUN_NAME K: the run's last checkpoint (adapter + trainer.ckpt) in 15 MiB pieces, 4 per call (K = 0, 1, ...)
  local d="$RUN/$1/checkpoints" last
  last=$(cat "$d/last")
  [ -f "$W/$1.tar" ] || tar -cf "$W/$1.tar" -C "$d" last "$last"
  mkdir -p "$W/pieces_$1" && [ -f "$W/pieces_$1/done" ] || { split -b 15M -d -a 2 "$W/$1.tar" "$W/pieces_$1/$1.tar.part"
    sha256sum < "$W/$1.tar" | cut -d' ' -f1 > "$W/pieces_$1/$1.tar.sha256"; touch "$W/pieces_$1/done"; }
  four_pieces "$W/pieces_$1" "$2" && cp "$W/pieces_$1/$1.tar.sha256" "$OUT/"   # here: cat $1.tar.part* | sha256sum
  echo "$(ls "$W/pieces_$1"/*.part* | wc -l) pieces of $1 ($last); sent $(ls "$OUT" | tr '\n' ' ')"
}

case "${1:-}" in
  stage)
    if [[ "$2" == *gpu-model* ]]; then mkdir -p /tmp/model-stage && cp "$2"/qwen.gguf.part* /tmp/model-stage/ && log "staged $2"
    elif [[ "$2" == *gpu-adapter* ]]; then mkdir -p /tmp/adapter-stage && cp "$2"/*.part* /tmp/adapter-stage/ && log "staged $2"
    elif [[ "$2" == *gpu-cache* ]]; then mkdir -p /tmp/cache-stage && cp "$2"/* /tmp/cache-stage/ && log "staged $2"
    elif [[ "$2" == *gpu-resume* ]]; then mkdir -p /tmp/resume-stage && cp "$2"/* /tmp/resume-stage/ && log "staged $2"
    else bash bench/gpu_session.sh stage "$2" && log "staged $2"; fi ;;
  install)  # in the background: the kit into /tmp/site; needs every kit chunk (a machine that lacks c01 says so and stops here)
    [ -f /tmp/wheel-stage/install.sh ] || { log "install: no kit staged on this machine (a fresh one?): stage .gpu-kit/c01 ... c07 again"; exit 1; }
    cp "$0" "$W/campaign.sh"; ALFRL_REPO=$REPO setsid nohup bash "$W/campaign.sh" _install > "$W/logs/install.log" 2>&1 < /dev/null &
    log "install started" ;;
  _install)
    s=$(date +%s)
    bash /tmp/wheel-stage/install.sh install /tmp/site 2>&1 | tail -2
    "$PY" -c "import vllm, textworld, alfworld, jsonargparse, omegaconf; print('vllm', vllm.__version__)" || { log "install failed"; touch "$W/install.failed"; exit 1; }
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"; } | tee "$W/results/machine.txt"   # what changed between days
    echo "install rc=0 seconds=$(( $(date +%s) - s ))" >> "$W/results/times.txt"
    touch "$W/install.done"; log "install done" ;;
  probe)  # after install: probe_lane alone in the background; `wait N probe` brings its results and logs back
    cp "$0" "$W/campaign.sh"; ALFRL_REPO=$REPO setsid nohup bash "$W/campaign.sh" _probe > "$W/logs/probe_job.log" 2>&1 < /dev/null &
    log "${PROBE:-stale} probe started" ;;
  _probe)
    restore_caches
    [ "$DRY" = 1 ] || while [ ! -f "$W/install.done" ]; do sleep 2; done
    probe_lane ;;
  q35)  # after `start` ran the Qwen3.5 part: that part alone again (its first logs and run kept beside), e.g. with Q35_EXTRA
    cp "$0" "$W/campaign.sh"; rm -f "$W/q35.done"; ALFRL_REPO=$REPO setsid nohup bash "$W/campaign.sh" _q35 > "$W/logs/q35_job.log" 2>&1 < /dev/null &
    log "q35 started again" ;;
  _q35)
    n=$(ls -d "$RUN"/q35_try* 2>/dev/null | wc -l)
    [ -d "$RUN/q35" ] && mv "$RUN/q35" "$RUN/q35_try$n"
    for f in q35_fit q35_eval; do [ -f "$W/logs/$f.log" ] && mv "$W/logs/$f.log" "$W/logs/${f}_try$n.log"; done
    q35_figures; log "q35 done" ;;
  start)  # carry .gpu-data (the games archive, the expert trajectories): copied before the call ends; needs `install` run here
    [ "$DRY" = 1 ] || [ -f "$W/logs/install.log" ] || { log "start: no kit installed or installing on this machine: stage .gpu-kit/c01 ... c07, then install"; exit 1; }
    [ "$DRY" = 1 ] || { mkdir -p /tmp/gpu-data && cp -r .gpu-data/. /tmp/gpu-data/; }
    : > "$W/logs/start.log"; cp "$0" "$W/campaign.sh"   # the log exists when this returns: `run` in the same call checks it
    ALFRL_REPO=$REPO setsid nohup bash "$W/campaign.sh" _start >> "$W/logs/start.log" 2>&1 < /dev/null &
    log "started" ;;
  _start)
    restore_caches
    if [ "$DRY" != 1 ]; then
      while [ ! -f "$W/install.done" ]; do [ -f "$W/install.failed" ] && { touch "$W/model.failed"; exit 1; }; sleep 2; done
      "${ALFRL[@]}" data prepare --data-dir .cache/alfworld --archive /tmp/gpu-data/json_2.1.1.tar.xz || { touch "$W/model.failed"; exit 1; }
      [ "$PLAN" = figures ] && [ "${Q35_PART:-1}" = 1 ] && { timed random_q35 "${ALFRL[@]}" random-model --shape $Q35_SHAPE --out $Q35_MODEL; touch "$W/q35model.done"; } &
      if [ "$PLAN" = figures ] && [ "${Q35_FIRST:-0}" = 1 ]; then
        # the Qwen3.5 part needs no 1.5B model: it starts now, the GGUF is staged during it (the 1.5B part waits for it)
        model_15b &
      else
        model_15b || exit 1
      fi
    fi
    if [ "${RESUME:-0}" = 1 ]; then
      mkdir -p "$RUN/resume" && cat /tmp/resume-stage/trainer.ckpt.part* > "$RUN/resume/trainer.ckpt"
      sha=$(sha256sum < "$RUN/resume/trainer.ckpt" | cut -d' ' -f1)
      [ "$sha" = "$(cat /tmp/resume-stage/trainer.ckpt.sha256)" ] || { log "resume checkpoint checksum mismatch: stage every .gpu-resume folder"; exit 1; }
      # Lightning's Timer keeps the run's training seconds in the checkpoint and counts --trainer.max_time from them
      "$PY" -c "import sys, torch; c = torch.load(sys.argv[1], map_location='cpu', weights_only=False)
print(int(c['callbacks'].get('Timer', {}).get('time_elapsed', {}).get('train', 0)), c['global_step'])" "$RUN/resume/trainer.ckpt" > "$RUN/resume/elapsed_step" || exit 1
    fi
    if [ "$DRY" = 1 ] && [ "$PLAN" = figures ]; then timed random_q35 "${ALFRL[@]}" random-model --shape $Q35_SHAPE --out $Q35_MODEL; touch "$W/q35model.done"; fi
    [ "$DRY" = 1 ] && touch "$W/model.done"
    if [ "$PLAN" = figures ]; then figures_lane; elif [ "${RESUME:-0}" = 1 ]; then resume_lane; else learn_lane; fi
    wait; touch "$W/all.done"; log "all done" ;;
  bench)  # after the learning job: the bench alone on the GPU
    cp "$0" "$W/campaign.sh"; ALFRL_REPO=$REPO setsid nohup bash "$W/campaign.sh" _bench > "$W/logs/bench_lane.log" 2>&1 < /dev/null &
    log "bench started" ;;
  _bench)
    while pgrep -f "alfrl.cl[i] " > /dev/null; do sleep 3; done
    bench_lane; touch "$W/bench_lane.done"; log "bench done" ;;
  wait)  # wait N [bench|probe|q35]: until the learning job (or that part) is done or N seconds pass; then pack what there is
    end=$(( $(date +%s) + ${2:-540} )); mark=$W/${3:-all}.done; [ "${3:-}" = bench ] && mark=$W/bench_lane.done   # probe, q35
    [ -f "$W/logs/start.log" ] || [ -f "$W/logs/probe_job.log" ] || [ -f "$mark" ] || { echo "wait: nothing started on this machine (a fresh one?): stage the kit and the model, then start" >&2; exit 1; }
    while [ "$(date +%s)" -lt "$end" ] && [ ! -f "$mark" ]; do sleep 5; done
    pack > /dev/null
    tail -n 30 "$W/logs/campaign.log"; cat "$W/results/times.txt" 2>/dev/null
    for f in "$W"/logs/*.log; do echo "== $f"; grep -v "it/s\]\|^INFO\|^(EngineCore\|^DEBUG\|Warning\|warn" "$f" | tail -n 5; done
    [ -f "$mark" ] && echo "all done" ;;
  pieces) pieces "$2" "$3" ;;
  caches)  # caches K: the compilers' caches (Triton, vLLM's torch.compile, Inductor) in 15 MiB pieces, 4 per call (K = 0, 1, ...)
    p=$W/pieces_cache
    [ -f "$p/done" ] || { rm -rf "$p" && mkdir -p "$p" && tar -czf "$W/caches.tgz" -C "$W/cache" . && split -b 15M -d -a 2 "$W/caches.tgz" "$p/caches.tgz.part" \
      && sha256sum < "$W/caches.tgz" | cut -d' ' -f1 > "$p/caches.tgz.sha256" && touch "$p/done"; }
    four_pieces "$p" "$2" && cp "$p/caches.tgz.sha256" "$OUT/"
    echo "$(ls "$p"/*.part* | wc -l) pieces of the caches ($(du -sh "$W/cache" | cut -f1) unpacked); sent $(ls "$OUT" | tr '\n' ' ')" ;;
  cache-pieces)  # here, after a lease: cache-pieces DIR (the pieces `caches` brought back) -> .gpu-cache/k01.. (3 pieces each)
    ls "${2:-}"/caches.tgz.part* > /dev/null 2>&1 && [ -f "$2/caches.tgz.sha256" ] || { echo "cache-pieces: no caches.tgz.part* and caches.tgz.sha256 in '${2:-}': give the folder the \`caches\` calls brought back"; exit 2; }
    [ "$(cat "$2"/caches.tgz.part* | sha256sum | cut -d' ' -f1)" = "$(cat "$2/caches.tgz.sha256")" ] || { echo "cache-pieces: the pieces in $2 do not match caches.tgz.sha256: bring back every piece"; exit 2; }
    rm -rf .gpu-cache && i=0
    for f in "$2"/caches.tgz.part*; do d=.gpu-cache/k$(printf %02d $(( i / 3 + 1 ))); mkdir -p "$d" && cp "$f" "$d/"; i=$(( i + 1 )); done
    cp "$2/caches.tgz.sha256" .gpu-cache/k01/
    echo "$(ls .gpu-cache | wc -l) folders in .gpu-cache: stage each before start" ;;
  resume-pieces)  # here, before a lease: resume-pieces STEP_DIR (a checkpoint folder with trainer.ckpt) -> .gpu-resume/r01..r08
    [ -f "${2:-}/trainer.ckpt" ] || { echo "resume-pieces: no trainer.ckpt in '${2:-}': give a run's checkpoints/step-NNNNNN folder"; exit 2; }
    rm -rf .gpu-resume && mkdir -p .gpu-resume/all && split -n 8 -d -a 2 "$2/trainer.ckpt" .gpu-resume/all/trainer.ckpt.part || exit 1
    for f in .gpu-resume/all/*.part*; do n=${f##*part}; n=$(( 10#$n + 1 )); d=.gpu-resume/r$(printf %02d "$n"); mkdir -p "$d" && mv "$f" "$d/"; done
    rmdir .gpu-resume/all; sha256sum < "$2/trainer.ckpt" | cut -d' ' -f1 > .gpu-resume/r01/trainer.ckpt.sha256
    echo "$(ls .gpu-resume | wc -l) folders in .gpu-resume: stage each before start" ;;
  send) send "$2" "$3" ;;
  eval-adapter)  # eval-adapter NAME: the 274-game evaluation of an adapter brought back in pieces (.gpu-adapter/p1, p2 staged)
    cp "$0" "$W/campaign.sh"; ALFRL_REPO=$REPO setsid nohup bash "$W/campaign.sh" _eval_adapter "$2" > "$W/logs/eval_adapter_$2.log" 2>&1 < /dev/null &
    log "evaluation of the brought-back adapter $2 started" ;;
  _eval_adapter)
    while [ ! -f "$W/model.done" ]; do sleep 2; done   # after `start` converted the model
    mkdir -p "$RUN/$2-adapter" && cat /tmp/adapter-stage/*.part* | tar -xf - -C "$RUN/$2-adapter" || exit 1
    eval_run "$2" side --adapter "$RUN/$2-adapter/a"; touch "$W/$2.done"; log "evaluation of $2 done" ;;   # beside the learning job: a fixed KV cache
  finish)  # after a fit that stopped on its own: the RL adapter's evaluation, then the report
    cp "$0" "$W/campaign.sh"; ALFRL_REPO=$REPO setsid nohup bash "$W/campaign.sh" _finish > "$W/logs/finish.log" 2>&1 < /dev/null &
    log "finish started" ;;
  _finish)
    while pgrep -f "alfrl.cl[i] " > /dev/null; do sleep 3; done
    eval_run rl alone --adapter "$RUN/rl/checkpoints/last"; report
    touch "$W/all.done"; log "all done" ;;
  *) sed -n 2,30p "$0"; exit 2 ;;
esac
