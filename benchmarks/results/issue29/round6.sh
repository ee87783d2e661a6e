#!/usr/bin/env bash
# Issue 29, round 6 (1,500 steps, four runs at once, niced): round 5's best (8-bit
# averages at H=24 from step 150 after a 4-bit warm-up, seed 0) with the outer step's
# end changed. The cosine to 0 over the outer steps applies, late in the run, less than
# the replicas' own progress (Nesterov 0.9 applies ~lr / (1 - 0.9) of a pseudo-gradient
# in all, under 1 once lr < 0.14): a cosine that ends at 0.2 x 0.7, a cool-down into a
# plain average over the last 30% or 50% of the outer steps, and no decay at all.
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--steps 1500 --warmup 50 --eval-every 100 --no-progress --bits 8 --warmup-bits 4 --start 150 --seed 0"
for run in "floor02 --outer-decay --outer-floor 0.2" "cool03 --outer-cooldown 0.3" "cool05 --outer-cooldown 0.5" "nodecay"; do
  set -- $run
  name=r6_q8w4_d24_s150_$1; shift 1
  nice -n 10 python examples/lm.py --compare diloco24 "$@" $common --json $out/$name.json > $out/$name.log 2>&1 &
done
wait
