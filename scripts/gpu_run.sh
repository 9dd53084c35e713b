#!/usr/bin/env bash
# The whole GPU run in one script, from the repo root on the H200 machine:
#   kernel profile -> tests on CUDA (float32) -> pocketlab.tools.bench per model -> perf baselines (only where
#   missing) -> prefix-cache TTFT and MTP cost -> make reports -> reports/ tarred into $OUT.
# Why one script: the GPU machine has no network and a short lease; one call does everything, each step
# bounded by what is left of the time budget, and a failing step never stops the next one.
#
# One call is limited to 10 minutes, and its reply brings back at most 8 files from $OUT: this script leaves three
# (gpu_run.log, summary.txt, reports.tgz), so run it at most twice a call, each with its own OUT. On a two-GPU
# machine (kind nvidia-h200-x2) run two lanes at once, one per GPU, each in its own copy of the tree (both lanes tar
# reports/) and with its own OUT, e.g.
#   mkdir -p /tmp/b && cp -r . /tmp/b
#   (CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a STEPS=... MODELS=... bash scripts/gpu_run.sh &
#    cd /tmp/b && CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b STEPS=... MODELS=... bash scripts/gpu_run.sh; wait) >/dev/null
# How long each step took on the device, the calls each session made, and what is owed next:
# reports/gpu-calls.md (add your session's entry there).
#
# MoE at real shapes (issue 17), one H200, one call each (the engine runs on the HF peer's own tensors, so the weights
# are on the GPU once: peak ~86 GiB at 30B-A3B, ~81 GiB at 35B-A3B, most of it the weights and, at 30B, 24 GiB of K/V
# for 64 slots x 4,097 positions; the JSON's "memory" has the measured peak). Engine warm-up, latency and serving
# sections left out (HF's continuous batching refuses the hybrid and is slow on the other); the peers come last, so
# a static-cache compile that runs past the limit costs only its own rows:
#   STEPS=bench MODELS=qwen3-30b-a3b BENCH_ARGS="--no-warm --batch-sizes 1,8,32,64 --skip latency,serving"
#     BENCH_CAP_S=540 BUDGET_S=570         (then the same with MODELS=qwen3.5-35b-a3b)
# Notebooks 01-03 at the real per-layer MoE shapes (presets *-4-layers: every tensor at the real shape, 4 layers, so
# the float32 reference and the notebooks' engines fit beside each other):
#   STEPS=reports REPORT_MODELS=qwen3-30b-a3b-4-layers REPORT_NOTEBOOKS=01,02,03 REPORT_DTYPE=float32
#     REPORTS_CAP_S=270 BUDGET_S=570       (float32: the exact contract, |diff| <= 1e-4 and equal tokens)
#   STEPS=reports REPORT_MODELS=qwen3.5-35b-a3b-4-layers REPORT_NOTEBOOKS=01,02,03 REPORTS_CAP_S=270 BUDGET_S=570
#     (bf16: with fla installed HF's float32 Qwen3.5 runs TF32 chunk kernels, so float32 has no 1e-4 reference)
# In bf16 notebook 01 can fail at MoE shapes on one routing flip: where a near-tie of the router picks another expert
# in the engine than in HF fp32 but not in HF bf16, that step's |diff| is a whole expert's output (seen on the CPU at
# two Qwen3-30B-A3B layers, 3 steps of 45, each exactly at such a flip; float32 there: 5e-6).
# Leave ~30 s between BUDGET_S and the call's limit: the final tar must run, or nothing comes back.
# After each call unpack each lane's reports.tgz and commit what it measured (reports/bench, reports/gpu,
# reports/baseline, reports/<model>/): every call starts from your tree, so a later call's reports reuse the
# bench JSONs only once they are committed.
#
# Knobs (env vars, defaults in brackets):
#   STEPS            [profile tests bench baseline extras invariant fused stalls moe reports]  which steps run, in order
#   MODELS           [qwen3-0.6b qwen3-8b qwen3.5-0.8b qwen3.5-9b]  benched, one after the other
#   REPORT_MODELS    [qwen3-0.6b]       `make reports DEVICE=cuda MODEL=m` for each
#   REPORT_DTYPE     [bfloat16]         the reports' dtype (reports/<model>/ keeps the last run's, whichever dtype)
#   REPORT_PARAMS    []                 notebook parameters, KEY=VALUE separated by spaces (make reports PARAMS=...),
#                                       e.g. "invariance_slots=8 invariance_steps=64" for 02 at an MoE shape
#   TTFT_MODELS      [qwen3-8b qwen3.5-9b]  MTP_MODELS [qwen3.5-9b]   the extras step's models
#   INVARIANT_MODELS [qwen3-8b qwen3.5-9b]  INVARIANT_STEPS [64]   the invariant step's shapes and decode steps
#   INVARIANT_TESTS  [the mode's and its kernels' test files]  INVARIANT_TIMINGS [1]   (empty / 0: skip)
#   FUSED_TESTS [the fused linear's tests + parity]  FUSED_SWEEP [1] (FUSED_SWEEP_ARGS [] e.g. "--few 32 --splits 1,2")
#   FUSED_MODELS [qwen3-0.6b qwen3-8b]
#   FUSED_BATCHES [1,32]  FUSED_PREFILL [4096] (empty: no prefill row)
#   FUSED_MODES [fused_linear=torch fused_linear=triton,gemv_rows=0 fused_linear=triton]
#                    the fused step: CUDA tests, the fused matmul's launch sweep (FUSED_SWEEP; its TMA form's rings
#                    too, layers.matmul_tma -> matmul-tma-sweep-h200.txt), the GEMV's (GEMV_SWEEP
#                    [1]; GEMV_SWEEP_ARGS [] e.g. "--forms --shapes 8b,30b", GEMV_SWEEP_FILE [gemv-sweep],
#                    GEMV_SWEEP_CAP_S [300]), the pre-norm's cost own vs folded (GEMV_NORM_CHAIN [1]), kernel tables
#                    per mode (engine options or env vars such as POCKETLAB_PDL=0, comma-separated);
#                    ATTENTION_SWEEP [0] 1: the decode attention's split counts (layers.decode_attention_sweep;
#                    ATTENTION_SWEEP_ARGS [] e.g. "--batches 1,8,32", or "--launches 0:4:2:0,0:4:2:1,0:8:2:0"
#                    for its launches, ATTENTION_SWEEP_FILE [decode-attention-splits] e.g. decode-attention-launches)
#                    -> profile-<model>-<mode>-h200.txt
#   INVARIANT_SWEEP  [0]  1: the invariant matmul's launch sweep   INVARIANT_PROFILE []  a model: kernel tables, both modes
#   STALL_MODELS [qwen3-0.6b qwen3.5-0.8b]  STALL_BENCH_MODELS [qwen3-8b qwen3.5-9b]   the stalls step: cold vs warm
#                    process starts, and the bench's start/latency/serving sections (the bench step has them too);
#                    STALL_ARGS [] extra bench arguments there (e.g. a shorter serving trace)
#   TP_MODELS [qwen3-8b qwen3.5-9b]  TP2_MODELS [qwen3.5-27b-shape]  the tp step (not in the default STEPS: it needs
#                    two GPUs): CUDA tests of tests/test_tensor_parallel.py, bench_tp at TP=1 and 2 (TP2_MODELS: 2 only)
#   MOE_MODELS [qwen3.5-35b-a3b qwen3-30b-a3b]  the moe step: MOE_TESTS [tests/test_moe.py] on CUDA, one layer's
#                    experts per shape (moe_bench: triton vs grouped_mm vs loop, MOE_ARGS [] e.g. --sweep), kernel
#                    tables for MOE_PROFILE [] (e.g. the *-4-layers presets); bench the models with MODELS=
#   AB_MODELS []  the ab step (not in the default STEPS): `python -m pocketlab.tools.ab` per model with AB_VARIANTS
#                    (';'-separated, e.g. ";POCKETLAB_PDL=0"), AB_ARGS [] (e.g. --rounds 7), AB_FILE [switches] names
#                    the tables, AB_CAP_S [240] per model; AB_TREE [] an archive of an earlier revision's package
#                    (`git archive REV pocketlab | gzip > .whl/rev.tgz`, carried), unpacked to /tmp/ab-tree first, so
#                    a variant "tree=/tmp/ab-tree/pocketlab" runs that revision's engine beside this one
#   REPORT_NOTEBOOKS [01,02,03,04,05,06,07]  the reports step's notebooks, in this order, each a step of its own
#   TTFT_STRIDES     [512]              checkpoint strides the TTFT table is measured at, comma-separated
#   PEER_MODES       [eager,static]     HF peers (static = static cache + HF's compiled decode step)
#   EAGER_NEW_TOKENS [32]               HF eager decodes ~14 tok/s at batch 1: capped (recorded in the JSON)
#   PEER_REPEATS     [2]
#   BENCH_ARGS       []                 extra `python -m pocketlab.tools.bench` arguments for every model
#   WRITE_BASELINE   [0]                1: overwrite reports/baseline/cuda-<model>.json from this run's bench
#   BUDGET_S         [480]              wall-clock budget; a step gets min(its cap, what is left)
#   BENCH_CAP_S      [240]  TESTS_CAP_S [240]  REPORTS_CAP_S [150]  (reports' time is reserved while benching; an 8B
#                    bench with its static peer at b1 and b32 took ~210 s on a fresh H200)
#   TESTS            [tests]            the tests step's pytest arguments (files, -k ...)
#   REPORTS_PARALLEL [0]                1: the notebooks run at once (host-bound, so the GPU has room; not for 04,
#                                       whose timings want the GPU alone)
#   OUT              [out]              folder whose files come back: gpu_run.log, summary.txt, reports.tgz
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
STEPS=${STEPS:-profile tests bench baseline extras invariant fused stalls moe reports}
MODELS=${MODELS:-qwen3-0.6b qwen3-8b qwen3.5-0.8b qwen3.5-9b}
REPORT_MODELS=${REPORT_MODELS:-qwen3-0.6b}
REPORT_DTYPE=${REPORT_DTYPE:-bfloat16}
REPORT_PARAMS=${REPORT_PARAMS:-}
TTFT_MODELS=${TTFT_MODELS-qwen3-8b qwen3.5-9b}  # set empty for none
MTP_MODELS=${MTP_MODELS-qwen3.5-9b}
INVARIANT_MODELS=${INVARIANT_MODELS-qwen3-8b qwen3.5-9b}
INVARIANT_STEPS=${INVARIANT_STEPS:-64}
MOE_MODELS=${MOE_MODELS-qwen3.5-35b-a3b qwen3-30b-a3b}
MOE_ARGS=${MOE_ARGS:-}
MOE_PROFILE=${MOE_PROFILE-}
MOE_TESTS=${MOE_TESTS-tests/test_moe.py}
AB_MODELS=${AB_MODELS-}
AB_VARIANTS=${AB_VARIANTS:-}
AB_ARGS=${AB_ARGS:-}
AB_FILE=${AB_FILE:-switches}
AB_CAP_S=${AB_CAP_S:-240}
AB_TREE=${AB_TREE:-}
TP_MODELS=${TP_MODELS-qwen3-8b qwen3.5-9b}
TP2_MODELS=${TP2_MODELS-qwen3.5-27b-shape}
INVARIANT_TESTS=${INVARIANT_TESTS-tests/test_batch_invariant.py tests/test_invariant_kernels.py tests/test_invariant_attention.py tests/test_linear_decode.py}
INVARIANT_TIMINGS=${INVARIANT_TIMINGS:-1}
INVARIANT_SWEEP=${INVARIANT_SWEEP:-0}
INVARIANT_PROFILE=${INVARIANT_PROFILE-}
FUSED_TESTS=${FUSED_TESTS-tests/test_fused_linear.py tests/test_invariant_kernels.py tests/test_parity.py}
FUSED_SWEEP=${FUSED_SWEEP:-1}
FUSED_SWEEP_ARGS=${FUSED_SWEEP_ARGS:-}
FUSED_MODELS=${FUSED_MODELS-qwen3-0.6b qwen3-8b}
FUSED_BATCHES=${FUSED_BATCHES:-1,32}
FUSED_PREFILL=${FUSED_PREFILL-4096}
ATTENTION_SWEEP=${ATTENTION_SWEEP:-0}
ATTENTION_SWEEP_ARGS=${ATTENTION_SWEEP_ARGS:-}
ATTENTION_SWEEP_FILE=${ATTENTION_SWEEP_FILE:-decode-attention-splits}
FUSED_MODES=${FUSED_MODES:-fused_linear=torch fused_linear=triton,gemv_rows=0 fused_linear=triton}
GEMV_SWEEP=${GEMV_SWEEP:-1}
GEMV_SWEEP_ARGS=${GEMV_SWEEP_ARGS:-}
GEMV_SWEEP_FILE=${GEMV_SWEEP_FILE:-gemv-sweep}
GEMV_SWEEP_CAP_S=${GEMV_SWEEP_CAP_S:-300}
GEMV_NORM_CHAIN=${GEMV_NORM_CHAIN:-1}
STALL_MODELS=${STALL_MODELS-qwen3-0.6b qwen3.5-0.8b}
STALL_BENCH_MODELS=${STALL_BENCH_MODELS-qwen3-8b qwen3.5-9b}
STALL_ARGS=${STALL_ARGS:-}
REPORT_NOTEBOOKS=${REPORT_NOTEBOOKS:-01,02,03,04,05,06,07}
TTFT_STRIDES=${TTFT_STRIDES:-512}
PEER_MODES=${PEER_MODES:-eager,static}
EAGER_NEW_TOKENS=${EAGER_NEW_TOKENS:-32}
PEER_REPEATS=${PEER_REPEATS:-2}
BENCH_ARGS=${BENCH_ARGS:-}
WRITE_BASELINE=${WRITE_BASELINE:-0}
BUDGET_S=${BUDGET_S:-480}
BENCH_CAP_S=${BENCH_CAP_S:-240}
TESTS_CAP_S=${TESTS_CAP_S:-240}
TESTS=${TESTS:-tests}
REPORTS_CAP_S=${REPORTS_CAP_S:-150}
REPORTS_PARALLEL=${REPORTS_PARALLEL:-0}
START=$(date +%s)
mkdir -p "$OUT" reports/bench
BENCHED=$(mktemp -d)  # this call's bench JSONs: the only ones the baseline and perf-notebook steps may judge
LOG="$OUT/gpu_run.log"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE '[a-z][0-9]{2,3}' | head -1 | tr A-Z a-z)
GPU=${GPU:-gpu}  # h100, h200, ...: the tables below are named by the card that measured them
SUMMARY="$OUT/summary.txt"
: >"$LOG"
: >"$SUMMARY"

wants() { [[ " $STEPS " == *" $1 "* ]]; }
note() { echo "$*" | tee -a "$SUMMARY" "$LOG"; }

# step NAME CAP_S RESERVE_S CMD...: output tee'd into the log; limited to min(CAP, budget left - RESERVE).
step() {
  local name=$1 cap=$2 reserve=$3
  shift 3
  local left=$((BUDGET_S - ($(date +%s) - START) - reserve))
  if ((left < 20)); then
    note "SKIP  $name (budget: ${left}s left)"
    return 0
  fi
  local limit=$((cap < left ? cap : left)) t0=$(date +%s)
  echo -e "\n=== $name (limit ${limit}s) ===" | tee -a "$LOG"
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  local verdict=$([[ $rc == 0 ]] && echo ok || ([[ $rc == 124 || $rc == 137 ]] && echo TIMEOUT || echo FAIL))
  note "$(printf '%-7s %-44s rc=%-3s %4ss' "$verdict" "$name" "$rc" "$(($(date +%s) - t0))")"
}

# -- environment: the carried wheels (scripts/gpu_wheels.sh: papermill, nbval, fla, the tokenizer) and pocketlab from this checkout --
# (under a lock: two lanes, one per GPU, may start together; see the two-GPU line above)
if ls .whl/*.whl >/dev/null 2>&1; then
  flock /tmp/site.lock sh -c '[ -d /tmp/site/papermill ] ||
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl' 2>&1 | tail -3 | tee -a "$LOG"
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" JUPYTER_PATH=/tmp/site/share/jupyter
export PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__)"
  python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
  echo "STEPS=$STEPS | MODELS=$MODELS | REPORT_MODELS=$REPORT_MODELS | PEER_MODES=$PEER_MODES | BUDGET_S=$BUDGET_S"
} 2>&1 | tee -a "$LOG" "$SUMMARY"

reserve=0
wants reports && reserve=$REPORTS_CAP_S

# -- 0. where a decode step's GPU time goes (kernel table, graphs on and off), per model -------------
if wants profile; then
  for m in $MODELS; do
    step "profile $m" 120 "$reserve" python3 -m pocketlab.tools.profile --model "$m" --batch-sizes 1,32
  done
fi

# -- 1. unit tests on CUDA in float32 (the contracts; bf16 is judged at real shapes by the reports), 4 workers;
#       each failure printed as it happens, so a run cut by its limit still says what failed -----------
# shellcheck disable=SC2086
wants tests && step "pytest tests (POCKETLAB_DEVICE=cuda)" "$TESTS_CAP_S" "$reserve" \
  env POCKETLAB_DEVICE=cuda POCKETLAB_INSTAFAIL=1 python3 -m pytest -q -p no:cacheprovider -n 4 --tb=short $TESTS

# -- 2. bench each model; JSON rewritten after every task, so a timeout keeps what was measured -------
if wants bench; then
  for m in $MODELS; do
    # shellcheck disable=SC2086
    step "bench $m" "$BENCH_CAP_S" "$reserve" python3 -m pocketlab.tools.bench --model "$m" --device cuda \
      --peer-modes "$PEER_MODES" --peer-eager-new-tokens "$EAGER_NEW_TOKENS" --peer-repeats "$PEER_REPEATS" \
      --out "$BENCHED/cuda-$m.json" $BENCH_ARGS
    cp "$BENCHED/cuda-$m.json" reports/bench/ 2>/dev/null  # committed after the call; a timeout keeps what ran
  done
fi

# -- 3. perf baselines from this run's bench JSON, only where none is committed (or WRITE_BASELINE=1) ---
if wants baseline; then
  for m in $MODELS; do
    if [ -f "$BENCHED/cuda-$m.json" ] && { [ "$WRITE_BASELINE" = 1 ] || [ ! -f "reports/baseline/cuda-$m.json" ]; }; then
      step "baseline $m (from this run's bench)" 60 0 python3 -m pocketlab.verify.perf --write-baseline \
        --device cuda --dtype bfloat16 --model "$m" --from-bench "$BENCHED/cuda-$m.json"
    fi
  done
fi

# -- 4. prefix-cache time to first token and MTP verify cost at real shapes (issues 6 and 7) -----------
if wants extras; then
  mkdir -p reports/gpu
  for m in $TTFT_MODELS; do   # one table per checkpoint stride (hybrid models checkpoint their state at multiples)
    step "prefix-cache TTFT $m (strides $TTFT_STRIDES)" 200 "$reserve" python3 -c "
import pandas as pd
from pocketlab.verify.ttft import ttft
df = pd.concat([ttft(model='$m', checkpoint_stride=s).assign(checkpoint_stride=s) for s in ($TTFT_STRIDES,)])
print(df.to_string()); df.to_csv('reports/gpu/ttft-$m.csv', index=False)"
  done
  for m in $MTP_MODELS; do   # a failing verify graph is reported, then the same figures come eagerly
    step "MTP verify cost $m" 300 "$reserve" python3 -c "
import traceback
from pocketlab.verify.mtp_cost import verify_cost
try:
    df = verify_cost('$m', batch_sizes=(1, 8))
except Exception:
    traceback.print_exc(); print('VERIFY GRAPHS FAILED: measuring eagerly (cuda_graphs=False)')
    df = verify_cost('$m', batch_sizes=(1, 8), cuda_graphs=False)
print(df.to_string()); df.to_csv('reports/gpu/mtp-cost-$m.csv', index=False)"
  done
fi

# -- 5. batch-invariant mode: its CUDA tests, kernel timings, the cost (both modes in one bench run per shape,
#       no HF peer) and solo vs batch-32 divergence per shape -> reports/bench/invariant-*, reports/gpu/ ----
if wants invariant; then
  mkdir -p reports/gpu
  for m in $INVARIANT_MODELS; do
    for bi in False True; do
      step "bench $m batch_invariant=$bi" 150 "$reserve" python3 -m pocketlab.tools.bench --model "$m" --device cuda \
        --no-peer --batch-sizes 1,8,32 --prompt-lens 4096 --new-tokens 64 --repeats 2 --ragged 2 \
        --engine-option batch_invariant=$bi --out "reports/bench/invariant-$bi-cuda-$m.json"
    done
    step "solo vs batch divergence $m" 150 "$reserve" python3 -m pocketlab.verify.invariance --model "$m" \
      --device cuda --slots 32 --steps "$INVARIANT_STEPS" --cases batched --out "reports/gpu/invariance-$m.csv"
  done
  # shellcheck disable=SC2086
  [ -n "$INVARIANT_TESTS" ] && step "pytest batch-invariant mode + kernels (cuda)" 240 "$reserve" \
    env POCKETLAB_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --tb=short $INVARIANT_TESTS
  [ "$INVARIANT_TIMINGS" = 1 ] && step "invariant kernel timings" 120 "$reserve" bash -o pipefail -c \
    "python3 -m pocketlab.layers.invariant.bench --runs 20 && python3 -m pocketlab.layers.invariant.attention_bench"
  [ "$INVARIANT_SWEEP" = 1 ] && step "invariant matmul launches (sweep)" 200 "$reserve" bash -o pipefail -c \
    "TQDM_DISABLE=1 python3 -m pocketlab.layers.invariant.sweep | tee reports/gpu/invariant-matmul-sweep-$GPU.txt"
  [ -n "$INVARIANT_PROFILE" ] && for bi in False True; do
    step "profile $INVARIANT_PROFILE batch_invariant=$bi" 90 "$reserve" bash -o pipefail -c "python3 -m pocketlab.tools.profile \
      --model $INVARIANT_PROFILE --batch-sizes 1,32 --prefill-lens 4096 --steps 10 --top 25 \
      --engine-option batch_invariant=$bi | tee reports/gpu/profile-$INVARIANT_PROFILE-invariant-$bi.txt"
  done
fi

# -- 5b. the fused linear (issue 14): its CUDA tests, its launches' bandwidth, and kernel tables before (fused_linear
#        =torch: cuBLAS + separate norm/add/SwiGLU) and after (triton) per model -> reports/gpu/profile-*-fused-* --
if wants fused; then
  mkdir -p reports/gpu
  # shellcheck disable=SC2086
  [ -n "$FUSED_TESTS" ] && step "pytest fused linear (cuda)" 200 "$reserve" \
    env POCKETLAB_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --tb=short $FUSED_TESTS
  [ "$FUSED_SWEEP" = 1 ] && step "fused linear launches (sweep)" 150 "$reserve" bash -o pipefail -c \
    "python3 -m pocketlab.layers.invariant.sweep --fused $FUSED_SWEEP_ARGS | tee reports/gpu/fused-linear-sweep-$GPU.txt"
  [ "$FUSED_SWEEP" = 1 ] && step "few-row matmul TMA rings (sweep)" 200 "$reserve" bash -o pipefail -c \
    "python3 -m pocketlab.layers.invariant.sweep --tma --few 1,32 | tee reports/gpu/matmul-tma-sweep-$GPU.txt"
  [ "$GEMV_SWEEP" = 1 ] && step "gemv launches (sweep)" "$GEMV_SWEEP_CAP_S" "$reserve" bash -o pipefail -c \
    "TQDM_DISABLE=1 python3 -m pocketlab.layers.gemv_sweep $GEMV_SWEEP_ARGS | tee reports/gpu/$GEMV_SWEEP_FILE-$GPU.txt"
  [ "$GEMV_NORM_CHAIN" = 1 ] && step "gemv pre-norm, own kernel vs folded" 120 "$reserve" bash -o pipefail -c \
    "python3 -m pocketlab.layers.gemv_sweep --norm-chain | tee reports/gpu/gemv-norm-chain-$GPU.txt"
  [ "$ATTENTION_SWEEP" = 1 ] && step "decode attention splits (sweep)" 200 "$reserve" bash -o pipefail -c \
    "TQDM_DISABLE=1 python3 -m pocketlab.layers.decode_attention_sweep $ATTENTION_SWEEP_ARGS | tee reports/gpu/$ATTENTION_SWEEP_FILE-$GPU.txt"
  for m in $FUSED_MODELS; do
    for mode in $FUSED_MODES; do   # a mode: NAME=VALUE, comma-separated: engine options, or UPPER_CASE env vars
      opts="" envs=""
      for kv in ${mode//,/ }; do if [[ $kv == [A-Z]* ]]; then envs+=" $kv"; else opts+=" --engine-option $kv"; fi; done
      step "profile $m $mode" 150 "$reserve" bash -o pipefail -c "env $envs python3 -m pocketlab.tools.profile --model $m \
        --batch-sizes $FUSED_BATCHES --prefill-lens '$FUSED_PREFILL' --steps 10 --top 25 $opts \
        | tee reports/gpu/profile-$m-${mode//[=,]/-}-$GPU.txt"
    done
  done
fi

# -- 5c. no stalls (issue 15): two fresh processes per model, cold then warm kernel caches (tools.startup), and the
#        bench's start / latency / serving sections alone (its other sections come with the bench step) --------
if wants stalls; then
  for m in $STALL_MODELS; do
    step "startup $m (cold vs warm process)" 300 "$reserve" python3 -m pocketlab.tools.startup --model "$m" --profile 25 \
      --root /tmp/checkpoints --out "reports/bench/startup-cuda-$m.json"
  done
  for m in $STALL_BENCH_MODELS; do
    # shellcheck disable=SC2086
    step "bench $m (start, latency, serving)" "$BENCH_CAP_S" "$reserve" python3 -m pocketlab.tools.bench --model "$m" \
      --device cuda --skip prefill,decode,peer --out "reports/bench/stalls-cuda-$m.json" $STALL_ARGS
  done
fi

# -- 5d. mixture of experts (issue 17): its CUDA tests, then one MoE layer's routed experts per shape, each path
#        (Triton kernels, torch grouped_mm, the per-expert loop) against the copy rate -> reports/gpu/moe-experts-* --
if wants moe; then
  mkdir -p reports/gpu
  # shellcheck disable=SC2086
  [ -n "$MOE_TESTS" ] && step "pytest MoE (cuda)" 200 "$reserve" \
    env POCKETLAB_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --tb=short $MOE_TESTS
  for m in $MOE_MODELS; do
    step "moe experts $m" 200 "$reserve" bash -o pipefail -c "python3 -m pocketlab.tools.moe_bench --model $m \
      --out reports/gpu/moe-experts-$m.json $MOE_ARGS | tee reports/gpu/moe-experts-$m-$GPU.txt"
  done
  for m in $MOE_PROFILE; do
    step "profile $m" 240 "$reserve" bash -o pipefail -c "python3 -m pocketlab.tools.profile --model $m \
      --batch-sizes 1,32 --prefill-lens 4096 --steps 10 --top 25 | tee reports/gpu/profile-$m-$GPU.txt"
  done
fi

# -- 5d'. A/B of environment switches in one process per model (tools.ab: variants alternated round by round,
#         graphs captured again for each) -> reports/gpu/ab-<AB_FILE>-<model>-h200.txt --
if wants ab; then
  mkdir -p reports/gpu
  [ -n "$AB_TREE" ] && rm -rf /tmp/ab-tree && mkdir -p /tmp/ab-tree && tar xzf "$AB_TREE" -C /tmp/ab-tree
  for m in $AB_MODELS; do
    step "A/B $m" "$AB_CAP_S" "$reserve" bash -o pipefail -c "TQDM_DISABLE=1 python3 -m pocketlab.tools.ab --model $m \
      --variants '$AB_VARIANTS' $AB_ARGS | tee reports/gpu/ab-$AB_FILE-$m-$GPU.txt"
  done
fi

# -- 5e. tensor parallelism (issue 18), two GPUs (kind nvidia-h200-x2, one lane): its tests on CUDA (TP=2 against
#        TP=1 over NCCL, float32; the fault tests are gloo-only), then bench_tp at TP=1 and TP=2 per shape (decode
#        batch 1 and 32, prefill 4,096) and TP=2 alone for TP2_MODELS -> reports/gpu/tp{1,2}-<model>.json --
if wants tp; then
  mkdir -p reports/gpu
  step "pytest tensor parallel (cuda)" 300 "$reserve" \
    env POCKETLAB_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_tensor_parallel.py
  for m in $TP_MODELS; do
    step "bench_tp $m TP=1" 240 "$reserve" python3 -m pocketlab.tools.bench_tp --model "$m" --out "reports/gpu/tp1-$m.json"
  done
  for m in $TP_MODELS $TP2_MODELS; do
    step "bench_tp $m TP=2" 300 "$reserve" python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      -m pocketlab.tools.bench_tp --model "$m" --out "reports/gpu/tp2-$m.json"
  done
fi

# -- 6. reports at real shape; the perf notebook reuses this call's bench JSON (POCKETLAB_BENCH_DIR), else it
#       measures now: a committed bench from an earlier tree is never judged as this tree's --------------
if wants reports; then
  for m in $REPORT_MODELS; do
    # each notebook of REPORT_NOTEBOOKS its own step (a slow one cannot cost the others their reports)
    for nb in ${REPORT_NOTEBOOKS//,/ }; do
      # -o: the machine brings its own packages, so never (re)build the CPU venv the target depends on
      if command -v make >/dev/null; then
        cmd=(make -o .venv/.installed reports PY=python3 DEVICE=cuda DTYPE="$REPORT_DTYPE" MODEL="$m" NOTEBOOKS="$nb"
          PARAMS="$REPORT_PARAMS")
      else
        # shellcheck disable=SC2046
        cmd=(python3 -m pocketlab.verify.reports --device cuda --dtype "$REPORT_DTYPE" --model "$m" --only "$nb"
          $(for p in $REPORT_PARAMS; do echo "-p $p"; done))
      fi
      step "make reports DEVICE=cuda DTYPE=$REPORT_DTYPE MODEL=$m NOTEBOOKS=$nb" "$REPORTS_CAP_S" 0 \
        env POCKETLAB_BENCH_DIR="$BENCHED" "${cmd[@]}" &
      [ "$REPORTS_PARALLEL" = 1 ] || wait
    done
  done
  wait
fi
# one index over every GPU model whose notebooks have run here (this call's or committed ones)
# shellcheck disable=SC2086
python3 -m pocketlab.verify.reports --models $REPORT_MODELS qwen3-0.6b qwen3-8b --device cuda --dtype bfloat16 \
  --index-only index-h200 2>&1 | tail -1 | tee -a "$LOG"

tar czf "$OUT/reports.tgz" reports
note "done in $(($(date +%s) - START))s; reports/ -> $OUT/reports.tgz"
