#!/usr/bin/env bash
# Issue 29, round 8 (1,500 steps, four runs at once, niced): round 7 put the slow-link
# recipe (H=24 from 150, cool-down over the last 30%) at +0.016 and +0.017 on seeds 1
# and 2 (seed 0: -0.012). Two variants on those two seeds: the cool-down over the last
# 50% (seed 0: -0.0095), and H=32 from step 200 (a longer 4-bit warm-up, 1/105 of DDP's
# bytes).
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--steps 1500 --warmup 50 --eval-every 100 --no-progress --bits 8 --warmup-bits 4"
for run in "cool05_d24_s150_seed1 diloco24 --outer-cooldown 0.5 --start 150 --seed 1" \
           "cool05_d24_s150_seed2 diloco24 --outer-cooldown 0.5 --start 150 --seed 2" \
           "cool03_d32_s200_seed1 diloco32 --outer-cooldown 0.3 --start 200 --seed 1" \
           "cool03_d32_s200_seed2 diloco32 --outer-cooldown 0.3 --start 200 --seed 2"; do
  set -- $run
  name=r8_$1; method=$2; shift 2
  nice -n 10 python examples/lm.py --compare $method "$@" $common --json $out/$name.json > $out/$name.log 2>&1 &
done
wait
