#!/usr/bin/env bash
# Issue 29, round 7 (1,500 steps, four runs at once, niced): round 6's winner (8-bit
# averages at H=24 from step 150 after a 4-bit warm-up, the outer step cooling down into
# a plain average over the last 30% of its steps) on seeds 1 and 2; DDP seed 1 again
# (commit ae225ee's 1.2193 is the reference of seed 1: does it reproduce on today's code?);
# and the same recipe at H=32 from step 100 (fewer bytes: how far does it reach?).
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--steps 1500 --warmup 50 --eval-every 100 --no-progress"
recipe="--bits 8 --warmup-bits 4 --outer-cooldown 0.3"
for run in "cool03_d24_s150_seed1 diloco24 $recipe --start 150 --seed 1" \
           "cool03_d24_s150_seed2 diloco24 $recipe --start 150 --seed 2" \
           "ddp_seed1 ddp --seed 1" \
           "cool03_d32_s100 diloco32 $recipe --start 100 --seed 0"; do
  set -- $run
  name=r7_$1; method=$2; shift 2
  nice -n 10 python examples/lm.py --compare $method "$@" $common --json $out/$name.json > $out/$name.log 2>&1 &
done
wait
