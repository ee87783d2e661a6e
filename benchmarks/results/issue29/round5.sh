#!/usr/bin/env bash
# Issue 29, round 5 (1,500 steps, four runs at once, niced): 8-bit averages after a
# 4-bit warm-up, an earlier switch with more frequent averages, and a second seed of
# round 4's best (DDP, seed 1, commit ae225ee: 1.2193).
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--steps 1500 --warmup 50 --eval-every 100 --no-progress --bits 8 --warmup-bits 4 --outer-decay"
for run in "d32_s100 diloco32 --start 100 --seed 0" "d16_s100 diloco16 --start 100 --seed 0" "d24_s150 diloco24 --start 150 --seed 0" "d32_s200_seed1 diloco32 --start 200 --seed 1"; do
  set -- $run
  name=r5_q8w4_$1; method=$2; shift 2
  nice -n 10 python examples/lm.py --compare $method "$@" $common --json $out/$name.json > $out/$name.log 2>&1 &
done
wait
