#!/usr/bin/env bash
# Issue 29, round 13 (1,500 steps, four runs at once, niced). Round 12: outer momentum
# 0.8 instead of 0.9 (the 30% cool-down kept) put seeds 1 and 2 ahead of DDP (-0.015,
# -0.024; the recipe +0.016, +0.017); outer lr 0.5 barely moved them (+0.015, +0.025).
# Now: momentum 0.8 on seed 0 at the recipe's bytes, and at 1/100 of DDP's bytes on the
# node links (ledger.link_total(), what the veths count): a 4-bit warm-up of 100 steps
# (53.9 MB) and 44 8-bit averages at H=32 (44.8 MB): 98.7 MB against DDP's 10,058.5,
# on seeds 0, 1, 2.
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=benchmarks/results/issue29
common="--recipe slow-link --no-progress --outer-momentum 0.8"
for run in "om08_seed0 --seed 0" \
           "om08_d32_s100_seed0 --compare diloco32 --start 100 --seed 0" \
           "om08_d32_s100_seed1 --compare diloco32 --start 100 --seed 1" \
           "om08_d32_s100_seed2 --compare diloco32 --start 100 --seed 2"; do
  set -- $run
  name=r13_$1; shift 1
  nice -n 10 python examples/lm.py $common "$@" --json $out/$name.json > $out/$name.log 2>&1 &
done
wait
