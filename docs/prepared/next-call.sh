#!/usr/bin/env bash
# The next device calls as steps, one a word (docs/KERNELS.md, fortieth to forty-second sessions, says why each).
# Here first (a CUDA build in build/, .deps staged): bash docs/prepared/next-call.sh pack (~6 min with ccache cold)
# On the device, carrying .deps and build-variants, in the order of what matters most:
#   bash docs/prepared/next-call.sh mma-probe kpairs suite  (~360 s on an H100, 550 s at most)
#   bash docs/prepared/next-call.sh clocks clocks-kpairs loads  (~500 s)
#   bash docs/prepared/next-call.sh widths profiles         (~400 s)
#   bash docs/prepared/next-call.sh table-base              (an H200 only: the targets are the H200's)
# kshort is kpairs cut to fit ~200 s (the pairs alone). Logs under /tmp/w, all back as $OUT/w.tar.xz; each step
# is bounded by timeout, so the archive is written before the call's limit.
set -u
export NCCL_NVLS_ENABLE=0
W=/tmp/w
mkdir -p "$W"
T="test_combine_gpu test_dtype_gpu test_fused_quantize_gpu test_moe_gpu test_nccl_gpu test_quantize_gpu test_route_gpu test_sort_pairs_gpu"
V=scripts/device-variant-check
P=docs/prepared
# The clock trees: the clocks on main, and on the decode K pairs (the clocks' one hunk that
# differs, the K loop's end, is a patch of its own on each).
CLOCK_MAIN=$P/timing-cta-clock.patch+$P/timing-cta-clock-k-loop.patch
CLOCK_PAIRS=$P/decode-gemm1-k-pairs.patch+$P/timing-cta-clock.patch+$P/timing-cta-clock-k-loop-on-k-pairs.patch
# A clock step: its output folder, tree, cases and time limit.
clock_step() {
  OUT=$W/$1 PREBUILT=build-variants/clock.tar.xz BASE=0 ROUNDS=0 TESTS= CLOCKS="$3" \
    timeout "$4" bash $V "$2" >"$W/$1-clocks.log" 2>&1
  tail -4 "$W/$1-clocks.log"
}
if [ "${1:-}" = pack ]; then
  OUT=/tmp/pack PACK=build-variants/clock.tar.xz BUILD=build TESTS= bash $V $CLOCK_MAIN $CLOCK_PAIRS
  OUT=/tmp/pack PACK=build-variants/main.tar.xz BUILD=build TESTS="$T" bash $V $P/e4m3-epilogue-scale-widths.patch \
    $P/e4m3-row-pairs-epilogue-scales.patch $P/decode-gemm1-k-pairs.patch \
    $P/decode-gemm1-k-pairs.patch+$P/decode-gemm1-k-parts-four.patch $P/decode-loads-first.patch
  ninja -C build mma_probe && cp build/mma_probe build-variants/
  exit
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv | tee -a "$W/gpu.txt"
for step in "$@"; do
  start=$SECONDS
  case $step in
    mma-probe)  # the consumer K loops' rates with no loads (~10 s): is the e4m3 tile's ~45% the loop's own?
      timeout 60 build-variants/mma_probe >"$W/mma-probe.txt" 2>&1
      cat "$W/mma-probe.txt" ;;
    kpairs)
      OUT=$W/k PREBUILT=build-variants/main.tar.xz BASE=bench ROUNDS=2 AB_SECONDS=150 \
        MODELS="deepseek-v3 qwen3-235b-a22b qwen3-30b-a3b mixtral-8x7b" QUANTS="bf16 fp8_block" EPS=8 \
        TOKENS=1,2,4,16 TESTS="test_moe_gpu" timeout 330 bash $V $P/decode-gemm1-k-pairs.patch \
        $P/decode-gemm1-k-pairs.patch+$P/decode-gemm1-k-parts-four.patch >"$W/kpairs.log" 2>&1
      tail -45 "$W/kpairs.log" ;;
    kshort)
      OUT=$W/k PREBUILT=build-variants/main.tar.xz BASE=bench ROUNDS=2 AB_SECONDS=70 \
        MODELS="deepseek-v3 qwen3-235b-a22b" QUANTS="bf16 fp8_block" EPS=8 \
        TOKENS=1,2,16 TESTS="test_moe_gpu" timeout 190 bash $V $P/decode-gemm1-k-pairs.patch >"$W/kpairs.log" 2>&1
      tail -30 "$W/kpairs.log" ;;
    suite)
      OUT=$W/t PREBUILT=build-variants/main.tar.xz ROUNDS=0 TESTS="$T" timeout 200 bash $V >"$W/suite.log" 2>&1
      tail -10 "$W/suite.log" ;;
    clocks)
      clock_step c $CLOCK_MAIN "deepseek-v3:fp8_block:1 deepseek-v3:bf16:1 qwen3-235b-a22b:fp8_block:16 \
qwen3-30b-a3b:fp8_block:4096 qwen3-235b-a22b:fp8_block:16384" 120 ;;
    clocks-kpairs)  # the clocks with the K pairs: do the pairs' routed CTAs still start ~15 us late?
      clock_step ck $CLOCK_PAIRS "deepseek-v3:fp8_block:1 deepseek-v3:bf16:1 qwen3-235b-a22b:fp8_block:1" 90 ;;
    loads)  # fewer trips to memory before the decode tiles' loads (decode-loads-first); T=256: the medium tile
      OUT=$W/l PREBUILT=build-variants/main.tar.xz BASE=bench ROUNDS=2 AB_SECONDS=150 \
        MODELS="deepseek-v3 qwen3-235b-a22b qwen3-30b-a3b" QUANTS="bf16 fp8_block" EPS=8 TOKENS=1,2,16,256,16384 \
        TESTS="test_route_gpu test_moe_gpu" timeout 300 bash $V $P/decode-loads-first.patch >"$W/loads.log" 2>&1
      tail -30 "$W/loads.log" ;;
    widths)
      OUT=$W/s PREBUILT=build-variants/main.tar.xz BASE=bench ROUNDS=2 AB_SECONDS=160 \
        MODELS="qwen3-30b-a3b qwen3-235b-a22b llama4-maverick deepseek-v3" QUANTS="fp8_channel fp8_tensor" EPS="1 8" \
        TOKENS=1024,4096,16384 TESTS="test_moe_gpu" timeout 330 bash $V $P/e4m3-epilogue-scale-widths.patch \
        $P/e4m3-row-pairs-epilogue-scales.patch >"$W/widths.log" 2>&1
      tail -40 "$W/widths.log" ;;
    profiles)  # main's kernels one at a time at T=16384 on e4m3, where the small kernels are what is left (KERNELS)
      OUT=$W/p PREBUILT=build-variants/main.tar.xz ROUNDS=0 TESTS= \
        PROFILES="qwen3-235b-a22b:fp8_block:16384 qwen3-30b-a3b:fp8_block:16384 deepseek-v3:fp8_block:16384" \
        timeout 150 bash $V >"$W/profiles.log" 2>&1
      tail -45 "$W/profiles.log" ;;
    table-base)
      OUT=$W/b PREBUILT=build-variants/main.tar.xz BASE=bench ROUNDS=0 TESTS= TABLE_TREE=base \
        TABLE_QUANTS="bf16 fp8_block fp8_channel fp8_tensor" TABLE_TOKENS=1,16,64,256,1024,2048,4096,16384 \
        TABLE_SECONDS=400 timeout 520 bash $V >"$W/table.log" 2>&1
      tail -3 "$W/table.log" ;;
    *) echo "== $step: no such step" ;;
  esac
  echo "== step $step: $((SECONDS - start)) s"
done
tar -cJf "$OUT/w.tar.xz" -C /tmp w
