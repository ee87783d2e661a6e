#!/usr/bin/env bash
# Issue 29, round 4 (1,500 steps, seed 0, four runs at once, niced): which of the 4-bit
# warm-up and the 4-bit averages costs round 3's +0.12, and 8-bit averages at H=32/64.
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--steps 1500 --warmup 50 --eval-every 100 --no-progress --seed 0 --start 200 --outer-decay"
for run in "d32_q8w4 diloco32 --bits 8 --warmup-bits 4" "d32_q4w8 diloco32 --bits 4 --warmup-bits 8" "d64_q8w4 diloco64 --bits 8 --warmup-bits 4" "d32_q8w8 diloco32 --bits 8 --warmup-bits 8"; do
  set -- $run
  name=r4_$1_s200; method=$2; shift 2
  nice -n 10 python examples/lm.py --compare $method "$@" $common --json $out/$name.json > $out/$name.log 2>&1 &
done
wait
