#!/usr/bin/env bash
# The whole GPU run in one script, from the repo root on the H200 machine:
#   kernel profile -> tests on CUDA (float32) -> pocketlab.tools.bench per model -> perf baselines (only where
#   missing) -> prefix-cache TTFT and MTP cost -> make reports -> reports/ tarred into $OUT.
# Why one script: the GPU machine has no network and a short lease; one call does everything, each step
# bounded by what is left of the time budget, and a failing step never stops the next one.
#
# One call is limited to 10 minutes. Seen on 2026-11-30 (third session): tests ~95 s (4 workers), bench 150 s
# (0.6B) to 230 s (0.8B) with the HF peers (their compiles dominate; HF's compiled batch-32 step at the 9B shape
# did not finish inside 290 s), TTFT ~15 s per stride, MTP cost 80-110 s per model, `make reports` at the 8B
# shape > 150 s. On a two-GPU machine (kind nvidia-h200-x2) run two lanes at once, one per GPU, each in its own
# copy of the tree (both lanes tar reports/) and with its own OUT, e.g.
#   mkdir -p /tmp/b && cp -r . /tmp/b
#   (CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a STEPS=... MODELS=... bash scripts/gpu_run.sh &
#    cd /tmp/b && CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b STEPS=... MODELS=... bash scripts/gpu_run.sh; wait) >/dev/null
# Plan (each line one x2 call, `.whl` carried; about 9 minutes of device time each):
#   1. a: STEPS="bench baseline" MODELS="qwen3.5-0.8b qwen3-0.6b" BENCH_CAP_S=290 BUDGET_S=575
#      b: STEPS="bench baseline" MODELS="qwen3.5-9b qwen3-8b" BENCH_CAP_S=290 BUDGET_S=570
#   2. a: STEPS="tests extras" TTFT_MODELS="qwen3.5-9b qwen3-8b" TTFT_STRIDES=512,2048 MTP_MODELS=""
#      b: STEPS="extras reports" TTFT_MODELS="" MTP_MODELS="qwen3.5-9b qwen3.5-0.8b" REPORT_MODELS=qwen3.5-0.8b
#   3. (if time is left) STEPS=reports REPORT_MODELS=qwen3-8b, and STEPS=profile for the model being worked on
# Seen on 2026-12-01 (fifth session, one H200): the invariant step's bench is 37-49 s per mode at 8B, 43 s
# (invariant) and 121 s (default) at 9B, the divergence table 57-73 s per shape; its CUDA tests need > 140 s
# (Triton compiles); notebooks 02, 03 and 07 at the 0.6B shape 187, 167 and 180 s run at once (REPORTS_PARALLEL=1),
# 07 alone 119 s. Calls made:
#   STEPS=invariant INVARIANT_MODELS="qwen3-8b qwen3.5-9b" INVARIANT_TESTS="..." INVARIANT_TIMINGS=0 BUDGET_S=560
#   STEPS=reports REPORT_MODELS=qwen3-0.6b REPORT_NOTEBOOKS=02,03,07 REPORTS_PARALLEL=1 REPORTS_CAP_S=420 BUDGET_S=440
# Still owed: the invariant kernel timings and sweep with the 32-row decode tile (INVARIANT_TIMINGS=1
# INVARIANT_SWEEP=1), a profile after the fused norm/RoPE/write kernel (INVARIANT_PROFILE=qwen3-8b), the 8B notebooks
# under the calibrated verdicts (REPORT_MODELS=qwen3-8b REPORT_NOTEBOOKS=02,03,07).
# Seen on 2026-12-01 (sixth session, one H200, issue 14): STEPS=fused with its CUDA tests 75-200 s (Triton
# compiles; -n 4 for the engine files), the fused sweep 27-33 s, a profile 33-63 s per model and mode; the bench
# with PEER_MODES=static 152 s at 0.6B, > 190 s at 8B (HF's compiled batch-32 step). Calls made:
#   STEPS=fused FUSED_TESTS=tests/test_fused_linear.py BUDGET_S=560   (before/after tables, sweep)
#   STEPS="fused bench" FUSED_SWEEP=0 FUSED_MODES=triton MODELS="qwen3-0.6b qwen3-8b" PEER_MODES=static BUDGET_S=550
#   STEPS=fused FUSED_TESTS="-n 4 tests/test_fused_linear.py tests/test_decode_attention.py tests/test_parity.py
#     tests/test_graphs.py tests/test_slots.py tests/test_speculative.py" FUSED_SWEEP=0 FUSED_MODES=triton BUDGET_S=330
# Still owed: the whole bench (all four shapes with the HF peers) after the fused linear, in-kernel attention merge
# and the 2**23 compile threshold; profiles at the Qwen3.5 shapes (FUSED_MODELS="qwen3.5-0.8b qwen3.5-9b"); the
# batch-invariant step again (its matmul now carries the epilogues; SwiGLU at many rows runs two stages).
# Seen on 2026-12-01 (seventh session, one H200; transformers there is 5.17): the full bench at 0.6B with the static
# peer and the new start/latency/serving sections 195 s; warm-up 50-61 s per shape (49 graphs); startup (two
# processes) 113 s at 0.6B; the stalls bench 105 s at 8B without HF's serving side, 115 s with a 64-request trace
# (HF continuous batching ~27 s of it; the 128-request trace did not finish in 170 s), 153 s at 9B (HF refuses the
# hybrid); tests/test_moe.py on CUDA 70 s; moe_bench 20 s; a Qwen3.5-0.8B profile 71-100 s. Calls made:
#   STEPS="stalls bench" MODELS=qwen3-0.6b STALL_MODELS=qwen3-0.6b STALL_BENCH_MODELS=qwen3-8b PEER_MODES=static BENCH_CAP_S=230
#   STEPS="fused stalls" FUSED_TESTS="" FUSED_SWEEP=0 FUSED_MODELS=qwen3.5-0.8b STALL_MODELS=qwen3-0.6b ... BENCH_CAP_S=170
#   STEPS=moe MOE_MODELS=qwen3-30b-a3b BUDGET_S=205, then STEPS=stalls STALL_MODELS="" STALL_ARGS="--latency-steps 0
#     --serving-requests 64 --serving-new 128,256" BENCH_CAP_S=190 BUDGET_S=345 (two OUT folders, one call)
# Seen on 2026-12-01 (eighth session, one H200): tests/test_gated_delta.py + test_warmup.py on CUDA 88 s; startup at
# 0.8B 195 s (then > 240 s once warm-up's long rows doubled: give it 300); the stalls bench (serving 64 requests, no
# latency) 155 s at 8B, 179 s at 9B without an HF side (> 132 s left were not enough with HF's generate() batches);
# the MoE model bench (no warm-up, prefill 4,096 only, peer static b1/b32) 291 s at 30B-A3B (cut during its
# last row), > 210 s at 35B-A3B (cut at HF's first static step). When device time runs short the call's limit
# shrinks below 600 s, and the 30 s margin below (BUDGET_S to limit) counts from that. Calls made:
#   STEPS="tests stalls" TESTS="tests/test_gated_delta.py tests/test_warmup.py" STALL_MODELS=qwen3.5-0.8b
#     STALL_BENCH_MODELS=qwen3.5-9b STALL_ARGS="--latency-steps 0 --serving-requests 64 --serving-new 128,256"
#   STEPS=stalls STALL_MODELS=qwen3.5-0.8b STALL_BENCH_MODELS="qwen3-8b qwen3.5-9b" (same STALL_ARGS) BUDGET_S=565
#   STEPS=bench MODELS="qwen3-30b-a3b qwen3.5-35b-a3b" PEER_MODES=static BENCH_ARGS="--no-warm --batch-sizes
#     1,8,32,64 --prompt-lens 4096 --peer-batch-sizes 1,32 --skip latency,serving" BENCH_CAP_S=290 BUDGET_S=535
# Still owed: startup at 0.8B after fla's import moved into loading (STALL_MODELS=qwen3.5-0.8b, cap 300 s); the 9B
# serving trace with HF's generate() batches as the peer; the MoE bench at 35B-A3B alone (one call) and the MoE
# notebooks (below); the whole bench at the four dense/hybrid shapes with peers; the invariant step; STEPS=tp on a
# two-GPU machine.
# Tenth session (2026-12-01, one H200): the CUDA tests of the changed kernels 96-131 s (-n 4 to 6), tests/test_moe.py
# 42-70 s, moe_bench 30-33 s per shape, the fused sweep 24 s, a profile 22-60 s (0.6B, 8B) and > 100 s at 0.8B.
# Two calls were lost to a kernel that compiled only in the interpreter (make test now compiles every launch for
# sm_90: tests/sm90.py). Calls made:
#   STEPS="tests stalls moe" TESTS="tests/test_warmup.py tests/test_fused_linear.py tests/test_linear_decode.py
#     tests/test_parity.py tests/test_graphs.py" STALL_MODELS=qwen3.5-0.8b STALL_BENCH_MODELS="" BUDGET_S=560
#   STEPS="tests moe fused" TESTS="-n 4 <those files> tests/test_gated_delta.py" MOE_MODELS="" FUSED_TESTS=""
#     FUSED_MODELS="qwen3-0.6b qwen3.5-0.8b qwen3-8b" FUSED_MODES=triton BUDGET_S=420 (+ the add-norm sweep after)
#   STEPS=tests TESTS="-n 6 tests/test_moe.py tests/test_fused_linear.py tests/test_warmup.py tests/test_gated_delta.py
#     tests/test_linear_decode.py" TESTS_CAP_S=190 BUDGET_S=195
# Still owed, in order: the warm 0.8B start (STEPS=stalls STALL_MODELS=qwen3.5-0.8b STALL_BENCH_MODELS="", cap 300 s);
# the MoE model bench at b1 after the one-program align (MODELS=qwen3-30b-a3b, below; then qwen3.5-35b-a3b); the
# eighth session's owed calls below (9B serving with the generate() peer, MoE notebooks, the whole bench, the
# invariant step, STEPS=tp on two GPUs).
# Eleventh session (2026-12-02, one H200; two calls refused or taken back cost ~200 s of device time): tests/test_moe.py
# on CUDA 76-89 s (-n 4); moe_bench --sweep 52-58 s per shape; a profile at qwen3-30b-a3b-4-layers 51 s, at
# qwen3.5-35b-a3b-4-layers > 120 s (its prefill table missing); the 35B-A3B model bench with the static peer 444 s (HF's
# static b1 110 s, b32 165 s of it); notebook 01 at qwen3-30b-a3b-4-layers in float32 52 s, 02 > 246 s. TESTS is split
# on spaces: a -k expression with spaces collects nothing (rc 5). Calls made:
#   STEPS=moe MOE_TESTS="-n 4 tests/test_moe.py" MOE_ARGS="--sweep --tokens 1,4,8,16,32,64,4096"
#     MOE_PROFILE="qwen3-30b-a3b-4-layers qwen3.5-35b-a3b-4-layers" BUDGET_S=500
#   STEPS=bench MODELS=qwen3.5-35b-a3b PEER_MODES=static BENCH_ARGS="--no-warm --batch-sizes 1,8,32,64 --prompt-lens 4096
#     --peer-batch-sizes 1,32 --skip latency,serving" BENCH_CAP_S=470 BUDGET_S=545
#   STEPS="tests reports" TESTS="-n 4 tests/test_moe.py" REPORT_MODELS=qwen3-30b-a3b-4-layers REPORT_NOTEBOOKS=01,02,03
#     REPORT_DTYPE=float32 REPORTS_CAP_S=270 BUDGET_S=395
# Twelfth session (2026-12-02, one H200): startup at 0.8B with the profiled third process 227 s; notebooks 02 + 03 at
# qwen3-30b-a3b-4-layers in float32 side by side 131 + 165 s (REPORT_PARAMS 8 slots x 128 steps; 03 alone at its
# defaults 174 s); the 9B stalls bench with HF generate() over arrival batches as the serving peer 345 s (HF's side
# 81 s); the 35B-A3B 4-layer profile 63 s; `profile --host 40` per MoE preset 40-50 s (a bare `run` without the
# carried .whl has no fla: install it as below, or the hybrid runs our torch chunk rule). Calls made:
#   STEPS="stalls reports" STALL_MODELS=qwen3.5-0.8b STALL_BENCH_MODELS="" REPORT_MODELS=qwen3-30b-a3b-4-layers
#     REPORT_NOTEBOOKS=03 REPORT_DTYPE=float32 REPORTS_CAP_S=250 BUDGET_S=570
#   STEPS=reports REPORT_MODELS=qwen3-30b-a3b-4-layers REPORT_NOTEBOOKS=03,02 REPORT_DTYPE=float32
#     REPORT_PARAMS="invariance_slots=8 invariance_steps=128" REPORTS_PARALLEL=1 REPORTS_CAP_S=420 BUDGET_S=450
#   STEPS=stalls STALL_MODELS="" STALL_BENCH_MODELS=qwen3.5-9b STALL_ARGS="--latency-steps 0 --serving-requests 64
#     --serving-new 128,256" BENCH_CAP_S=520 BUDGET_S=545
#   STEPS=moe MOE_TESTS="" MOE_MODELS="" MOE_PROFILE=qwen3.5-35b-a3b-4-layers BUDGET_S=400
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site
#     python3 -m pocketlab.tools.profile --model qwen3.5-35b-a3b-4-layers --batch-sizes 1 --prefill-lens 4096 --host 40
# Still owed, in order: the 30B-A3B model bench with the eleventh session's kernels (MODELS=qwen3-30b-a3b, below, cap
# 540); the hybrid prefill's host cost with fewer delta-rule segments (e.g. --engine-option checkpoint_stride=2048 on
# the 35B-A3B 4-layer profile and bench); then the tenth session's list (the whole bench at the four dense/hybrid
# shapes, the invariant step, STEPS=tp on two GPUs).
# Fourteenth session (2026-12-02, one H200, 30 minutes, all used; issue 14's pre-norm fold): CUDA tests of the fused
# linear + parity (-n 4) 70 s; the norm chain 46 s; profiles 35-43 s (0.6B, 8B), 86-88 s at 9B, > 100 s at 0.8B (its
# prefill row cut by the step's cap: give it 140 s); the bench with the static peer at b1/b32 146 s (0.6B), 165 s (8B).
# Calls made:
#   STEPS=fused FUSED_TESTS="-n 4 tests/test_fused_linear.py tests/test_parity.py" FUSED_SWEEP=0 GEMV_SWEEP=0
#     FUSED_MODELS="qwen3-0.6b qwen3.5-0.8b qwen3-8b qwen3.5-9b" FUSED_MODES=fused_linear=triton BUDGET_S=540
#   STEPS=bench MODELS="qwen3-0.6b qwen3-8b" PEER_MODES=static BENCH_ARGS="--no-warm --batch-sizes 1,32
#     --prompt-lens 4096 --peer-batch-sizes 1,32 --skip latency,serving" BENCH_CAP_S=290 BUDGET_S=560
# Still owed: the same bench at qwen3.5-0.8b and qwen3.5-9b (one call); the b1 run-to-run spread (several profiles
# in one call); then the twelfth session's list (30B-A3B bench, hybrid prefill strides, invariant step, tp).
# Fifteenth session (2026-12-03, one H200; the device came after ~50 minutes of refusals and its start cost ~11 minutes
# of the 30): the L2 prefetch experiment (commit 47e5e6c, reverted after) 278 s for CUDA tests + its chain sweep (23 s)
# + four profiles (31-38 s each); the bench with the static peer at b1/b32 248 s at 0.8B, 283 s at 9B (HF's compiled
# b32 step finished). Calls made:
#   STEPS=fused FUSED_TESTS="-n 4 tests/test_prefetch.py tests/test_fused_linear.py tests/test_parity.py" FUSED_SWEEP=0
#     GEMV_SWEEP=0 GEMV_NORM_CHAIN=0 PREFETCH_CHAIN=1 FUSED_MODELS="qwen3-0.6b qwen3-8b" FUSED_MODES="fused_linear=triton,
#     POCKETLAB_PREFETCH_MIB=0 fused_linear=triton" BUDGET_S=550                                      (at 47e5e6c)
#   STEPS=bench MODELS=qwen3.5-0.8b PEER_MODES=static BENCH_ARGS="--no-warm --batch-sizes 1,32 --prompt-lens 4096
#     --peer-batch-sizes 1,32 --skip latency,serving" BENCH_CAP_S=330 BUDGET_S=350   (then MODELS=qwen3.5-9b, cap 440)
# Still owed: profiles at qwen3.5-0.8b and qwen3.5-9b after the per-head gates (commit 8b6a7cf: the torch elementwise
# copy, 8 a step at b1 and 32 at b32 at 9B, should be gone; STEPS=fused FUSED_TESTS="" FUSED_SWEEP=0 GEMV_SWEEP=0
# GEMV_NORM_CHAIN=0 FUSED_MODELS="qwen3.5-0.8b qwen3.5-9b" FUSED_MODES=fused_linear=triton); the b1 run-to-run spread
# (several profiles in one call); b32 at 8B and 9B (1.81x, 1.53x of HF: a profile's gpu_span_us against wall_us says
# how much is the host's; the norms as their own kernels at b2-64 and cuBLAS for qkv are where to look); then the
# twelfth session's list.
# Sixteenth session (2026-12-03, one H200; one refusal cost 2 minutes): profiles 53-126 s with the 4,096 prefill row,
# 21-96 s without (FUSED_PREFILL=""); CUDA tests of the fused linear + decode attention (-n 4) 90-100 s; the decode
# attention split sweep 63 s; the 8B bench with the static peer at b1/b32 196 s. Calls made:
#   STEPS=fused FUSED_TESTS="" FUSED_SWEEP=0 GEMV_SWEEP=0 GEMV_NORM_CHAIN=0 FUSED_MODELS="qwen3.5-9b qwen3-8b
#     qwen3.5-0.8b" FUSED_MODES=fused_linear=triton BUDGET_S=420
#   STEPS=fused FUSED_TESTS="-n 4 tests/test_fused_linear.py tests/test_decode_attention.py" ATTENTION_SWEEP=1 (first
#     call only) FUSED_SWEEP=0 GEMV_SWEEP=0 GEMV_NORM_CHAIN=0 FUSED_MODELS="qwen3-8b qwen3.5-9b qwen3-0.6b"
#     FUSED_BATCHES=1,32 FUSED_PREFILL="" FUSED_MODES="fused_linear=triton fused_linear=triton,POCKETLAB_FOLD_NORM=0"
#     (the norm folded into the matmul, a switch of that uncommitted code) BUDGET_S=470
#   STEPS=bench MODELS=qwen3-8b PEER_MODES=static BENCH_ARGS="--no-warm --batch-sizes 1,32 --prompt-lens 4096
#     --peer-batch-sizes 1,32 --skip latency,serving" BENCH_CAP_S=225 BUDGET_S=235
# Still owed: b1 profiles with one-block attention splits back on the static loop (written after the device time ran
# out: STEPS=fused FUSED_TESTS="-n 4 tests/test_decode_attention.py" FUSED_MODELS="qwen3-0.6b qwen3-8b"
# FUSED_MODES=fused_linear=triton); a second split sweep (ATTENTION_SWEEP=1) before any rule by batch and length; the
# bench at the other three shapes; then the twelfth session's list.
# Seventeenth session (2026-12-03, one H200, 30 minutes, all used): CUDA tests of the fused linear + decode attention
# (-n 4) 80 s; b1-only profiles without prefill 21-78 s (the 35B-A3B 4-layer preset the slowest); tests/test_moe.py
# on CUDA 74 s; moe_bench 20-48 s per shape (with --sweep at 1-8 tokens); the MoE model bench without the HF peer
# (b1/b32, prefill 4,096) 44 s at 30B-A3B, 58 s at 35B-A3B; with the static peer at b1/b32 233 s at 30B-A3B. Calls:
#   STEPS="fused moe" FUSED_TESTS="-n 4 tests/test_fused_linear.py tests/test_decode_attention.py" FUSED_SWEEP=0
#     GEMV_SWEEP=0 GEMV_NORM_CHAIN=0 FUSED_MODELS="qwen3-30b-a3b-4-layers qwen3.5-35b-a3b-4-layers" FUSED_BATCHES=1
#     FUSED_PREFILL="" FUSED_MODES="fused_linear=triton fused_linear=triton,moe_gemv_tokens=0" MOE_ARGS="--tokens
#     1,2,4,8 --sweep" BUDGET_S=420   (then STEPS=fused for qwen3-0.6b qwen3-8b at b1, one call)
#   STEPS="moe bench" MOE_TESTS="tests/test_moe.py -k gemv_experts" MODELS="qwen3-30b-a3b qwen3.5-35b-a3b"
#     BENCH_ARGS="--no-peer --no-warm --batch-sizes 1,32 --prompt-lens 4096 --skip latency,serving" BENCH_CAP_S=230
#   STEPS=bench MODELS=qwen3-30b-a3b PEER_MODES=static BENCH_ARGS="--no-warm --batch-sizes 1,32 --prompt-lens 4096
#     --peer-batch-sizes 1,32 --skip latency,serving" BENCH_CAP_S=390 BUDGET_S=400
# Still owed: the 35B-A3B bench with the static peer (one call, cap ~540 s); the 4-layer MoE profiles with the swept
# moe_gemv tiles; a second decode-attention split sweep; the bench at 0.6B, 0.8B and 9B; the twelfth session's list.
# Eighteenth session (2026-12-03, one H200, four calls, 334 s of the 30 minutes left): CUDA tests of the fused
# linear (-n 4) 69-79 s, with parity 79 s; the GEMV forms sweep over ten shapes 44-65 s; b1 profiles without prefill
# 18-27 s; the 8B bench with the static peer at b1/b32 180 s. The same launch timed up to 20% apart in two calls: compare within a call.
# Calls made:
#   STEPS=fused FUSED_TESTS="tests/test_fused_linear.py" FUSED_SWEEP=0 GEMV_NORM_CHAIN=0 GEMV_SWEEP_ARGS="--forms
#     --shapes 0.6b_qkv,0.6b_o,0.6b_gate,0.6b_down,8b_qkv,8b_o,8b_gate,8b_down,30b" GEMV_SWEEP_FILE=gemv-forms-sweep
#     FUSED_MODELS="qwen3-8b qwen3-0.6b" FUSED_BATCHES=1 FUSED_PREFILL="" FUSED_MODES="fused_linear=triton
#     fused_linear=triton,<the persistent experiment's switch>" BUDGET_S=555
#   STEPS="fused bench" (the same, + tests/test_parity.py, qwen3-30b-a3b-4-layers) MODELS=qwen3-8b PEER_MODES=static
#     BENCH_ARGS="--no-warm --batch-sizes 1,32 --prompt-lens 4096 --peer-batch-sizes 1,32 --skip latency,serving"
#     BENCH_CAP_S=220 BUDGET_S=545
#   STEPS=fused FUSED_TESTS="" FUSED_SWEEP=0 GEMV_SWEEP=0 GEMV_NORM_CHAIN=0 FUSED_MODELS=qwen3-0.6b FUSED_BATCHES=1
#     FUSED_PREFILL="" FUSED_MODES="<three rules of a temporary switch, each twice>" BUDGET_S=300   (174 s: the
#     same 0.6B b1 profile spread 931-1,043 us inside one call)
# Still owed: the b1 run-to-run spread (the same profile three times in one call, and on two machines); the 35B-A3B
# bench with the static peer; the bench at 0.6B, 0.8B and 9B; the seventeenth session's list.
# Nineteenth session (2026-12-04, one H200, five calls, one taken back before it finished; 186 s of the 30 minutes
# left): 4-layer MoE profiles at b1 without prefill 15-38 s (35B-A3B's first 64-81 s: compiles), with the 4,096
# prefill 100 s; tests/test_moe.py on CUDA (-n 4) 75-81 s; the 35B-A3B bench with the static peer 421 s. Calls made:
#   STEPS="moe fused" MOE_TESTS="-n 4 tests/test_moe.py" MOE_MODELS="" FUSED_TESTS="" FUSED_SWEEP=0 GEMV_SWEEP=0
#     GEMV_NORM_CHAIN=0 FUSED_MODELS="qwen3-30b-a3b-4-layers qwen3.5-35b-a3b-4-layers qwen3-30b-a3b-4-layers"
#     FUSED_BATCHES=1 FUSED_PREFILL="" FUSED_MODES="fused_linear=triton,<temporary switch> fused_linear=triton"
#     BUDGET_S=540                                                   (at 13d025e: routing inside gate_up, reverted)
#   STEPS=bench MODELS=qwen3.5-35b-a3b PEER_MODES=static BENCH_ARGS="--no-warm --batch-sizes 1,32 --prompt-lens 4096
#     --peer-batch-sizes 1,32 --skip latency,serving" BENCH_CAP_S=540 BUDGET_S=565
#   the first call's profiles with FUSED_MODES="fused_linear=triton fused_linear=triton,<temporary switch>
#     fused_linear=triton,POCKETLAB_PDL=0" BUDGET_S=300, then `python -m pocketlab.tools.profile --model
#     qwen3.5-35b-a3b-4-layers --batch-sizes 1 --prefill-lens 4096 --steps 5 --engine-option checkpoint_stride=S`
#     for S = 512, 2048
#   STEPS=moe MOE_TESTS="-n 4 tests/test_moe.py" MOE_MODELS="" BUDGET_S=200
# Still owed: the 30B-A3B and 35B-A3B model bench at b1 with the routing kernel under PDL; the bench at 0.6B, 0.8B
# and 9B with the static peer; the seventeenth session's list (invariant step, STEPS=tp on two GPUs).
# Twentieth session (2026-12-04, one H200, four calls, the device time used to the last 263 s): tests/test_moe.py on
# CUDA (-n 4) 75-112 s; `tools.ab` (variants alternated in one process) 27 s at 30B-A3B for 5 variants x 4 rounds,
# 75-108 s at 35B-A3B (compiles), 20 s at 0.6B; the MoE model bench without the peer 63 s (30B) and 82 s (35B); a
# 4-layer 35B profile with prefill 106 s in a fresh machine's first process. Calls made:
#   POCKETLAB_MOE_EARLY=1 POCKETLAB_ATTN_EARLY=1 POCKETLAB_ROUTE_WARPS=1 STEPS=tests TESTS="-x tests/test_moe.py
#     tests/test_decode_attention.py" BUDGET_S=150, then STEPS=ab AB_MODELS="qwen3-30b-a3b qwen3.5-35b-a3b qwen3-0.6b"
#     AB_VARIANTS="<each switch alone; all three>" AB_ARGS="--rounds 4 --steps 30" AB_FILE=early-loads BUDGET_S=400
#     (switches of commit 0fa0aab)
#   the same for POCKETLAB_ROUTER_ROUTES=1 (41242c2, reverted) and POCKETLAB_SHARED_INSIDE=1 (d2d2d5d), then
#     STEPS=bench MODELS="qwen3-30b-a3b qwen3.5-35b-a3b" BENCH_ARGS="--no-peer --no-warm --batch-sizes 1,32
#     --prompt-lens 4096 --skip latency,serving" BENCH_CAP_S=150
#   STEPS=fused FUSED_MODELS=qwen3.5-35b-a3b-4-layers FUSED_MODES=fused_linear=triton FUSED_BATCHES=1
#     FUSED_PREFILL=4096, then the session-start tree (git archive b5ecd25 into .oldtree, carried as an untracked
#     folder) through `python -m pocketlab.tools.profile` with the same arguments
# Still owed then: that pair again in the other order with --host 12 (the 35B-A3B prefill's host time, README); the MoE
# bench at b1/b32 with the static peer after this session's changes; the eighteenth/nineteenth lists (the bench at
# 0.6B, 0.8B and 9B with the static peer, the invariant step, STEPS=tp on two GPUs).
# Twenty-first session (2026-12-04, one H200, five calls, one lost to a bug of a throwaway script; 58 s left): CUDA
# tests of the Gated DeltaNet, prefix cache and checkpoint-variant files (-n 4) 87-143 s; `tools.ab --prefill 4096`
# (4 rounds x 3 prefills, 2 variants) 109 s at 0.8B, 97 s at the 35B-A3B 4-layer preset, 50 s at 9B; the
# prefill-only bench without peer 98 s (0.8B), 85 s (9B), 55 s (35B-A3B). Calls made:
#   STEPS="tests ab" TESTS="tests/test_gated_delta.py tests/test_prefix_cache.py tests/test_checkpoint_variants.py"
#     AB_MODELS="qwen3.5-0.8b qwen3.5-35b-a3b-4-layers qwen3.5-9b" AB_VARIANTS=";POCKETLAB_FLA_SEGMENTS=0"
#     AB_ARGS="--prefill 4096 --rounds 4 --steps 3 --warm 2" AB_FILE=fla-segments BUDGET_S=540 (switch of b2e1428)
#   STEPS=none, then a cProfile of one 4,096-token prefill at qwen3.5-0.8b and the 35B-A3B 4-layer preset
#     (pocketlab.tools.host_time's profile_call, cumulative and own time; not kept)
#   STEPS="tests bench" TESTS="-n 4 <the same three files>" MODELS="qwen3.5-0.8b qwen3.5-9b qwen3.5-35b-a3b"
#     BENCH_ARGS="--no-peer --no-warm --skip decode,latency,serving --prompt-lens 512,4096" BENCH_CAP_S=170
#   POCKETLAB_DTYPE=bfloat16 STEPS="tests bench" TESTS="-n 4 tests/test_prefix_cache.py" TESTS_CAP_S=100
#     MODELS=qwen3-30b-a3b PEER_MODES=static BENCH_ARGS="--no-warm --batch-sizes 1,32 --prompt-lens 4096
#     --peer-batch-sizes 1,32 --skip latency,serving" BENCH_CAP_S=280 BUDGET_S=390: both capped (the bf16 prefix-cache
#     tests after 4 passed, so no verdict; the bench while HF compiled batch 32, its b1 figures kept). Give the bf16
#     engine tests 300 s and the 30B bench with the peer 330 s.
# Twenty-second session (2026-12-04, one H200, four calls, 327 s left): CUDA tests of the fused-linear, linear-decode,
# Gated DeltaNet and parity files 117-141 s; `tools.ab` at b1 (4 variants) 84 s at 0.8B, 71 s at 9B, 36 s at the
# 35B-A3B 4-layer preset, at b1 and b32 (2 variants) 68 / 92 / 39 s; the bf16 prefix-cache tests 111 s (4 fail:
# README); a 9B b1 profile 30-86 s (the first process of a call is the slow one). Calls made:
#   STEPS="tests ab" TESTS="<those four files>" AB_MODELS="qwen3.5-0.8b qwen3.5-9b qwen3.5-35b-a3b-4-layers"
#     AB_VARIANTS=";POCKETLAB_CONV_FOLD=0,POCKETLAB_NORM_FOLD=0;POCKETLAB_CONV_FOLD=0;POCKETLAB_NORM_FOLD=0"
#     AB_ARGS="--batch-sizes 1 --rounds 4 --steps 30" AB_FILE=gdn-folds AB_CAP_S=120 BUDGET_S=540  (uncommitted forms)
#   the same with AB_VARIANTS=";POCKETLAB_CONV_FOLD=0" AB_ARGS="--batch-sizes 1,32 ..." AB_FILE=conv-fold (25c7fe8)
#   POCKETLAB_DTYPE=bfloat16 STEPS=tests TESTS=tests/test_prefix_cache.py TESTS_CAP_S=200 BUDGET_S=260 OUT=$OUT/a, then
#     STEPS="tests fused" TESTS="tests/test_gated_delta.py tests/test_linear_decode.py" FUSED_TESTS= FUSED_SWEEP=0
#     GEMV_SWEEP=0 GEMV_NORM_CHAIN=0 FUSED_MODELS=qwen3.5-9b FUSED_MODES="fused_linear=triton
#     fused_linear=triton,POCKETLAB_CONV_FOLD=0" FUSED_BATCHES=1 FUSED_PREFILL="" BUDGET_S=290 OUT=$OUT/b
#   STEPS=fused (the same, FUSED_MODES in the order without, with, without) BUDGET_S=300
# Still owed: the 35B-A3B bench with the static peer and the 30B-A3B's batch-32 peer; the bench at 0.6B, 0.8B and 9B
# with the static peer (decode and prefill in one run); the invariant step; STEPS=tp on two GPUs; the bf16 prefix-cache
# file on CUDA again, now in the batch-invariant mode (POCKETLAB_DTYPE=bfloat16 STEPS=tests
# TESTS=tests/test_prefix_cache.py TESTS_CAP_S=300: the invariant kernels compile for minutes).
# Twenty-third session (2026-12-04, one H200, two calls, then no device was lent; 1,397 s of the 30 minutes left): the
# bf16 prefix-cache file on CUDA in the batch-invariant form 72 s (39 passed); the stage-chain experiment 8-45 s per
# launch shape (commit fd09efc; each in its own process, under `timeout`, as a grid barrier whose programs are not all
# resident would hang). Calls made:
#   (timeout 60 python3 -m pocketlab.layers.stage_chain --shape 0.6b; timeout 150 ... --shape 8b --layers 36), then
#     POCKETLAB_DTYPE=bfloat16 STEPS=tests TESTS=tests/test_prefix_cache.py TESTS_CAP_S=300 BUDGET_S=330 OUT=$OUT/pc
#   for t in <launch shapes>; do timeout 45 python3 -m pocketlab.layers.stage_chain --shape 0.6b --tiles $t; done
#     (then --shape 8b --layers 36, timeout 80)
# Still owed: where prompts should take the in-place kernels (EngineOptions.linear_in_place_tokens, default 0; tools.ab
# now gives a variant with engine options an engine of its own over the same weights), one call, two lanes:
#   STEPS=ab AB_MODELS="qwen3.5-0.8b qwen3.5-9b qwen3.5-35b-a3b-4-layers" AB_VARIANTS=";linear_in_place_tokens=2048;
#     linear_in_place_tokens=512" AB_ARGS="--prefill 512 --rounds 4 --steps 3 --warm 2" AB_FILE=in-place-prompt-512
#     AB_CAP_S=100 OUT=$OUT/a, then the same with --prefill 4096 --rounds 3 and AB_FILE=in-place-prompt-4096 (OUT=$OUT/b)
# and the CUDA tests with the option on (tests/test_linear_decode.py tests/test_gated_delta.py); then the twenty-second
# session's list (35B-A3B bench with the static peer, the bench at 0.6B, 0.8B and 9B with the static peer, the
# invariant step, STEPS=tp on two GPUs).
# Twenty-fourth session (2026-12-04): no device lent. Built: EngineOptions.prefill_graph_tokens (prompt forwards
# replay graphs; default 0). Owed first, one call: its real captures and the in-place option's tests, then both
# options alternated in one process per model at 128 and 512 tokens (each variant its own engine):
#   STEPS="tests ab" TESTS="tests/test_graphs.py tests/test_warmup.py tests/test_linear_decode.py
#     tests/test_gated_delta.py" TESTS_CAP_S=150 AB_MODELS="qwen3-0.6b qwen3.5-0.8b qwen3-8b qwen3.5-9b"
#     AB_VARIANTS=";prefill_graph_tokens=512;linear_in_place_tokens=512;prefill_graph_tokens=512,
#     linear_in_place_tokens=512" AB_ARGS="--prefill 128 --rounds 4 --steps 5 --warm 2" AB_FILE=prompt-graphs-128
#     AB_CAP_S=90 BUDGET_S=560, then the ab step alone with --prefill 512 (AB_FILE=prompt-graphs-512, OUT=$OUT/b)
# then the host-bound MoE prefill the same way: AB_MODELS="qwen3-30b-a3b-4-layers qwen3.5-35b-a3b-4-layers"
#   AB_VARIANTS=";prefill_graph_tokens=2048;checkpoint_stride=2048;prefill_graph_tokens=2048,checkpoint_stride=2048"
#   AB_ARGS="--prefill 4096 --rounds 3 --steps 3 --warm 2" (a hybrid piece with a checkpoint inside runs eagerly)
# then the serving trace's time to first token (now in the bench's serving section) with and without prompt graphs:
#   STEPS=bench MODELS=qwen3-0.6b PEER_MODES="" BENCH_ARGS="--no-peer --skip decode,latency,prefill
#     --engine-option prefill_graph_tokens=512" (and without the option, OUT=$OUT/b)
# then the in-place A/B at 4,096 tokens and the lists above; choose both defaults from what these say.
# Twenty-fifth session (2026-12-05): no device lent. Built: layers/gemv_tma.py, the one-row GEMV with its weight
# streamed through a TMA ring (Triton 3.6 compiles the descriptor loads of a pipelined loop to UTMALDG + mbarriers at
# ~48 registers; checked on the CPU by compiling for sm_90). Owed, in the first call beside the above (~2-4 min):
#   STEPS=fused FUSED_TESTS="tests/test_fused_linear.py" FUSED_SWEEP=0 GEMV_NORM_CHAIN=0 FUSED_MODELS=""
#     GEMV_SWEEP_ARGS=--tma-chain GEMV_SWEEP_FILE=gemv-tma-chain GEMV_SWEEP_CAP_S=300
#   and the MoE experts' TMA form (path gemv_tma, its rings in the sweep): STEPS=moe MOE_TESTS="" MOE_MODELS=
#     "qwen3-30b-a3b qwen3.5-35b-a3b" MOE_ARGS="--sweep --tokens 1"
#   and the engine with its one-row GEMVs through the ring (the best chain ring as n:k:stages in place of 1):
#   STEPS=ab AB_MODELS="qwen3-0.6b qwen3-8b qwen3.5-9b" AB_VARIANTS=";POCKETLAB_GEMV_TMA=1" AB_ARGS="--batch-sizes 1
#     --rounds 4 --steps 30" AB_FILE=gemv-tma AB_CAP_S=100
#   and the MoE engines with their decode experts through the ring (norm and shared expert inside):
#   STEPS=ab AB_MODELS="qwen3-30b-a3b-4-layers qwen3.5-35b-a3b-4-layers" AB_VARIANTS=";POCKETLAB_MOE_TMA=1;
#     POCKETLAB_MOE_TMA=1,POCKETLAB_GEMV_TMA=1" AB_ARGS="--batch-sizes 1 --rounds 4 --steps 30" AB_FILE=moe-tma
# then, where a ring wins, make it the kernel's launch there (and the bench at the full MoE shapes says the b1 roofline).
# Calls made late in the session (one H200, 5 calls, ~17 min of device time): the TMA and prompt-graph CUDA tests
#   (tests/test_fused_linear.py tests/test_moe.py -k tma; tests/test_graphs.py tests/test_warmup.py -k prompt) and
#   gemv_sweep --tma-chain in one call; then STEPS=ab with AB_VARIANTS=";POCKETLAB_GEMV_TMA=16:256:4;
#   POCKETLAB_GEMV_TMA=8:256:6" (qwen3-8b qwen3.5-0.8b qwen3-0.6b) and ";POCKETLAB_MOE_TMA=1;POCKETLAB_MOE_TMA=8:256:4"
#   (the two MoE 4-layer presets); then the prompt-graph A/B above at --prefill 128 (0.8B, 0.6B) and 512 (all four).
# Results in reports/performance-history.md. With prefill_graph_tokens=512 as the default, the CUDA run of
#   POCKETLAB_DEVICE=cuda pytest -n 6 tests/test_graphs.py tests/test_warmup.py tests/test_generate.py tests/test_slots.py
#   tests/test_speculative.py tests/test_prefix_cache.py tests/test_interrupts.py
# failed test_graphed_mtp_drafts_equal_eager_drafts, test_gpu_decode_graphs_hold_no_torch_compile_graph[auto] and
# 10 test_interrupt_at_every_step cases (6 of them fail with the option off too); the default went back to 0. Owed:
# those failures understood (then the default 512), moe_bench --sweep --tokens 1, the MoE prefill A/B, the serving
# TTFT, the older list.
# Twenty-sixth session (2026-12-05, one H200 lent rarely): prefill_graph_tokens=512 is the default. Calls made:
#   STEPS="tests fused" TESTS="-n 6 tests/test_graphs.py tests/test_warmup.py tests/test_generate.py tests/test_slots.py
#     tests/test_speculative.py tests/test_prefix_cache.py tests/test_interrupts.py" TESTS_CAP_S=320 FUSED_TESTS="-n 4
#     tests/test_fused_linear.py tests/test_moe.py -k tma" FUSED_SWEEP=0 GEMV_NORM_CHAIN=0 FUSED_MODELS=""
#     GEMV_SWEEP_ARGS=--tma-chain GEMV_SWEEP_FILE=gemv-tma-chain GEMV_SWEEP_CAP_S=180 BUDGET_S=560   (103 + 94 + 34 s)
#   then STEPS=ab AB_MODELS="qwen3-0.6b qwen3.5-0.8b qwen3.5-9b qwen3-8b" AB_VARIANTS=";prefill_graph_tokens=0"
#     AB_ARGS="--prefill 512 --rounds 4 --steps 5 --warm 2" AB_FILE=prompt-graphs-512-eager-chains AB_CAP_S=100
#     (22-78 s a model), and STEPS=ab AB_MODELS="qwen3-0.6b qwen3.5-0.8b" AB_VARIANTS=";POCKETLAB_GEMV_TMA=16:256:4;
#     POCKETLAB_GEMV_TMA=8:256:6" AB_ARGS="--batch-sizes 1 --rounds 6 --steps 30" AB_FILE=gemv-tma-first-tiles
#     (30-35 s a model), in one call (two OUT folders).
# Owed, first (the default CUDA kernels now run a prompt's q/k norms, RoPE and K/V write in the invariant mode's row
#   kernel, commit cdb6347, not yet run on CUDA in the default mode):
#   STEPS="tests ab" TESTS="-n 8 tests/test_graphs.py tests/test_parity.py tests/test_speculative.py
#     tests/test_prefix_cache.py" TESTS_CAP_S=240 AB_MODELS="qwen3-0.6b qwen3-8b qwen3.5-0.8b" AB_VARIANTS=
#     ";prefill_graph_tokens=0" AB_ARGS="--prefill 512 --rounds 4 --steps 5 --warm 2" AB_FILE=prompt-graphs-512-row-rotate
#   then the 4,096-token prefill at 8B and 9B (STEPS=bench PEER_MODES=static BENCH_ARGS="--skip decode,latency,serving")
#   against 128.9 ms and 159.4 ms; the rings at 8B and 9B in the engine with 8:256:6; warm-up time and the serving
#   trace's TTFT with and without prompt graphs (STEPS=bench MODELS=qwen3-0.6b PEER_MODES="" BENCH_ARGS="--no-peer
#   --skip decode,latency,prefill", then with --engine-option prefill_graph_tokens=0); STEPS=tp on two GPUs (its
#   prompts now replay graphs that capture NCCL's all-reduce, as decode graphs do); then the twenty-fifth session's
#   list above.
# Twenty-seventh session (2026-12-05, no device lent): three Qwen3.5 decode folds and the experts' down ring, untimed.
# Twenty-eighth session (2026-12-05, two calls on one H100; then no machine came): the twenty-seventh's first two
#   calls ran (470 s and 310 s): the conv fold lost and is removed, the norm and gate folds are within the noise and
#   stay, the one-row ring won again at 0.6B/0.8B and is the default for weights up to 24 MiB on sm_90, the experts'
#   down ring lost. Seen: the CUDA tests of six files (-n 8) 121 s; A/B 30-40 s a small model at 4-6 rounds, 95 s
#   at 9B with b32. Owed next, in order:
#   1. (~6 min) the CUDA tests with the ring on by default, then the ring's A/B against POCKETLAB_GEMV_TMA=0 at the
#      shapes it now reaches (the MoE presets' attention weights are 16-20 MiB: unmeasured there):
#      STEPS="tests ab" TESTS="-n 8 tests/test_fused_linear.py tests/test_linear_decode.py tests/test_graphs.py
#        tests/test_parity.py tests/test_speculative.py tests/test_slots.py" TESTS_CAP_S=220 AB_MODELS="qwen3.5-0.8b
#        qwen3-0.6b qwen3-30b-a3b-4-layers qwen3.5-35b-a3b-4-layers" AB_VARIANTS="POCKETLAB_GEMV_TMA=0;" AB_ARGS=
#        "--batch-sizes 1 --rounds 6 --steps 30" AB_FILE=one-row-ring-default AB_CAP_S=70 BUDGET_S=480
#      (tools.ab now ends with each variant's greedy decode against the baseline's: the ring's first-step logits
#      should differ only by rounding, ~1e-3 of the largest, for the default to stand)
#   2. the bench at the four dense/hybrid shapes with the static peer (b1/b32) on an H200, for the README's tables;
#   3. the twenty-sixth's list (prompt-graphs-512-row-rotate, 4,096-token prefill at 8B/9B, warm-up/TTFT, tp).
# Twenty-ninth session (2026-12-05, one H200, three calls after half an hour of failed starts; 174 s of the 30
#   minutes left): the twenty-eighth's item 1 with a third variant (403 s): the CUDA tests (-n 8) 136 s and passing;
#   A/B 25-30 s a shape at 5 rounds b1 (9B 64 s; 0.8B past its 75 s cap: its first compiles, no table). Then the
#   bench at 0.6B + 8B (313 s: 123 + 152 s) and at 0.8B (226 s: 188 s). Calls made:
#   STEPS="tests ab" TESTS="<the six files of item 1>" TESTS_CAP_S=200 AB_MODELS="qwen3.5-0.8b qwen3-0.6b qwen3-8b
#     qwen3.5-9b qwen3-30b-a3b-4-layers" AB_VARIANTS=";POCKETLAB_GEMV_TMA=0;POCKETLAB_GEMV_MAX_MIB=256" AB_ARGS=
#     "--batch-sizes 1 --rounds 5 --steps 30" AB_FILE=ring-default-gemv-max AB_CAP_S=75 BUDGET_S=545
#   STEPS=bench MODELS="qwen3-0.6b qwen3-8b" PEER_MODES=static BENCH_ARGS="--no-warm --batch-sizes 1,32 --prompt-lens
#     4096 --peer-batch-sizes 1,32 --skip latency,serving" BENCH_CAP_S=270 BUDGET_S=560   (then MODELS=qwen3.5-0.8b,
#     BENCH_CAP_S=320 BUDGET_S=345)
#   Owed next, in order:
#   1. the same bench at 9B (cap ~300 s alone), for the README's last row (fifteenth session's figures now);
#   2. the 0.6B prefill of 4,096 tokens, 56.5 -> 73.7 ms since the fourteenth session: host time; `python -m
#      pocketlab.tools.profile --model qwen3-0.6b --batch-sizes 1 --prefill-lens 4096 --host 12` says where;
#   3. the 0.8B ring A/B with a cap of 120 s (AB_MODELS=qwen3.5-0.8b AB_VARIANTS="POCKETLAB_GEMV_TMA=0;");
#   4. the twenty-sixth's list (prompt-graphs-512-row-rotate, 4,096-token prefill at 9B, warm-up/TTFT, tp).
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
#   FUSED_TESTS [the fused linear's tests + parity]  FUSED_SWEEP [1]  FUSED_MODELS [qwen3-0.6b qwen3-8b]
#   FUSED_BATCHES [1,32]  FUSED_PREFILL [4096] (empty: no prefill row)
#   FUSED_MODES [fused_linear=torch fused_linear=triton,gemv_rows=0 fused_linear=triton]
#                    the fused step: CUDA tests, the fused matmul's launch sweep (FUSED_SWEEP), the GEMV's (GEMV_SWEEP
#                    [1]; GEMV_SWEEP_ARGS [] e.g. "--forms --shapes 8b,30b", GEMV_SWEEP_FILE [gemv-sweep],
#                    GEMV_SWEEP_CAP_S [300]), the pre-norm's cost own vs folded (GEMV_NORM_CHAIN [1]), kernel tables
#                    per mode (engine options or env vars such as POCKETLAB_PDL=0, comma-separated);
#                    ATTENTION_SWEEP [0] 1: the decode attention's split counts (layers.decode_attention_sweep;
#                    ATTENTION_SWEEP_ARGS [] e.g. "--batches 1,8,32")
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
#                    the tables, AB_CAP_S [240] per model
#   REPORT_NOTEBOOKS [01,02,03,04,05,06,07]  the reports step's notebooks, in this order, each a step of its own
#   TTFT_STRIDES     [512]              checkpoint strides the TTFT table is measured at, comma-separated
#   PEER_MODES       [eager,static]     HF peers (static = static cache + HF's compiled decode step)
#   EAGER_NEW_TOKENS [32]               HF eager decodes ~14 tok/s at batch 1: capped (recorded in the JSON)
#   PEER_REPEATS     [2]
#   BENCH_ARGS       []                 extra `python -m pocketlab.tools.bench` arguments for every model
#   WRITE_BASELINE   [0]                1: overwrite reports/baseline/cuda-<model>.json from this run's bench
#   BUDGET_S         [480]              wall-clock budget; a step gets min(its cap, what is left)
#   BENCH_CAP_S      [200]  TESTS_CAP_S [240]  REPORTS_CAP_S [150]  (reports' time is reserved while benching)
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
TP_MODELS=${TP_MODELS-qwen3-8b qwen3.5-9b}
TP2_MODELS=${TP2_MODELS-qwen3.5-27b-shape}
INVARIANT_TESTS=${INVARIANT_TESTS-tests/test_batch_invariant.py tests/test_invariant_kernels.py tests/test_invariant_attention.py tests/test_linear_decode.py}
INVARIANT_TIMINGS=${INVARIANT_TIMINGS:-1}
INVARIANT_SWEEP=${INVARIANT_SWEEP:-0}
INVARIANT_PROFILE=${INVARIANT_PROFILE-}
FUSED_TESTS=${FUSED_TESTS-tests/test_fused_linear.py tests/test_invariant_kernels.py tests/test_parity.py}
FUSED_SWEEP=${FUSED_SWEEP:-1}
FUSED_MODELS=${FUSED_MODELS-qwen3-0.6b qwen3-8b}
FUSED_BATCHES=${FUSED_BATCHES:-1,32}
FUSED_PREFILL=${FUSED_PREFILL-4096}
ATTENTION_SWEEP=${ATTENTION_SWEEP:-0}
ATTENTION_SWEEP_ARGS=${ATTENTION_SWEEP_ARGS:-}
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
BENCH_CAP_S=${BENCH_CAP_S:-200}
TESTS_CAP_S=${TESTS_CAP_S:-240}
TESTS=${TESTS:-tests}
REPORTS_CAP_S=${REPORTS_CAP_S:-150}
REPORTS_PARALLEL=${REPORTS_PARALLEL:-0}
START=$(date +%s)
mkdir -p "$OUT" reports/bench
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

# -- environment: the carried wheels (papermill, nbval, fla, ...) and pocketlab from this checkout --------
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
      --out "reports/bench/cuda-$m.json" $BENCH_ARGS
  done
fi

# -- 3. perf baselines from this run's bench JSON, only where none is committed (or WRITE_BASELINE=1) ---
if wants baseline; then
  for m in $MODELS; do
    if [ -f "reports/bench/cuda-$m.json" ] && { [ "$WRITE_BASELINE" = 1 ] || [ ! -f "reports/baseline/cuda-$m.json" ]; }; then
      step "baseline $m (from this run's bench)" 60 0 python3 -m pocketlab.verify.perf --write-baseline \
        --device cuda --dtype bfloat16 --model "$m" --from-bench "reports/bench/cuda-$m.json"
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
    "python3 -m pocketlab.layers.invariant.sweep --fused | tee reports/gpu/fused-linear-sweep-$GPU.txt"
  [ "$GEMV_SWEEP" = 1 ] && step "gemv launches (sweep)" "$GEMV_SWEEP_CAP_S" "$reserve" bash -o pipefail -c \
    "TQDM_DISABLE=1 python3 -m pocketlab.layers.gemv_sweep $GEMV_SWEEP_ARGS | tee reports/gpu/$GEMV_SWEEP_FILE-$GPU.txt"
  [ "$GEMV_NORM_CHAIN" = 1 ] && step "gemv pre-norm, own kernel vs folded" 120 "$reserve" bash -o pipefail -c \
    "python3 -m pocketlab.layers.gemv_sweep --norm-chain | tee reports/gpu/gemv-norm-chain-$GPU.txt"
  [ "$ATTENTION_SWEEP" = 1 ] && step "decode attention splits (sweep)" 200 "$reserve" bash -o pipefail -c \
    "TQDM_DISABLE=1 python3 -m pocketlab.layers.decode_attention_sweep $ATTENTION_SWEEP_ARGS | tee reports/gpu/decode-attention-splits-$GPU.txt"
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

# -- 6. reports at real shape; the perf notebook reuses this run's bench JSON (POCKETLAB_BENCH_DIR) -----
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
        env POCKETLAB_BENCH_DIR="$PWD/reports/bench" "${cmd[@]}" &
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
